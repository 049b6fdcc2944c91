"""The Inspector: module hooks wired to the ring, the weight table, the flag reader and the
reporter, and the batch life cycle that ties them together.

One watched tensor, top to bottom: a module's forward hook (``Inspector._hook``) flattens the call
(``frames.flatten_call``) and hands the tensors to ``FrameRing.record``, one ``record_`` launch
into the device ring, no host sync. The root's return ends the batch (``_end_batch``): the
``FlagReader`` reads the state (one tiny device->host copy, or an async copy read next batch) and
returns a ``CheckStatus``; healthy frames are trimmed to report context, a trip goes to the
``Reporter``, which copies the ring once, builds the report and raises, warns or dumps.
"""
from __future__ import annotations

import operator
import sys
import warnings
import weakref
from typing import NamedTuple

import torch

from .. import env
from .. import ownership as _ownership
from .. import process as _process
from ..errors import AbortAfterBatch, InspectorWarning, NonFiniteError, SpikeError
from . import frames as _frames
from . import checks as _checks
from . import gradients as _gradients
from . import graph as _graph
from .checks import FlagReader
from .graph import GraphRecorder
from .hooks import BatchState, ModuleHooks, active
from .options import STDOUT, WatchOptions
from .operations import OperationRecorder
from .replay import InputKeeper
from .norm_stats import NormStatsWatch
from .quant_watch import QuantWatch
from .rerun import RootRerun
from .ring import FrameRing
from .trips import Reporter
from .watched_history import HistoryFeature
from .weights import WeightTable



_watched = weakref.WeakKeyDictionary()  # module -> open inspectors whose hooks are on it
_roots = weakref.WeakKeyDictionary()    # root module -> the open Inspector watching it as its root


def _caller_site():
    """file:line of the first caller outside numguard and torch (where watch() was called)."""
    return _process.call_site(unknown="an unknown place")


def _take_root(model, inspector):
    """Make `inspector` the one open Inspector whose root is `model`. One started by NUMGUARD=1
    gives way to the script's own; any other is an error: the second of two inspectors on one model
    would never report (the first one's batch-end check raises before the second one's runs)."""
    first = _roots.get(model)
    if first is not None and not first._batch.closed:
        if _ownership.started_here(first):
            _ownership.give_way(inspector=first)
        else:
            raise ValueError(
                f"numguard.watch: this {type(model).__name__} is already watched by an open Inspector (made "
                f"at {first._created_at}); a second Inspector on the same model would never report a NaN/Inf. "
                "Close the first one before watching again (its .close(), or watch inside "
                "`with numguard.watch(model):` so it closes itself), or keep using it.")
    _roots[model] = inspector


def is_watched(module: torch.nn.Module) -> bool:
    """Whether an open Inspector has its hooks on `module` (e.g. the script's own watch())."""
    return bool(_watched.get(module))


def _count_watched(modules) -> list:
    """Count `modules` as watched once more; the weak references _forget uncounts."""
    for module in modules:
        _watched[module] = _watched.get(module, 0) + 1
    return [weakref.ref(module) for module in modules]


def _forget(inspector) -> None:
    """A closed inspector leaves the registries: it uncounts only what it counted (a watch() that
    failed half-way must not uncount another inspector's modules) and gives up its root. (`is not
    None`, not truth: an OptimizedModule's truth is its model's len(), which may not exist.)"""
    for module in [m for m in (ref() for ref in inspector._registered) if m is not None]:
        count = _watched.get(module, 0) - 1
        if count > 0:
            _watched[module] = count
        else:
            _watched.pop(module, None)
    inspector._registered.clear()
    model = inspector._model_ref()
    if model is not None and _roots.get(model) is inspector:
        del _roots[model]
    if inspector in active:
        active.remove(inspector)


def _close_features(features) -> None:
    for feature in features:
        try:
            feature.close()
        except Exception as exc:  # closing never fails the user's job
            warnings.warn(f"numguard: closing {type(feature).__name__} failed: {exc}", InspectorWarning)


