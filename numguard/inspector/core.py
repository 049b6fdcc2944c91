"""The Inspector: watch()'s object. It builds the parts and is their public face: the batch life
cycle (numguard.inspector.cycle: ring, weight table, flag reader, reporter), the module hooks and
the batch state they hold (numguard.inspector.hooks), and the optional features behind one
lifecycle (numguard.inspector.features, added by _add_features below).

One watched tensor, top to bottom: a module's forward hook (``ModuleHooks.module_hook``, or the
native fast path it tries first) flattens the call (``frames.flatten_call``) and hands the tensors
to ``FrameRing.record``, one ``record_`` launch into the device ring, no host sync. The root's
return (or a batch bracket's end) ends the batch (``BatchCycle.end_batch``): the ``FlagReader``
reads the state (one tiny device->host copy, or an async copy read next batch) and returns a
``CheckStatus``; healthy frames are trimmed to report context, a trip goes to the ``Reporter``,
which copies the ring once, builds the report and raises, warns or dumps.
"""
from __future__ import annotations

import operator
import warnings
import weakref
from typing import NamedTuple

import torch

from .. import env
from .. import ownership as _ownership
from .. import process as _process
from ..errors import InspectorWarning
from . import frames as _frames
from . import gradients as _gradients
from . import graph as _graph
from .cycle import BatchCycle
from .graph import GraphRecorder
from .hooks import BatchState, ModuleHooks, active
from .options import STDOUT, WatchOptions
from .operations import OperationRecorder
from .replay import InputKeeper
from .norm_stats import NormStatsWatch
from .quant_watch import QuantWatch
from .rerun import RootRerun
from .watched_history import HistoryFeature


_watched = weakref.WeakKeyDictionary()  # module -> open inspectors whose hooks are on it
_roots = weakref.WeakKeyDictionary()    # root module -> the open Inspector watching it as its root


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
    if not _roots:
        _graph.stop_following_new_wrappers()
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


def _model_device(model):
    for tensor in list(model.parameters()) + list(model.buffers()):
        if tensor.device.type != "meta":
            return tensor.device
    return torch.device("cpu")