class Held(NamedTuple):
    """Inspector.held(): frames held as report context (module name, section, batch), ring size
    in records, weight tables, tensors remembered for reuse, hooks installed."""
    frames: list
    ring_records: int
    weight_tables: int
    remembered_tensors: int
    hooks: int


def _is_distributed_failure(exc: BaseException) -> bool:
    errors = sys.modules.get("numguard.distributed.errors")  # loaded only when distributed is in use
    return errors is not None and isinstance(exc, errors.DistributedOperationException)


def _model_device(model):
    for tensor in list(model.parameters()) + list(model.buffers()):
        if tensor.device.type != "meta":
            return tensor.device
    return torch.device("cpu")


class Inspector(ModuleHooks):
    """Watches every module of `model` (forward hooks), keeping stats on the device until a
    NaN/Inf trips. Use `watch(model, ...)` to create one; it is a context manager, and `close()`
    removes every hook it added.

    Args:
        model: the root module. Its forward returning ends a batch (batches are 0-indexed).
{options}

    What trips: a NaN/Inf in a module's output (or weights). A NaN/Inf a module takes and does not
    pass on (an attention mask's -inf, a log(0) it throws away: its outputs are finite) is context,
    shown in the report but no trip (NOTE: [context records]); the drop-in keeps Transformers' rule.
    """

    _inputs_trip = False  # NOTE: [context records]

    def __init__(self, model: torch.nn.Module, max_frames_to_save=env.WATCH_DEFAULTS["max_frames_to_save"],
                 trace_batch_nums=env.WATCH_DEFAULTS["trace_batch_nums"],
                 abort_after_batch_num=env.WATCH_DEFAULTS["abort_after_batch_num"], **options):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"numguard.watch: model must be a torch.nn.Module, got {type(model).__name__}")
        self.options = WatchOptions.from_arguments(
            max_frames_to_save=max_frames_to_save, trace_batch_nums=trace_batch_nums,
            abort_after_batch_num=abort_after_batch_num, **options)
        opts = self.options
        self.max_frames_to_save = opts.max_frames_to_save
        self.trace_batch_nums = opts.trace_batch_nums
        self.abort_after_batch_num = opts.abort_after_batch_num
        self._model_ref = weakref.ref(model)
        self._handles = []
        self._batch = BatchState()        # closed / open / depth / done: the hooks' batch state
        self._warned = set()
        self._owners = []
        self._module_names = weakref.WeakKeyDictionary()
        self._named = {}                  # (name, class) -> Owner for record_frame
        self._thread = None
        self._child_hooks = []            # pre-hooks timing the root's first child (hooks.py)
        self._first_child = None
        # The features (numguard.inspector.features), called in this order at each point of the
        # lifecycle; the attributes name the ones other parts reach for.
        self.features = []
        self._backward_watch = None       # backward=True (numguard.inspector.gradients)
        self._ops = None                  # ops=True (numguard.inspector.operations)
        self._keeper = None               # replay=True: each module's last inputs (numguard.inspector.replay)
        self._rerun = None                # rerun=True: the root's kept calls (numguard.inspector.rerun)
        self.verdicts = []                # every rerun verdict (rerun=True, numguard.rerun_step), oldest first
        self._history = None              # history, advice and spikes (numguard.inspector.watched_history)
        self._quant = None                # quant=: the low-precision what-if (numguard.inspector.quant_watch)
        self._registered = []             # weak refs of the modules counted in _watched
        self._created_at = _caller_site()
        self._ring = FrameRing(max(64, 8 * opts.max_frames_to_save), _model_device(model),
                               on_drop=self._frames_dropped, on_unchecked=self._unchecked_tensor,
                               inputs_trip=self._inputs_trip)
        self._weights = WeightTable(self._owners, opts.headroom, on_unchecked=self._unchecked_tensor)
        self._reader = FlagReader(self._ring, opts.check, self._warned)
        self._reader.skipped_steps = lambda: getattr(self._backward_watch, "scaler_skipped_steps", 0)
        self._reporter = Reporter(self._ring, self._weights, opts, self._warned, self._reader)
        self._graph = _add_graph_recorder(self)  # frames recorded inside compiled graphs, or None
        try:
            if opts.ops:
                self._ops = self._add(OperationRecorder(self))
                self._ops.tag_nodes = opts.backward   # name backward operations by forward module
                self._reporter.builder.lineage = self._ops.lineage
            _take_root(model, self)
            self._install_hooks(model)
            self._registered = _count_watched(list(self._module_names.keys()))
            _add_features(self, model, opts)
            self._reporter.annotate = self._annotate_report
        except BaseException:
            self.close(check=False)  # a watch() that fails leaves no hook behind
            raise

    def _add(self, feature):
        self.features.append(feature)
        return feature

    # -- public surface --------------------------------------------------------------------------
    @property
    def batch_number(self) -> int:
        """The 0-indexed current batch: the batch whose forward is running, or whose forward last
        finished (its backward and optimizer step see the same number)."""
        return self._batch_index()

    def _batch_index(self) -> int:
        if self._batch.depth > 0 or self._batch.done == 0:
            return self._batch.done
        return self._batch.done - 1

    @property
    def module_names(self):
        """Mapping module -> qualified name (weak keys; the first name of a reused module)."""
        return self._module_names

    @property
    def model(self):
        return self._model_ref()

    @property
    def check_every(self) -> int:
        return self.options.check_every

    @property
    def trips(self) -> int:
        """Trips handled so far (on_trip="warn"/"dump" go on after one)."""
        return self._reporter.trips

    @property
    def last_report(self):
        """The last trip's report dictionary (numguard.dump's schema), or None."""
        return self._reporter.last_report

    @property
    def report_to(self):
        """Where reports and traces are printed (settable, checked like the watch() option)."""
        return self.options.report_to

    @report_to.setter
    def report_to(self, target):
        self.options.report_to = env.WATCH_VALIDATORS["report_to"](target)

    @property
    def batches_finished(self) -> int:
        """Root forwards that have returned."""
        return self._batch.done

    @property
    def in_forward(self) -> bool:
        """Whether a watched forward is running now."""
        return self._batch.depth > 0

    @property
    def backward_watcher(self):
        """The numguard.backward.BackwardWatcher of backward=True, or None."""
        return self._backward_watch

    def unwatched_modules(self) -> list:
        """Names of the modules numguard stopped watching after an internal error (each warned)."""
        return [o.name for o in self._owners if o.off]

    def set_step_counter(self, read, label: str = "global_step") -> None:
        """Name a framework's own step next to the batch number in trip messages and reports:
        `read()` returns it (e.g. ``lambda: trainer.state.global_step``); None removes it."""
        if read is not None and not callable(read):
            raise TypeError(f"numguard: set_step_counter(read={read!r}) needs a callable (or None)")
        self._reporter.step_counter = None if read is None else (str(label), read)

    def worst_headroom(self) -> float:
        """The largest abs max of a float16/bfloat16/float8 tensor among the frames held now (the
        last checked step's context), as a fraction of its dtype's largest finite value: 0.0 when
        none is low precision, inf when one is non-finite. One device->host copy of the ring."""
        return self._reporter.worst_headroom()

    def held(self) -> Held:
        """What the inspector holds now (its memory stays bounded however long a job runs)."""
        ring = self._ring
        return Held([(f.owner.name, f.section, f.batch) for f in ring.frames], ring.size,
                    len(self._weights.tables), ring.remembered(), len(self._handles))

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close(check=exc_type is None)
        return False

    def close(self, check: bool = True) -> None:
        """Remove every hook numguard added. With `check`, batches not checked yet are checked
        first (with the configured on_trip action)."""
        if self._batch.closed:
            return
        try:
            if check and (len(self._ring.frames) > self._ring.last_check_frames or self._reader.pending):
                self.check_now("close")
        finally:
            self._batch.closed = True
            _close_features(self.features)
            for h in self._handles:
                h.remove()
            self._handles.clear()
            self._backward_watch = None
            _forget(self)

    def record_frame(self, module_name: str, class_name: str, labels, values, section: str = "forward") -> None:
        """Record a frame of your own (no host sync). `values[i]` is shown on line `labels[i]`:
        tensors get a stats line, None a 'None' line, anything else a 'not a tensor' line.
        Frames whose section is not "forward" are reported in a section of their own
        ("Last N <section> frames:")."""
        if self._batch.closed:
            return
        if len(labels) != len(values):
            raise ValueError(f"numguard.record_frame: {len(labels)} labels but {len(values)} values; give "
                             "one label per value")
        owner = (self._named.get((module_name, class_name))  # the gradient taps' path: one lookup
                 or _frames.named_owner(self._named, module_name, class_name, self.options.headroom))
        xs, kinds = _frames.flatten_values(values)
        ops = self._ops
        if ops is None:
            self._ring.record(owner, xs, list(labels), kinds, section, False, False, self._batch_index())
            return
        ops.paused += 1  # numguard's own recording (e.g. a gradient tap in the backward) is no operation
        try:
            self._ring.record(owner, xs, list(labels), kinds, section, False, False, self._batch_index())
        finally:
            ops.paused -= 1

    def check(self, where: str = "batch end") -> None:
        """Look at the trip flag now (check="sync": one tiny device->host read; "async": read the
        copy made at the previous check and start a new one) and handle a trip: print the report,
        then raise / warn / dump as configured."""
        if self._batch.closed:
            return
        if self.options.check == "sync":
            self._handle(self._reader.read_now(where, self._batch_index()))
            return
        status = self._reader.read_async(where, self._batch_index())
        if status is not None:
            self._handle(status)
            if self._batch.closed:
                return
        self._reader.issue_async_copy(self._batch_index())

    # -- what numguard.backward uses (a small protocol; it never reaches into private state) -----
    def ring_position(self) -> int:
        """Where the next record goes: frames recorded from here on are 'after' this position."""
        return self._ring.pos

    def check_now(self, where: str) -> None:
        """A synchronous check whatever `check` says (the state read now covers what a pending
        async copy held)."""
        if self._batch.closed:
            return
        self._reader.forget_pending()
        self._handle(self._reader.read_now(where, self._batch_index()))

    def forget_trip_from(self, position: int, where: str) -> None:
        """Records from `position` on are not a trip (e.g. the gradients of a step GradScaler
        skipped). One read of the state: a trip recorded before `position` is still handled."""
        if self._batch.closed:
            return
        self._ring.merge_devices()  # other devices' trips too (NOTE: [one ring per device])
        tripped, first = self._ring.state[:2].tolist()
        if not tripped:
            return
        # A graph record is forgotten when it is a gradient's (the graphs' forward frames come first).
        if first < position or (GraphRecorder.owns(first) and not self._graph.records_gradient_at(first)):
            self.check_now(where)
        else:
            self._ring.reset_after_trip()
            self._reporter.forget_graph_frames()

    def _unchecked_tensor(self, owner, label, tensor):
        self._warn_once(*_frames.unchecked_warning(owner, label, tensor))  # once per module and label

    def _warn_once(self, key, message):
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, InspectorWarning, stacklevel=4)

    # -- the batch life cycle --------------------------------------------------------------------
    def _begin_batch(self):
        self._batch.open = True
        for feature in self.features:
            feature.begin_batch(self._batch.done)
        self._weights.record_or_stop(self._batch.done, self._ring, self._move_to, self._warn_once)

    def _move_to(self, device):
        self._ring.move_to(device)
        self._reader.device_moved()
        self._weights.forget()
        for feature in self.features:
            feature.device_moved(device)

    def _frames_dropped(self, cut):
        self._reader.frames_dropped(cut)
        frames = self._ring.frames
        self._weights.drop_before(frames[0].batch if frames else self._batch.done)

    def _end_batch(self):
        self._reader.forward_ended()  # host step time for the cross-rank numbers
        self._keep_first_child_hook()
        batch = self._batch.done
        self._batch.done += 1
        self._batch.open = False
        self._ring.forget_seen()
        self._ring.pending_start = self._batch.done
        for feature in self.features:
            self._guarded(feature.end_batch, batch)
        traced = batch in self.trace_batch_nums
        if traced:
            self._guarded(self._reporter.print_trace, batch)
        watcher = self._backward_watch
        if self._batch.done % self.options.check_every == 0 and (
                watcher is None or not watcher.takes_batch_end_check()):
            self._guarded(self.check, "batch end")
        if traced:
            # Like Transformers, a later report does not reach back into a traced batch.
            self._ring.floor = len(self._ring.frames)
        if self.abort_after_batch_num is not None and batch >= self.abort_after_batch_num:
            raise AbortAfterBatch(self._abort_message(batch))

    def _end_direct_call(self, owner):
        """A watched module called outside the root's forward has returned: check now, or its NaN
        would wait for a root call that may never come."""
        self._batch.open = False
        self._ring.forget_seen()
        self._guarded(self.check, f"{owner.name or '(root module)'} ({owner.cls}) {_checks.OUTSIDE_ROOT}")

    def _after_raised_forward(self, exc):
        """The root forward raised. A trip another inspector already raised (or an abort) is not
        reported twice; otherwise a NaN recorded before the exception is reported now, as a
        warning (this rank only: the other ranks are not at a check), while the exception goes on."""
        self._batch.open = False
        self._ring.forget_seen()
        if isinstance(exc, (NonFiniteError, AbortAfterBatch)):
            self._ring.reset_after_trip()
            self._reporter.forget_graph_frames()
            return
        status = self._reader.read_local(f"the forward raised {type(exc).__name__}", self._batch_index())
        if status.tripped:
            self._reporter.handle_trip(status, self._ring.host_copy(), on_report=self._trip_reported,
                                       on_trip="warn" if self.options.on_trip == "raise" else self.options.on_trip)

    def _handle(self, status):
        for feature in self.features:
            feature.check_read(status)
        host_ring = None
        if status.headroom_hit:
            host_ring = self._ring.host_copy()
            self._guarded(self._reporter.handle_headroom, host_ring, status.boundary)
        if status.any_trip:
            if host_ring is None and status.tripped:
                host_ring = self._ring.host_copy()
            self._reporter.handle_trip(status, host_ring, on_report=self._trip_reported)
        else:
            for feature in self.features:
                feature.frames_confirmed(self._ring, self._ring.last_check_frames, status.boundary)
            self._ring.keep_context(status.boundary, self.options.max_frames_to_save)

    def _guarded(self, fn, *args):
        try:
            return fn(*args)
        except (NonFiniteError, AbortAfterBatch, SpikeError):  # what the user asked numguard to raise
            raise
        except Exception as exc:
            if _is_distributed_failure(exc):
                # Ranks disagree or one never arrived: going on would hang the next collective.
                raise
            name = fn.__name__.strip("_").replace("_", " ")
            self._warn_once(("internal", fn.__name__),
                            f"numguard: {name} failed ({type(exc).__name__}: {exc}); training goes on")
            return None

    # -- precision advice (numguard.inspector.history, numguard.advice) --------------------------
    def advice(self):
        """Precision advice from the last batches' history (numguard.advice.Advice; print it for
        the table): worst first, the modules that will overflow float16, those whose gradients
        underflow it at the current loss scale (GradScaler's, when backward=True saw one; else 1,
        assumed), the loss-scale range that keeps every gradient in range, and the modules to keep
        in float32 / bfloat16 under autocast. One device->host copy of the history."""
        from .. import advice as _advice

        return _advice.advise(self.history())

    def quant_table(self) -> list:
        """quant=: the what-if rows, worst first ([] when off; numguard.inspector.quant_watch)."""
        return [] if self._quant is None else self._quant.table()

    def history(self) -> dict:
        """The per-module history as plain data (the "history" field of a dump)."""
        return self._history.to_dict()

    def attributions(self) -> list:
        """Every rerun verdict (rerun=True, numguard.rerun_step), oldest first: numguard.Attribution."""
        return list(self.verdicts)

    def spikes(self) -> list:
        """Every spike found so far (spikes=True), oldest first: dicts of module, class, quantity,
        value, baseline, factor, batch, rank."""
        return self._history.found_spikes()

    def _annotate_report(self, report, offender):
        """Fields the features add to a trip's report before it is rendered (the module history;
        with replay=True the replay of the first bad module)."""
        for feature in self.features:
            feature.annotate_report(report, offender)

    # -- what a subclass may change --------------------------------------------------------------
    def _trip_reported(self, report, frames_after):
        """A trip's report is built; `frames_after` module frames were recorded after the offender
        (numguard checks at the batch end, not inside the offending module's hook)."""

    def _abort_message(self, batch):
        done = self._batch.done
        return (f"numguard: aborting after batch_number={batch} ({done} batch{'es' if done != 1 else ''} run) "
                f"as requested by abort_after_batch_num={self.abort_after_batch_num}")


def _add_graph_recorder(insp):
    """The recorder of module frames inside compiled graphs, added first (None if it cannot be)."""
    try:
        insp._reporter.graph = insp._add(GraphRecorder(insp, insp._ring.device))
        return insp._reporter.graph
    except Exception as exc:  # numguard's own failure must not kill the job
        insp._warn_once(("graph",), f"numguard: cannot record module frames inside compiled graphs "
                                    f"({type(exc).__name__}: {exc}); a compiled model is checked at its "
                                    "output and weights only")
        return None


def _add_features(insp, model, opts):
    """The features that watch()'s options ask for, after the module hooks (numguard.inspector.
    features; a new feature is its module plus a line here)."""
    device = insp._ring.device
    if opts.backward:  # handed operation mode, to enter it for each backward
        insp._backward_watch = insp._add(_gradients.watch_gradients(insp, model, opts, insp._ops))
    insp._history = insp._add(HistoryFeature(insp, device, opts.spikes))
    # NOTE: [running statistics]; with extras only: the drop-in keeps Transformers' rule (no buffers).
    norms = NormStatsWatch(insp, model) if opts.extras else None
    if norms is not None and norms.layers:
        insp._add(norms)
    insp._quant = insp._add(QuantWatch(insp, opts.quant)) if opts.quant else None
    if opts.replay:
        insp._keeper = insp._add(InputKeeper(insp, device))
        insp._keeper.install(insp._owners, insp._handles)
    if opts.rerun:
        insp._rerun = insp._add(RootRerun(insp, device, opts.recover))
        insp._rerun.install(model, insp._handles)
        insp._reporter.attribution = insp._rerun.attribution
    insp._handles += _graph.watch_wrapper_calls(insp, model)   # NOTE: [wrappers compiled before watch]
    if opts.replicas:  # removed with the other hooks at close()
        from ..distributed import replicas
        insp._handles.append(replicas.attach(insp, model))