class Inspector:
    """Watches every module of `model` (forward hooks), keeping stats on the device until a
    NaN/Inf trips. Use `watch(model, ...)` to create one; it is a context manager, and `close()`
    removes every hook it added.

    Args:
        model: the root module. Its forward returning ends a batch (batches are 0-indexed), or
            the end of a batch bracket (``with inspector.batch(step=...):``).
{options}

    What trips: a NaN/Inf in a module's output (or weights). A NaN/Inf a module takes and does not
    pass on (an attention mask's -inf, a log(0) it throws away: its outputs are finite) is context,
    shown in the report but no trip (NOTE: [context records]); the drop-in keeps Transformers' rule.
    """

    _inputs_trip = False  # NOTE: [context records]
    _hooks_class = ModuleHooks

    def __init__(self, model: torch.nn.Module, max_frames_to_save=env.WATCH_DEFAULTS["max_frames_to_save"],
                 trace_batch_nums=env.WATCH_DEFAULTS["trace_batch_nums"],
                 abort_after_batch_num=env.WATCH_DEFAULTS["abort_after_batch_num"], **options):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"numguard.watch: model must be a torch.nn.Module, got {type(model).__name__}")
        self.options = opts = WatchOptions.from_arguments(
            max_frames_to_save=max_frames_to_save, trace_batch_nums=trace_batch_nums,
            abort_after_batch_num=abort_after_batch_num, **options)
        self._model_ref = weakref.ref(model)
        self._created_at = _process.call_site(unknown="an unknown place")
        self._registered = []             # weak refs of the modules counted in _watched
        self._named = {}                  # (name, class) -> Owner for record_frame
        self.verdicts = []                # every rerun verdict (rerun=True, numguard.rerun_step), oldest first
        # The features (numguard.inspector.features), called in this order at each point of the
        # lifecycle (numguard.inspector.cycle); _add_features names the ones other parts reach for.
        self.features = []
        self._backward_watch = self._ops = self._keeper = self._rerun = self._history = self._quant = None
        self._batch, self._owners = BatchState(), []
        self._cycle = cycle = BatchCycle(opts, self._batch, self._owners, self.features, _model_device(model),
                                         self._inputs_trip, self._trip_reported, self._abort_message)
        self._ring, self._weights, self._reader, self._reporter = cycle.ring, cycle.weights, cycle.reader, cycle.reporter
        self._warned, self._warn_once, self._move_to = cycle.warned, cycle.warn_once, cycle.move_to
        self._graph = cycle.graph = _add_graph_recorder(self)  # frames recorded inside compiled graphs, or None
        try:
            if opts.ops:
                self._ops = self._add(OperationRecorder(self))
                self._ops.tag_nodes = opts.backward   # name backward operations by forward module
                self._reporter.builder.lineage = self._ops.lineage
            self._hooks = hooks = self._hooks_class(self, cycle, self._batch, self._owners, opts.headroom, self._ops)
            self._module_names, self._handles = hooks.module_names, hooks.handles
            self._ops_call, self._ops_failed = hooks.ops_call, hooks.ops_failed
            _take_root(model, self)
            self._install_hooks(model)
            self._registered = _count_watched(list(self._module_names.keys()))
            _add_features(self, model, opts)
        except BaseException:
            self.close(check=False)  # a watch() that fails leaves no hook behind
            raise

    def _install_hooks(self, model):
        self._hooks.install(model)
        self._root_owner = self._hooks.root_owner

    def _add(self, feature):
        self.features.append(feature)
        return feature

    # -- public surface --------------------------------------------------------------------------
    @property
    def batch_number(self) -> int:
        """The 0-indexed current batch: the batch whose forward is running, or whose forward last
        finished (its backward and optimizer step see the same number)."""
        return self._cycle.batch_index()

    def _batch_index(self) -> int:
        return self._cycle.batch_index()

    def batch(self, step=None, label=None, inputs=()):
        """A bracket around one batch, for a training loop or a framework's own batch hooks:
        ``with inspector.batch(step=trainer.global_step): ...`` (or ``.begin()`` ... ``.end()``).
        The batch begins and ends there instead of at the root module's forward (a root call
        inside it continues it). `step`, when given, is named next to the batch number in trip
        messages and reports (as `label`, default the label set_step_counter gave, else
        "global_step"). ``end(output)`` checks the batch's result (its loss) as the root's output,
        with `inputs` as the root's inputs (numguard.inspector.hooks.BatchBracket)."""
        if step is not None:
            counter = self._reporter.step_counter
            label = label if label is not None else counter[0] if counter is not None else "global_step"
            self._reporter.step_counter = (str(label), lambda: step)
        return self._hooks.bracket(inputs)

    @property
    def module_names(self):
        """Mapping module -> qualified name (weak keys; the first name of a reused module)."""
        return self._module_names

    @property
    def model(self):
        return self._model_ref()

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
            hooks = getattr(self, "_hooks", None)
            if hooks is not None:
                hooks.remove()
            self._backward_watch = self._cycle.gradients = None
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
            self._ring.record(owner, xs, list(labels), kinds, section, False, False, self._cycle.batch_index())
            return
        ops.paused += 1  # numguard's own recording (e.g. a gradient tap in the backward) is no operation
        try:
            self._ring.record(owner, xs, list(labels), kinds, section, False, False, self._cycle.batch_index())
        finally:
            ops.paused -= 1

    def check(self, where: str = "batch end") -> None:
        """Look at the trip flag now (check="sync": one tiny device->host read; "async": read the
        copy made at the previous check and start a new one) and handle a trip: print the report,
        then raise / warn / dump as configured."""
        self._cycle.check(where)

    # -- what numguard.backward uses (a small protocol; it never reaches into private state) -----
    def ring_position(self) -> int:
        """Where the next record goes: frames recorded from here on are 'after' this position."""
        return self._ring.pos

    def check_now(self, where: str) -> None:
        """A synchronous check whatever `check` says (the state read now covers what a pending
        async copy held)."""
        self._cycle.check_now(where)

    def forget_trip_from(self, position: int, where: str) -> None:
        """Records from `position` on are not a trip (e.g. the gradients of a step GradScaler
        skipped). One read of the state: a trip recorded before `position` is still handled."""
        self._cycle.forget_trip_from(position, where)

    # -- precision advice, spikes, rerun verdicts, the what-if (the features' results) -----------
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


def _amax_key(opts):
    """amax_group's key for the cross-rank amax check (numguard.distributed.amax), None when off."""
    if opts.amax_group is None:
        return None
    if not opts.quant:
        raise env.OptionError("amax_group", opts.amax_group, "pass quant=FORMAT too: the amax compared across "
                                                             "ranks are those quant= measures")
    from ..distributed import amax
    try:
        return amax.group_key(opts.amax_group)
    except (ValueError, RuntimeError) as exc:
        raise env.OptionError("amax_group", opts.amax_group, str(exc)) from None


def _add_features(insp, model, opts):
    """The features that watch()'s options ask for, after the module hooks (numguard.inspector.
    features; a new feature is its module plus a line here)."""
    device = insp._ring.device
    if opts.backward:  # handed operation mode, to enter it for each backward
        insp._backward_watch = insp._cycle.gradients = insp._add(
            _gradients.watch_gradients(insp, model, opts, insp._ops))
    insp._history = insp._add(HistoryFeature(insp, device, opts.spikes))
    # NOTE: [running statistics]; with extras only: the drop-in keeps Transformers' rule (no buffers).
    norms = NormStatsWatch(insp, model) if opts.extras else None
    if norms is not None and norms.layers:
        insp._add(norms)
    amax_key = _amax_key(opts)
    insp._quant = insp._add(QuantWatch(insp, opts.quant, amax_key)) if opts.quant else None
    if opts.replay:
        insp._keeper = insp._add(InputKeeper(insp, device))
        insp._keeper.install(insp._owners, insp._handles)
    if opts.rerun:
        insp._rerun = insp._add(RootRerun(insp, device, opts.recover))
        insp._rerun.install(model, insp._handles)
        insp._reporter.attribution = insp._rerun.attribution
        insp._reporter.settle = insp._rerun.peers.settle_trip   # multi-rank verdicts (NOTE: [device verdict])
        insp._reader.request = insp._rerun.peers.request
    insp._handles += _graph.watch_wrapper_calls(insp, model, _roots)   # NOTE: [wrappers compiled before watch]
    if opts.replicas:  # removed with the other hooks at close()
        from ..distributed import replicas
        insp._handles.append(replicas.attach(insp, model))


# watch()'s options, read-only under the names they always had (report_to is settable above; the
# three of Transformers' DebugUnderflowOverflow are plain attributes there, settable here too).
for _name, _option in {"on_trip": "on_trip", "check_mode": "check", "backward": "backward",
                       "headroom": "headroom", "dump_dir": "dump_dir", "extras": "extras",
                       "scaler_skips": "scaler_skips", "ops": "ops", "replay": "replay",
                       "rerun": "rerun", "quant": "quant", "check_every": "check_every"}.items():
    setattr(Inspector, _name, property(operator.attrgetter(f"options.{_option}"),
                                       doc=f"watch()'s {_option} option (read-only)"))


def _option_setter(name):
    def set_option(inspector, value):
        setattr(inspector.options, name, value)
    return set_option


for _name in ("max_frames_to_save", "trace_batch_nums", "abort_after_batch_num"):
    setattr(Inspector, _name, property(operator.attrgetter(f"options.{_name}"), _option_setter(_name),
                                       doc=f"watch()'s {_name} option"))

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