# watch()'s options, read-only under the names they always had (report_to is settable).
for _name, _option in {"on_trip": "on_trip", "check_mode": "check", "backward": "backward",
                       "headroom": "headroom", "dump_dir": "dump_dir", "extras": "extras",
                       "scaler_skips": "scaler_skips", "ops": "ops", "replay": "replay",
                       "rerun": "rerun", "quant": "quant"}.items():
    setattr(Inspector, _name, property(operator.attrgetter(f"options.{_option}"),
                                       doc=f"watch()'s {_option} option (read-only)"))

if Inspector.__doc__:  # the options' entries come from their one table (None under python -OO)
    Inspector.__doc__ = Inspector.__doc__.replace("{options}", env.options_doc(indent=8))


def watch(model: torch.nn.Module, max_frames_to_save=env.UNSET, trace_batch_nums=env.UNSET,
          abort_after_batch_num=env.UNSET, **options) -> Inspector:
    """Watch every module of `model`; returns an Inspector (a context manager). See Inspector
    for the options (numguard.env.WATCH_OPTIONS). Arguments left out take their NUMGUARD_*
    variable (numguard.env), then numguard.env.WATCH_DEFAULTS."""
    passed = dict(options, max_frames_to_save=max_frames_to_save, trace_batch_nums=trace_batch_nums,
                  abort_after_batch_num=abort_after_batch_num)
    return Inspector(model, **env.resolve_watch_options(passed))


__all__ = ["Inspector", "watch", "is_watched", "STDOUT"]
