"""The Inspector: module hooks that record stats into a device-side ring without host syncs, and
report the frames that led to the first NaN/Inf in the format of Transformers'
``DebugUnderflowOverflow``.

Data flow:

- every module gets a forward hook (with kwargs). A hook flattens the frame's tensors (inputs,
  keyword inputs, outputs and their nested containers) and makes ONE ``numguard.ops.record_`` call
  into the device ring; the host appends the frame's metadata (module, labels, dtypes, shapes,
  batch) to a list. Hooks never read a device value.
- weights: at the start of each batch one ``multi_tensor_stats`` launch computes the stats of every
  parameter (a per-batch weight table, kept on the device). A per-module 0-dim flag (NaN when one
  of the module's own parameters is non-finite, 0 otherwise) rides along in each frame's record_
  call, so the ring trips at the first frame that uses a non-finite weight, exactly where
  Transformers would.
- batch end (the root module's forward returns): every ``check_every``-th batch the host reads the
  small state (one device->host copy), or, with ``check="async"``, copies it to pinned memory and
  reads it at the next check. Only after a trip does it copy the ring and render the report.
"""
from __future__ import annotations

import bisect
import dataclasses
import functools
import math
import os
import sys
import threading
import warnings
import weakref

import torch

from . import env as _env
from . import ops
from . import report as _report
from .errors import AbortAfterBatch, HeadroomWarning, InspectorWarning, NonFiniteError, NonFiniteWarning

__all__ = ["Inspector", "watch", "DebugUnderflowOverflow", "detect_overflow"]

# Line kinds (bit 4: a line Transformers does not print).
_T, _NONE, _NOT = 0, 1, 2
_EXTRA = 4
_KIND_NAMES = {0: _report.KIND_TENSOR, 1: _report.KIND_NONE, 2: _report.KIND_NOT_A_TENSOR}

_LOW_PRECISION = {torch.float16: 65504.0, torch.bfloat16: torch.finfo(torch.bfloat16).max,
                  torch.float8_e4m3fn: torch.finfo(torch.float8_e4m3fn).max,
                  torch.float8_e5m2: torch.finfo(torch.float8_e5m2).max}
_RECORDABLE = frozenset([torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn,
                         torch.float8_e5m2, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                         torch.bool])

_INPUT_LABELS = tuple(f"input[{i}]" for i in range(64))
_OUTPUT_LABELS = tuple(f"output[{i}]" for i in range(64))
_MAX_RING = 1 << 18    # records (16 MiB of float64[8]); older frames drop out beyond this

# Frame tuple fields (a tuple per frame keeps the hook path allocation-light).
# _F_START/_F_NREC: the records this frame wrote (contiguous); _F_POS: the ring position of each
# tensor line (a tensor already recorded by an earlier frame of the batch, unchanged since, is not
# recorded again: its line points at the earlier record); _F_LO: the oldest position it refers to.
_F_OWNER, _F_BATCH, _F_START, _F_LABELS, _F_KINDS, _F_DTYPES, _F_SHAPES, _F_SECTION, _F_BSTART, \
    _F_NREC, _F_WEIGHTS, _F_HF, _F_POS, _F_LO = range(14)
_SEEN_LIMIT = 512       # tensors remembered for reuse within a batch


def _outside_inference_mode(method):
    """numguard's own buffers are made and updated as normal tensors even when the model runs
    under torch.inference_mode(): an inference tensor could not be updated in place after it."""
    return torch.inference_mode(False)(method)


class _STDOUT:  # sentinel: print to whatever sys.stdout is at report time
    pass


_active: list = []  # inspectors inside a watched forward (for detect_overflow)
_STRIDED = torch.strided
_Tensor = torch.Tensor
_is_compiling = torch.compiler.is_compiling
_ONE_IN_ONE_OUT_LABELS = ("input[0]", "output")
_ONE_IN_ONE_OUT_KINDS = (0, 0)


class _Owner:
    """What a frame belongs to: a watched module, or a name given to record_frame."""
    __slots__ = ("index", "name", "cls", "ref", "wnames", "widx", "flag", "flag_batch", "headroom", "off",
                 "is_root", "is_top", "returned", "__weakref__")

    def __init__(self, index, name, cls, ref=None):
        self.index = index
        self.name = name
        self.cls = cls
        self.ref = ref
        self.wnames = ()
        self.widx = ()
        self.flag = None
        self.flag_batch = -1
        self.headroom = 0.0
        self.off = False
        self.is_root = False
        self.is_top = False      # its return ends a check: the root, or a module called outside it
        self.returned = False    # its forward returned normally (NOTE: [forward raised])


def _device_index(device):
    """What Tensor.get_device() returns for tensors on `device` (-1 on the CPU)."""
    if device.type == "cpu":
        return -1
    return device.index if device.index is not None else 0


def _rank():
    try:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except Exception:
        pass
    return None


def _dist_on():
    try:
        import torch.distributed as dist
        return dist.is_available() and dist.is_initialized()
    except Exception:
        return False


def _key_label(prefix, key):
    if isinstance(key, str) and key.isidentifier():
        return f"{prefix}.{key}"
    return f"{prefix}[{key!r}]"


def _container_items(value, label):
    """(label, item) pairs of a list, tuple, dict or dataclass instance; None for anything else."""
    if isinstance(value, (tuple, list)):
        return iter([(f"{label}[{i}]", v) for i, v in enumerate(value)])
    if isinstance(value, dict):
        return iter([(_key_label(label, k), v) for k, v in list(value.items())])
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return iter([(f"{label}.{f.name}", getattr(value, f.name, None)) for f in dataclasses.fields(value)])
    return None


def _flatten_extra(value, label, xs, labels, kinds):
    """numguard-only lines for the contents of a container (list, tuple, dict, dataclass), depth
    first. Every tensor inside is recorded, however many and however deep (an explicit stack, not
    recursion); only a container that holds itself is not followed again, on a line saying so."""
    items = _container_items(value, label)
    if items is None:
        return
    on_path = {id(value)}
    stack = [(id(value), items)]
    while stack:
        owner_id, items = stack[-1]
        item = next(items, None)
        if item is None:
            stack.pop()
            on_path.discard(owner_id)
            continue
        lab, v = item
        if isinstance(v, torch.Tensor):
            xs.append(v)
            labels.append(lab)
            kinds.append(_T | _EXTRA)
        elif v is None:
            labels.append(lab)
            kinds.append(_NONE | _EXTRA)
        else:
            kinds.append(_NOT | _EXTRA)
            inner = _container_items(v, lab)
            if inner is not None and id(v) in on_path:
                labels.append(f"{lab} (holds itself: not followed again)")
                continue
            labels.append(lab)
            if inner is not None:
                on_path.add(id(v))
                stack.append((id(v), inner))


def _add(value, label, xs, labels, kinds):
    """One Transformers line for `value` (tensor / None / not a tensor), then numguard's lines for
    the contents of a container that Transformers shows as 'not a tensor'."""
    if isinstance(value, torch.Tensor):
        xs.append(value)
        labels.append(label)
        kinds.append(_T)
    elif value is None:
        labels.append(label)
        kinds.append(_NONE)
    else:
        labels.append(label)
        kinds.append(_NOT)
        _flatten_extra(value, label, xs, labels, kinds)


def _flatten_frame(args, kwargs, output):
    """Tensors of a module call and the labels of every line, in Transformers' order (inputs,
    keyword inputs, outputs). Lines Transformers does not print are marked _EXTRA; their tensors
    are recorded whether or not the report shows them (`extras`), so a NaN is never missed."""
    xs = []
    labels = []
    kinds = []
    for i, a in enumerate(args):
        _add(a, _INPUT_LABELS[i] if i < 64 else f"input[{i}]", xs, labels, kinds)
    if kwargs:
        for k, v in kwargs.items():
            lab = "kwargs." + k
            if isinstance(v, torch.Tensor):
                xs.append(v)
                labels.append(lab)
                kinds.append(_T | _EXTRA)
            elif v is not None:  # keyword arguments left at None carry nothing to show
                labels.append(lab)
                kinds.append(_NOT | _EXTRA)
                _flatten_extra(v, lab, xs, labels, kinds)
    if isinstance(output, torch.Tensor):
        xs.append(output)
        labels.append("output")
        kinds.append(_T)
    elif isinstance(output, tuple):
        for i, x in enumerate(output):
            lab = _OUTPUT_LABELS[i] if i < 64 else f"output[{i}]"
            if isinstance(x, tuple):
                for j, y in enumerate(x):
                    _add(y, f"{lab}[{j}]", xs, labels, kinds)
            else:
                _add(x, lab, xs, labels, kinds)
    else:
        _add(output, "output", xs, labels, kinds)
    return xs, labels, kinds


def _watchable_param(p):
    return p.device.type != "meta" and not p.is_complex() and p.layout == torch.strided


def _unique_params(params):
    """Every watched parameter once (tied weights once), in module order, detached."""
    unique = []
    seen = set()
    for _, own in params:
        for _, p in own:
            if id(p) not in seen and _watchable_param(p):
                seen.add(id(p))
                unique.append(p)
    return unique


def _is_distributed_failure(exc: BaseException) -> bool:
    errors = sys.modules.get("numguard.distributed.errors")  # loaded only when distributed is in use
    return errors is not None and isinstance(exc, errors.DistributedOperationException)


class Inspector:
    """Watches every module of `model` (forward hooks), keeping stats on the device until a
    NaN/Inf trips. Use `watch(model, ...)` to create one; it is a context manager, and `close()`
    removes every hook it added.

    Args:
        model: the root module. Its forward returning ends a batch (batches are 0-indexed).
        max_frames_to_save: frames shown in a report (the last ones, ending with the first frame
            that holds a non-finite value).
        trace_batch_nums: batches whose every frame is printed, in Transformers' trace format.
        abort_after_batch_num: raise `numguard.errors.AbortAfterBatch` (a ValueError) when this
            batch has finished.
        backward: also watch gradients (numguard.backward, when available).
        check: "sync" (read the trip flag at each checked batch end: one tiny device->host copy)
            or "async" (copy it to pinned memory without waiting and read it at the next check:
            healthy batches never wait; a trip is reported one check late).
        check_every: check every N-th batch (records are kept for the batches in between).
        on_trip: "raise" (numguard.NonFiniteError), "warn" (NonFiniteWarning, training goes on)
            or "dump" (write a JSON report per rank into `dump_dir`, warn, go on).
        dump_dir: where on_trip="dump" writes (default: the current directory).
        headroom: warn once per module when a float16/bfloat16/float8 tensor's abs max passes
            this fraction of the dtype's largest finite value (0 turns it off).
        report_to: where reports and traces are printed: a file object, a callable taking the
            text, or None for nowhere (default: sys.stdout at the time of printing).
        extras: also show what Transformers does not (keyword inputs, contents of dict / list /
            dataclass outputs, deeper nesting) on lines of their own.
        scaler_skips: with backward=True, a step that torch.amp.GradScaler skips for inf/NaN
            gradients is "count"ed (default; not a trip) or a "trip" (numguard.backward).
    """

    def __init__(self, model: torch.nn.Module, max_frames_to_save: int = 21, trace_batch_nums=(),
                 abort_after_batch_num=None, *, backward: bool = False, check: str = "sync",
                 check_every: int = 1, on_trip: str = "raise", dump_dir=None, headroom: float = 0.5,
                 report_to=_STDOUT, extras: bool = True, scaler_skips: str = "count"):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"numguard.watch: model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(max_frames_to_save, int) or isinstance(max_frames_to_save, bool) or max_frames_to_save < 1:
            raise ValueError(f"numguard.watch: max_frames_to_save={max_frames_to_save!r} must be an int >= 1")
        if check not in ("sync", "async"):
            raise ValueError(f"numguard.watch: check={check!r} is not valid: use 'sync' or 'async'")
        if not isinstance(check_every, int) or isinstance(check_every, bool) or check_every < 1:
            raise ValueError(f"numguard.watch: check_every={check_every!r} must be an int >= 1")
        if on_trip not in ("raise", "warn", "dump"):
            raise ValueError(f"numguard.watch: on_trip={on_trip!r} is not valid: use 'raise', 'warn' or 'dump'")
        try:
            headroom = float(headroom or 0.0)
        except (TypeError, ValueError):
            raise ValueError(f"numguard.watch: headroom={headroom!r} must be a number in [0, 1)") from None
        if not 0.0 <= headroom < 1.0 or math.isnan(headroom):
            raise ValueError(f"numguard.watch: headroom={headroom!r} must be in [0, 1) (0 turns it off)")
        if abort_after_batch_num is not None and (not isinstance(abort_after_batch_num, int) or abort_after_batch_num < 0):
            raise ValueError(f"numguard.watch: abort_after_batch_num={abort_after_batch_num!r} must be None "
                             "or an int >= 0")
        try:
            traced = frozenset(int(b) for b in (trace_batch_nums or ()))
        except (TypeError, ValueError):
            raise ValueError(f"numguard.watch: trace_batch_nums={trace_batch_nums!r} must be a list of "
                             "batch numbers") from None

        self.max_frames_to_save = max_frames_to_save
        self.trace_batch_nums = traced
        self.abort_after_batch_num = abort_after_batch_num
        self.check_mode = check
        self.check_every = check_every
        self.on_trip = on_trip
        self.dump_dir = dump_dir
        self.headroom = headroom
        self.report_to = report_to
        self.extras = bool(extras)
        self.backward = bool(backward)
        self.trips = 0                    # trips handled (on_trip warn/dump go on after one)
        self.last_report = None           # the last report dictionary (see numguard.dump)

        self._model_ref = weakref.ref(model)
        self._handles = []
        self._closed = False
        self._owners = []
        self._module_names = weakref.WeakKeyDictionary()
        self._named = {}                  # (name, class) -> _Owner for record_frame
        self._warned = set()

        device = None
        for p in model.parameters():
            device = p.device
            break
        if device is None:
            for b in model.buffers():
                device = b.device
                break
        self._device = device if device is not None and device.type != "meta" else torch.device("cpu")
        with torch.inference_mode(False):
            self._ring, _ = ops.new_ring(max(64, 8 * max_frames_to_save), self._device)
            self._state_buf = torch.tensor([0, -1, 0, -1, 0, 0, 0, 0], dtype=torch.int64,
                                           device=self._device)
            self._state = self._state_buf[0:4]
        self._ring_size = self._ring.shape[0]
        self._device_index = _device_index(self._device)
        self._pos = 0
        self._frames = []
        self._frame_starts = []           # start position per frame (for bisect)
        self._window_lo = 0               # oldest ring position a retained frame refers to
        self._seen = {}                   # id(tensor) -> (weakref, version, position), this batch
        self._floor = 0                   # frames before this index are not report context
        self._batches_done = 0
        self._hf_calls = 0                # module frames recorded (Transformers' total_calls)
        self._depth = 0
        self._batch_open = False
        self._pending_start = 0           # Transformers' "Starting batch number" lines go before the next frame
        self._wtables = {}                # batch -> (device stats [W, 8], layout)
        self._wlayout = None
        self._wlayout_ids = None
        self._wcache = None               # (parameter ids, layout, weakrefs to parameters, dtypes)
        self._w_limits_inv = None
        self._last_check_frames = 0
        self._where = "batch end"         # what the current check is called for (shown in reports)
        self._async_host = None
        self._async_np = None
        self._async_event = None
        self._async_pending = None        # (frames length, position, batch) of the issued copy
        if check == "async":
            self._make_async_buffer(8)

        self._thread = None
        self._backward_watch = None
        try:
            self._install_hooks(model, headroom)
            if backward:
                try:
                    from . import backward as _backward
                except ImportError as exc:
                    warnings.warn(f"numguard: backward=True needs numguard.backward, which cannot be imported "
                                  f"in this installation ({exc}); gradients are NOT watched, only the "
                                  "forward pass. Reinstall numguard.", InspectorWarning, stacklevel=2)
                else:
                    self._backward_watch = _backward.BackwardWatcher(self, model, scaler_skips=scaler_skips)
                    if check == "async" or check_every > 1:
                        warnings.warn(
                            f"numguard: backward=True with check={check!r}, check_every={check_every}: a "
                            "NaN/Inf gradient of a step that is not checked synchronously reaches the "
                            "optimizer, and is reported at the next check (the weights may already hold "
                            "it). Use check='sync', check_every=1 to raise before any weight is written.",
                            InspectorWarning, stacklevel=3)
        except BaseException:
            self.close(check=False)  # a watch() that fails leaves no hook behind
            raise

    def _install_hooks(self, model, headroom):
        root_name_seen = False
        for name, module in model.named_modules():
            owner = _Owner(len(self._owners), name, module.__class__.__name__, weakref.ref(module))
            owner.headroom = headroom
            self._owners.append(owner)
            self._module_names[module] = name
            if module is model and not root_name_seen:
                owner.is_root = owner.is_top = True
                root_name_seen = True
                self._root_owner = owner
                # NOTE: [compile] The root's hooks run outside any torch.compile graph (the batch-end
                # read must not break a graph in the middle); inner hooks do nothing while compiling.
                self._handles.append(module.register_forward_pre_hook(
                    torch.compiler.disable(functools.partial(self._top_pre_hook, owner))))
                self._handles.append(module.register_forward_hook(
                    torch.compiler.disable(functools.partial(self._root_hook, owner)), with_kwargs=True))
                self._add_after_hook(owner, module)
            else:
                self._handles.append(module.register_forward_hook(
                    functools.partial(self._hook, owner), with_kwargs=True))

    def _add_after_hook(self, owner, module):
        # NOTE: [forward raised] Runs after the returned-hook on a normal return, alone when the
        # forward raised. Whether an exception is being handled says nothing: a healthy model may
        # be called inside a user's `except` block.
        self._handles.append(module.register_forward_hook(
            torch.compiler.disable(functools.partial(self._top_after_hook, owner)), always_call=True))

    def _make_top(self, owner, module):
        """A module called outside the root's forward becomes a top module of its own: from its
        next call on, its return ends a check like the root's (without counting a batch)."""
        owner.is_top = True
        self._handles.append(module.register_forward_pre_hook(
            torch.compiler.disable(functools.partial(self._top_pre_hook, owner))))
        self._handles.append(module.register_forward_hook(
            torch.compiler.disable(functools.partial(self._top_returned_hook, owner))))
        self._add_after_hook(owner, module)

    # ------------------------------------------------------------------------------------------
    # Public surface

    @property
    def batch_number(self) -> int:
        """The 0-indexed current batch: the batch whose forward is running, or whose forward last
        finished (its backward and optimizer step see the same number)."""
        return self._batch_index()

    def _batch_index(self) -> int:
        if self._depth > 0 or self._batches_done == 0:
            return self._batches_done
        return self._batches_done - 1

    @property
    def module_names(self):
        """Mapping module -> qualified name (weak keys; the first name of a reused module)."""
        return self._module_names

    @property
    def model(self):
        return self._model_ref()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close(check=exc_type is None)
        return False

    def close(self, check: bool = True) -> None:
        """Remove every hook numguard added. With `check`, batches not checked yet are checked
        first (with the configured on_trip action)."""
        if self._closed:
            return
        try:
            if check and (len(self._frames) > self._last_check_frames or self._async_pending is not None):
                self._async_pending = None
                self._check_now_sync("close")
        finally:
            self._closed = True
            for h in self._handles:
                h.remove()
            self._handles.clear()
            if self._backward_watch is not None:
                try:
                    self._backward_watch.close()
                except Exception as exc:
                    warnings.warn(f"numguard: closing the backward watch failed: {exc}", InspectorWarning)
                self._backward_watch = None
            if self in _active:
                _active.remove(self)

    def record_frame(self, module_name: str, class_name: str, labels, values, section: str = "forward") -> None:
        """Record a frame of your own (no host sync). `values[i]` is shown on line `labels[i]`:
        tensors get a stats line, None a 'None' line, anything else a 'not a tensor' line.
        Frames whose section is not "forward" are reported in a section of their own
        ("Last N <section> frames:")."""
        if self._closed:
            return
        key = (module_name, class_name)
        owner = self._named.get(key)
        if owner is None:
            owner = _Owner(-1, module_name, class_name)
            owner.headroom = self.headroom
            self._named[key] = owner
        if len(labels) != len(values):
            raise ValueError(f"numguard.record_frame: {len(labels)} labels but {len(values)} values; give "
                             "one label per value")
        xs = []
        kinds = []
        for v in values:
            if isinstance(v, torch.Tensor):
                xs.append(v)
                kinds.append(_T)
            elif v is None:
                kinds.append(_NONE)
            else:
                kinds.append(_NOT)
        self._record(owner, xs, list(labels), kinds, section, False, False)

    def check(self, where: str = "batch end") -> None:
        """Look at the trip flag now (check="sync": one tiny device->host read; "async": read the
        copy made at the previous check and start a new one) and handle a trip: print the report,
        then raise / warn / dump as configured."""
        if self._closed:
            return
        if self.check_mode == "async":
            self._check_async(where)
        else:
            self._check_now_sync(where)

    # ------------------------------------------------------------------------------------------
    # What numguard.backward uses (a small protocol, so the backward watcher never reaches into
    # the inspector's state)

    def ring_position(self) -> int:
        """Where the next record goes: frames recorded from here on are 'after' this position."""
        return self._pos

    def check_now(self, where: str) -> None:
        """A synchronous check whatever `check` says: the check before an optimizer step must
        see this step's gradients before any weight is written."""
        if self._closed:
            return
        self._async_pending = None  # the state read now covers what that copy held
        self._check_now_sync(where)

    def forget_trip_from(self, position: int, where: str) -> None:
        """Records from `position` on are not a trip (e.g. the gradients of a step GradScaler
        skipped). One read of the state: a trip recorded before `position` is still handled."""
        if self._closed:
            return
        tripped, first = self._state[:2].tolist()
        if not tripped:
            return
        if first < position:
            self.check_now(where)
        else:
            self._reset_after_trip()

    # ------------------------------------------------------------------------------------------
    # Hooks (no host sync in here)

    def _top_pre_hook(self, owner, module, args):
        if self._depth == 0:
            self._thread = threading.get_ident()
            if not self._batch_open:
                self._begin_batch()
            if self not in _active:
                _active.append(self)
        elif self._thread != threading.get_ident():
            self._warn_threads()
        self._depth += 1

    def _leave_top(self):
        self._depth = max(0, self._depth - 1)
        if self._depth == 0 and self in _active:
            _active.remove(self)
        return self._depth == 0

    def _root_hook(self, owner, module, args, kwargs, output):
        owner.returned = True
        self._hook(owner, module, args, kwargs, output)
        if self._leave_top():
            self._end_batch()
        return None

    def _top_returned_hook(self, owner, module, args, output):
        owner.returned = True
        if self._leave_top():
            self._end_direct_call(owner)
        return None

    def _top_after_hook(self, owner, module, args, output):
        if owner.returned:
            owner.returned = False
            return None
        # The forward raised (NOTE: [forward raised]): the batch did not finish.
        if self._leave_top():
            self._guarded(self._after_raised_forward, sys.exc_info()[1])
        return None

    def _end_direct_call(self, owner):
        """A watched module called outside the root's forward has returned: check now, or its NaN
        would wait for a root call that may never come."""
        self._batch_open = False
        self._seen.clear()
        self._guarded(self.check, f"{owner.name or '(root module)'} ({owner.cls}) returned outside the "
                                  "root's forward")

    def _warn_threads(self):
        if "threads" not in self._warned:
            self._warned.add("threads")
            warnings.warn("numguard: the watched model is being called from several threads at once; one "
                          "Inspector counts batches for one thread, so batch numbers and the module "
                          "blamed for a trip may be wrong. Watch a separate model object per thread.",
                          InspectorWarning, stacklevel=4)

    def _hook(self, owner, module, args, kwargs, output):
        if owner.off or self._closed or _is_compiling():
            return None
        try:
            if not kwargs and len(args) == 1 and type(output) is _Tensor and type(args[0]) is _Tensor:
                # Fast path: one positional tensor in, one tensor out (Linear, LayerNorm, Dropout, ...).
                self._record(owner, [args[0], output], _ONE_IN_ONE_OUT_LABELS, _ONE_IN_ONE_OUT_KINDS,
                             "forward", True, True)
            else:
                xs, labels, kinds = _flatten_frame(args, kwargs, output)
                self._record(owner, xs, labels, kinds, "forward", True, True)
        except Exception as exc:  # numguard's own failure must not kill the job
            self._disable(owner, exc)
        if self._depth == 0 and not owner.is_top:
            # Called outside the root's forward (e.g. model.encoder(x) directly).
            try:
                self._make_top(owner, module)
            except Exception as exc:
                self._disable(owner, exc)
            self._end_direct_call(owner)
        return None

    def _record(self, owner, xs, labels, kinds, section, hf, weights):
        if weights and not self._batch_open:
            # A module frame outside the root's forward (a submodule called directly) opens the
            # batch. record_frame() frames (gradients, after the forward) never do: the next
            # batch's weight table must be taken after the optimizer step.
            self._begin_batch()
        pos = self._pos
        seen = self._seen
        device_index = self._device_index
        dtypes = []
        shapes = []
        positions = []
        new = []
        lo = pos
        clean = True
        for x in xs:
            dtype = x.dtype
            dtypes.append(dtype)
            try:
                shapes.append(x.shape)
            except RuntimeError:  # nested tensors have no single shape
                shapes.append(())
            hit = seen.get(id(x))
            # Only tensors with a version counter are ever in `seen` (inference tensors are not).
            if hit is not None and hit[0]() is x and hit[1] == x._version:
                p = hit[2]
                positions.append(p)
                if p < lo:
                    lo = p
            else:
                positions.append(pos + len(new))
                new.append(x)
                if clean and (dtype not in _RECORDABLE or x.get_device() != device_index
                              or x.layout is not _STRIDED):
                    clean = False
        fresh = new
        if not clean:
            new = self._sanitize(new)
        batch = self._batches_done if hf else self._batch_index()
        if weights and owner.flag is not None and owner.flag_batch != batch:
            # The module's weight flag (NaN when one of its weights is non-finite), first call of the batch.
            owner.flag_batch = batch
            positions.append(pos + len(new))
            new.append(owner.flag)
        n = len(new)
        if n:
            window = lo if not self._frames or lo < self._window_lo else self._window_lo
            if pos + n - window > self._ring_size:
                self._grow(pos + n - window)
            try:
                ops.record_(self._ring, self._state, new, pos, owner.headroom)
            except Exception:
                if not clean or not any(x.is_meta or x.is_nested for x in fresh):
                    raise
                # The quick screen above passes what only the op can reject (meta, nested
                # tensors): record their values through _sanitize instead of losing the frame.
                new[:len(fresh)] = self._sanitize(fresh)
                ops.record_(self._ring, self._state, new, pos, owner.headroom)
            self._pos = pos + n
            if len(seen) > _SEEN_LIMIT:
                seen.clear()
            try:
                for i, x in enumerate(fresh):
                    seen[id(x)] = (weakref.ref(x), x._version, pos + i)
            except (RuntimeError, TypeError):  # inference tensors: no version counter, no reuse
                pass
        bstart = None
        if hf:
            self._hf_calls += 1
            bstart = self._pending_start
            self._pending_start = None
        if not self._frames or lo < self._window_lo:
            self._window_lo = lo
        self._frames.append((owner, batch, pos, labels, kinds, dtypes, shapes, section, bstart,
                             n, weights and bool(owner.widx), hf, positions, lo))
        self._frame_starts.append(pos)

    def _sanitize(self, xs):
        """Make a frame's tensors recordable, keeping every value that can hold a NaN: sparse,
        nested and quantized tensors are recorded through their values, complex through its real
        view, other devices copied to the ring's device; a meta tensor (no values) becomes an
        empty stand-in."""
        out = []
        for x in xs:
            x = x.detach()
            if x.is_meta:
                out.append(torch.empty(0, device=self._device))
                continue
            if x.is_nested:
                parts = [t.reshape(-1) for t in x.unbind()]
                x = torch.cat(parts) if parts else torch.empty(0, dtype=x.dtype, device=x.device)
            elif x.layout == torch.sparse_coo:
                x = x._values()
            elif x.layout != torch.strided:  # compressed sparse layouts (CSR, CSC, BSR, BSC)
                x = x.values()
            if x.is_quantized:
                x = x.dequantize()
            if x.is_complex():
                x = torch.view_as_real(x)
            if x.dtype not in _RECORDABLE:
                x = x.to(torch.float64)
            if x.device != self._device:
                x = x.to(self._device, non_blocking=self._device.type == "cuda")
            out.append(x)
        return out

    @_outside_inference_mode
    def _grow(self, needed):
        old = self._ring
        size = old.shape[0]
        new_size = size
        while new_size < needed and new_size < _MAX_RING:
            new_size *= 2
        if new_size < needed:
            # Beyond the cap: the oldest frames' records are overwritten; forget those frames.
            limit = self._pos + (needed - (self._pos - self._window_lo)) - _MAX_RING
            cut = 0
            while cut < len(self._frames) and self._frames[cut][_F_LO] < limit:
                cut += 1
            self._drop_frames(cut)
            self._seen.clear()
            if new_size == size:
                return
        ring = torch.zeros((new_size, old.shape[1]), dtype=old.dtype, device=old.device)
        lo = self._window_lo if self._frames else self._pos
        lo = max(lo, self._pos - size)
        if self._pos > lo:
            positions = torch.arange(lo, self._pos, device=old.device)
            ring.index_copy_(0, positions % new_size, old.index_select(0, positions % size))
        self._ring = ring
        self._ring_size = new_size

    def _drop_frames(self, cut):
        if cut <= 0:
            return
        del self._frames[:cut]
        del self._frame_starts[:cut]
        self._window_lo = min((f[_F_LO] for f in self._frames), default=self._pos)
        self._floor = max(0, self._floor - cut)
        self._last_check_frames = max(0, self._last_check_frames - cut)
        if self._async_pending is not None:
            n, p, b = self._async_pending
            self._async_pending = (max(0, n - cut), p, b)
        if self._frames:
            oldest = self._frames[0][_F_BATCH]
            for b in [b for b in self._wtables if b < oldest]:
                del self._wtables[b]
        else:
            keep = self._batches_done
            for b in [b for b in self._wtables if b < keep]:
                del self._wtables[b]

    def _disable(self, owner, exc):
        owner.off = True
        key = ("module", owner.index, owner.name)
        if key not in self._warned:
            self._warned.add(key)
            name = owner.name or "(root module)"
            warnings.warn(f"numguard: stopped watching module {name!r} ({owner.cls}) after an internal "
                          f"error: {type(exc).__name__}: {exc}. Training goes on; the other modules are "
                          "still watched.", InspectorWarning, stacklevel=3)

    # ------------------------------------------------------------------------------------------
    # Weights: one stats launch per batch

    @_outside_inference_mode
    def _begin_batch(self):
        self._batch_open = True
        try:
            self._record_weights()
        except Exception as exc:
            key = ("weights",)
            if key not in self._warned:
                self._warned.add(key)
                warnings.warn(f"numguard: could not record weight stats ({type(exc).__name__}: {exc}); "
                              "weights are not watched from now on", InspectorWarning, stacklevel=3)
            for o in self._owners:
                o.flag = None
            self._wlayout = None

    def _current_params(self):
        params = []
        ids = []
        for owner in self._owners:
            module = owner.ref()
            if module is None:
                ids.append(())
                continue
            own = []
            seen = set()
            for name, p in module._parameters.items():
                if p is None or id(p) in seen:
                    continue
                seen.add(id(p))
                own.append((name, p))
            params.append((owner, own))
            ids.append(tuple(id(p) for _, p in own))
        return params, tuple(ids)

    def _record_weights(self):
        modules = [o.ref() for o in self._owners]
        fingerprint = tuple([id(p) for m in modules if m is not None for p in m._parameters.values()])
        cache = self._wcache
        unique = None
        if cache is not None and cache[0] == fingerprint and cache[1] is self._wlayout:
            unique = [r() for r in cache[2]]
            if any(p is None for p in unique) or tuple(p.dtype for p in unique) != cache[3]:
                unique = None
        if unique is None:
            params, ids = self._current_params()
            self._build_layout(params, ids)
            unique = _unique_params(params)
            self._wcache = (fingerprint, self._wlayout, [weakref.ref(p) for p in unique],
                            tuple(p.dtype for p in unique))
        layout = self._wlayout
        if layout is None or not layout["tensors_n"]:
            return
        if unique[0].device != self._device:
            # The model moved (e.g. .to(device) after watch()): start over on the new device.
            self._move_to(unique[0].device)
            params, ids = self._current_params()
            self._build_layout(params, ids)
            self._wcache = None
            layout = self._wlayout
        # Every batch recomputes the table (one launch): parameter version counters cannot be
        # trusted to skip it, since writes through `.data` do not bump them.
        with torch.no_grad():
            stats = ops.multi_tensor_stats(unique) if layout["one_device"] else torch.cat(
                [ops.tensor_stats(p).to(self._device).view(1, -1) for p in unique])
        self._wtables[self._batches_done] = (stats, layout)
        bad = (stats[:, _report.NAN] + stats[:, _report.POS_INF] + stats[:, _report.NEG_INF]) > 0
        per_ref = torch.where(bad, math.nan, 0.0).to(torch.float32).index_select(0, layout["wi"])
        flags = layout["flags"]
        flags.zero_()
        flags.index_add_(0, layout["mi"], per_ref)
        if self._w_limits_inv is not None:
            over = (stats[:, _report.ABS_MAX] * self._w_limits_inv > self.headroom).any()
            torch.maximum(self._state_buf[4:5], over.view(1).to(torch.int64), out=self._state_buf[4:5])

    def _build_layout(self, params, ids):
        unique = _unique_params(params)
        index = {id(p): i for i, p in enumerate(unique)}
        wi, mi = [], []
        one_device = all(p.device == unique[0].device for p in unique)
        owners_with = []
        for owner, own in params:
            names, widx = [], []
            for name, p in own:
                if id(p) not in index:
                    continue
                names.append(name)
                widx.append(index[id(p)])
            owner.wnames = tuple(names)
            owner.widx = tuple(widx)
            if widx:
                owners_with.append(owner)
                for w in widx:
                    wi.append(w)
                    mi.append(len(owners_with) - 1)
        for owner, _ in params:
            owner.flag = None
        self._wlayout_ids = ids
        if not unique:
            self._wlayout = {"tensors_n": 0}
            return
        dev = unique[0].device
        flags = torch.zeros(len(owners_with), dtype=torch.float32, device=dev)
        for i, owner in enumerate(owners_with):
            owner.flag = flags[i]
        self._wlayout = {
            "tensors_n": len(unique),
            "one_device": one_device,
            "wi": torch.tensor(wi, dtype=torch.int64).to(dev),
            "mi": torch.tensor(mi, dtype=torch.int64).to(dev),
            "flags": flags,
            "dtypes": [str(p.dtype) for p in unique],
            "shapes": [list(p.shape) for p in unique],
        }
        limits = [(1.0 / _LOW_PRECISION[p.dtype]) if p.dtype in _LOW_PRECISION else 0.0 for p in unique]
        if self.headroom > 0 and any(limits):
            self._w_limits_inv = torch.tensor(limits, dtype=torch.float64).to(dev)
        else:
            self._w_limits_inv = None

    @_outside_inference_mode
    def _move_to(self, device):
        self._device = device
        self._wcache = None
        self._ring, _ = ops.new_ring(self._ring.shape[0], device)
        self._device_index = _device_index(device)
        self._state_buf = torch.tensor([0, -1, 0, -1, 0, 0, 0, 0], dtype=torch.int64, device=device)
        self._state = self._state_buf[0:4]
        self._async_host = None
        self._async_pending = None
        self._drop_frames(len(self._frames))
        self._wtables.clear()

    # ------------------------------------------------------------------------------------------
    # Batch end

    def _end_batch(self):
        batch = self._batches_done
        self._batches_done += 1
        self._batch_open = False
        self._seen.clear()
        self._pending_start = self._batches_done
        traced = batch in self.trace_batch_nums
        if traced:
            self._guarded(self._print_trace, batch)
        watcher = self._backward_watch
        if self._batches_done % self.check_every == 0 and (watcher is None or not watcher.takes_batch_end_check()):
            self._guarded(self.check, "batch end")
        if traced:
            # Like Transformers, a later report does not reach back into a traced batch.
            self._floor = len(self._frames)
        if self.abort_after_batch_num is not None and batch >= self.abort_after_batch_num:
            raise AbortAfterBatch(self._abort_message(batch))

    _trip_message = None  # the NonFiniteError text when a subclass wants its own

    def _trip_reported(self, report, frames_after):
        """A trip's report is built; `frames_after` module frames were recorded after the offender
        (numguard checks at the batch end, not inside the offending module's hook)."""

    def _abort_message(self, batch):
        done = self._batches_done
        return (f"numguard: aborting after batch_number={batch} ({done} batch{'es' if done != 1 else ''} run) "
                f"as requested by abort_after_batch_num={self.abort_after_batch_num}")

    def _guarded(self, fn, *args):
        try:
            return fn(*args)
        except (NonFiniteError, AbortAfterBatch):
            raise
        except Exception as exc:
            if _is_distributed_failure(exc):
                # Ranks disagree or one never arrived: going on would hang the next collective.
                raise
            key = ("internal", fn.__name__)
            if key not in self._warned:
                self._warned.add(key)
                warnings.warn(f"numguard: {fn.__name__.strip('_').replace('_', ' ')} failed "
                              f"({type(exc).__name__}: {exc}); training goes on", InspectorWarning, stacklevel=3)
            return None

    def _flag_source(self):
        # NOTE: [which checks are shared across ranks] Only checks of training batches (grad
        # enabled) and checks before an optimizer step join the cross-rank exchange: every rank
        # runs those, while evaluation under no_grad often runs on some ranks only (rank 0's
        # eval), where a collective would pair with an unrelated one on the other ranks.
        # Evaluation trips are reported by their own rank.
        if _dist_on() and (torch.is_grad_enabled() or self._where != "batch end"):
            coordination = self._coordination()
            if coordination is None:
                return self._state_buf, False
            flags = coordination.exchange_trip(self._state_buf[0])
            return torch.cat([self._state_buf, flags.to(self._device)]), True
        return self._state_buf, False

    def _coordination(self):
        """numguard.distributed.coordination, or None (with a warning naming it) when this
        installation cannot import it: the other ranks then learn nothing of this rank's trips."""
        try:
            from .distributed import coordination
        except ImportError as exc:
            if "coordination" not in self._warned:
                self._warned.add("coordination")
                warnings.warn(f"numguard: torch.distributed is initialized but numguard.distributed cannot "
                              f"be imported ({type(exc).__name__}: {exc}); trips are NOT shared across "
                              "ranks, so other ranks may train on or hang when this one stops. Reinstall "
                              "numguard (the wheel must contain numguard/distributed/).", InspectorWarning,
                              stacklevel=4)
            return None
        return coordination

    def _check_now_sync(self, where):
        self._where = where
        src, dist_flags = self._flag_source()
        values = src.tolist()  # the one device->host read of a checked batch
        boundary = len(self._frames)
        self._handle(values, dist_flags, boundary, self._pos, found_at=self._batch_index(), late=False)

    @_outside_inference_mode
    def _make_async_buffer(self, size):
        """Host memory the async check copies the state into (pinned for CUDA; read through a numpy
        view made once, so reading it later is a plain memory read)."""
        pin = self._device.type == "cuda"
        self._async_host = torch.empty(size, dtype=torch.int64, pin_memory=pin)
        self._async_np = self._async_host.numpy()
        self._async_event = torch.cuda.Event() if pin else None

    def _check_async(self, where):
        self._where = where
        pending = self._async_pending
        if pending is not None:
            if self._async_event is not None and not self._async_event.query():
                self._async_event.synchronize()  # the copy was issued a check ago: normally done
            values = [int(v) for v in self._async_np]
            n, pos, batch = pending
            self._async_pending = None
            self._handle(values, len(values) > 8, n, pos, found_at=self._batch_index(), late=True)
            if self._closed:
                return
        src, dist_flags = self._flag_source()
        if self._async_host is None or self._async_host.numel() != src.numel():
            self._make_async_buffer(src.numel())
        self._async_host.copy_(src, non_blocking=True)
        if self._async_event is not None:
            self._async_event.record()
        self._async_pending = (len(self._frames), self._pos, self._batch_index())

    def _handle(self, values, dist_flags, boundary, boundary_pos, found_at, late):
        tripped = values[0] != 0
        headroom_hit = values[2] != 0 or values[4] != 0
        others = values[8:] if dist_flags else []
        any_trip = tripped or any(v != 0 for v in others)
        host_ring = None
        if headroom_hit:
            host_ring = self._ring.cpu().numpy()
            self._guarded(self._handle_headroom, host_ring, boundary)
        if any_trip:
            if host_ring is None and tripped:
                host_ring = self._ring.cpu().numpy()
            self._handle_trip(values, others, host_ring, boundary, found_at, late)
        else:
            self._confirm(boundary)

    def _confirm(self, boundary):
        """Frames before `boundary` are healthy: keep only the last ones as report context."""
        self._last_check_frames = boundary
        need = self.max_frames_to_save
        j = boundary
        count = 0
        while j > self._floor and count < need:
            j -= 1
            f = self._frames[j]
            if f[_F_HF]:
                count += 1
        self._drop_frames(j)

    # ------------------------------------------------------------------------------------------
    # Trips

    def _frame_records(self, f, host_ring, tables, valid_end):
        """Lines of a frame as report dict entries (weights first, like Transformers)."""
        owner = f[_F_OWNER]
        labels, kinds, dtypes, shapes, records, extra = [], [], [], [], [], []
        if f[_F_WEIGHTS] and owner.widx:
            table = tables.get(f[_F_BATCH])
            for name, w in zip(owner.wnames, owner.widx):
                labels.append(name)
                kinds.append(_report.KIND_TENSOR)
                extra.append(False)
                if table is not None and w < len(table[0]):
                    records.append([float(v) for v in table[0][w]])
                    dtypes.append(table[1]["dtypes"][w])
                    shapes.append(table[1]["shapes"][w])
                else:
                    records.append(None)
                    dtypes.append(None)
                    shapes.append(None)
        R = host_ring.shape[0]
        t = 0
        positions = f[_F_POS]
        for label, kind in zip(f[_F_LABELS], f[_F_KINDS]):
            base = kind & 3
            labels.append(label)
            kinds.append(_KIND_NAMES[base])
            extra.append(bool(kind & _EXTRA) or not f[_F_HF])
            if base == _T:
                p = positions[t]
                if p < valid_end - R:
                    records.append(None)
                else:
                    records.append([float(v) for v in host_ring[p % R]])
                dtypes.append(str(f[_F_DTYPES][t]))
                shapes.append(list(f[_F_SHAPES][t]))
                t += 1
            else:
                records.append(None)
                dtypes.append(None)
                shapes.append(None)
        return {"name": owner.name, "class": owner.cls, "section": f[_F_SECTION], "batch": f[_F_BATCH],
                "batch_start": f[_F_BSTART], "hf": bool(f[_F_HF]), "labels": labels, "kinds": kinds,
                "extra": extra, "dtypes": dtypes, "shapes": shapes, "records": records}

    def _host_tables(self, batches):
        out = {}
        for b in batches:
            entry = self._wtables.get(b)
            if entry is not None:
                out[b] = (entry[0].cpu().numpy(), entry[1])
        return out

    def _find_offender(self, trip_pos):
        i = bisect.bisect_right(self._frame_starts, trip_pos) - 1
        while i >= 0:
            f = self._frames[i]
            if f[_F_START] <= trip_pos < f[_F_START] + f[_F_NREC]:
                return i
            if f[_F_START] + f[_F_NREC] <= trip_pos:
                return None
            i -= 1
        return None

    def build_report(self, offender: int, host_ring, found_at=None, late=False) -> dict:
        """The report dictionary (numguard.dump's schema) for the frame at index `offender`."""
        frames = self._frames
        off = frames[offender]
        section = off[_F_SECTION]
        chosen = set()
        floor = min(self._floor, offender)
        for want in {"forward", section}:
            count = 0
            j = offender
            while j >= floor and count < self.max_frames_to_save:
                f = frames[j]
                if f[_F_SECTION] == want:
                    if want != "forward" or f[_F_HF]:
                        count += 1
                    chosen.add(j)
                j -= 1
        lo = min(chosen) if chosen else offender
        tables = self._host_tables({frames[j][_F_BATCH] for j in range(lo, offender + 1)})
        valid_end = off[_F_START] + off[_F_NREC]  # the ring froze after the offending frame
        out_frames = []
        for j in range(lo, offender + 1):
            fr = self._frame_records(frames[j], host_ring, tables, valid_end)
            fr["in_report"] = j in chosen
            fr["offender"] = j == offender
            out_frames.append(fr)
        offender_frame = out_frames[-1]
        bad = [lab for lab, rec in zip(offender_frame["labels"], offender_frame["records"])
               if _report.is_nonfinite(rec)]
        batch = off[_F_BATCH]
        hf_batch = batch + (1 if (off[_F_OWNER].is_root and section == "forward" and off[_F_HF]) else 0)
        return {
            "format": "numguard-report", "version": 1,
            "batch_number": hf_batch, "batch": batch, "found_at_batch": found_at,
            "check": self.check_mode, "check_every": self.check_every, "where": self._where,
            "rank": _rank(), "ranks": [],
            "module": off[_F_OWNER].name, "class": off[_F_OWNER].cls, "labels": bad, "section": section,
            "max_frames_to_save": self.max_frames_to_save, "headroom": self.headroom,
            "backend": ops.backend(), "frames": out_frames,
        }

    def _handle_trip(self, values, others, host_ring, boundary, found_at, late, on_trip=None):
        on_trip = on_trip or self.on_trip
        report = None
        module = None
        labels = []
        batch = None
        if values[0] != 0:
            offender = self._find_offender(values[1])
            if offender is not None:
                try:
                    report = self.build_report(offender, host_ring, found_at, late)
                except Exception as exc:  # the NaN is real even if numguard cannot render it
                    off = self._frames[offender]
                    module, batch = off[_F_OWNER].name, off[_F_BATCH]
                    warnings.warn(f"numguard: could not render the report ({type(exc).__name__}: {exc})",
                                  InspectorWarning, stacklevel=4)
                else:
                    module = report["module"]
                    labels = report["labels"]
                    batch = report["batch"]
            else:
                module = "(frames no longer in the ring)"
        ranks = []
        coordination = self._coordination() if others else None
        if coordination is not None:
            ranks = coordination.gather_trip_details(module if values[0] != 0 else None,
                                                     batch if batch is not None else self._batch_index(),
                                                     tripped=values[0] != 0)
        if report is not None:
            report["ranks"] = [list(r) for r in ranks]
        self.last_report = report
        if report is not None:
            self._trip_reported(report, sum(1 for f in self._frames[offender + 1:] if f[_F_HF]))
        self._reset_after_trip()
        rank = _rank()
        if report is not None:
            text = _report.render(report, self.extras)
        else:
            text = ""
        self.trips += 1
        if text:
            self._emit(text)
        if report is not None and self._trip_message is not None:
            msg = self._trip_message
        elif report is not None:
            on_rank = f" on rank {rank}" if rank is not None else ""
            msg = (f"numguard: inf/nan detected{on_rank} during batch_number={report['batch']} in "
                   f"{module if module else '(root module)'} ({report['class']}) "
                   f"[{', '.join(labels)}]; the report above shows the frames that led to it")
        else:
            tripping = [r for r, m in ranks] or [i for i, v in enumerate(others) if v]
            names = ", ".join(f"rank {r} ({m if m else '(root module)'})" if m is not None else f"rank {r}"
                              for r, m in ranks) or ", ".join(f"rank {r}" for r in tripping)
            msg = (f"numguard: inf/nan detected on {names}; that rank printed the report "
                   "(this rank's values were finite)")
        if on_trip == "raise":
            raise NonFiniteError(msg, report=text, batch_number=batch if batch is not None else self._batch_index(),
                                 module=module if values[0] != 0 else (ranks[0][1] if ranks else None),
                                 labels=labels, rank=rank, ranks=[r for r, _ in ranks])
        if on_trip == "dump" and report is not None:
            # Whatever goes wrong writing the file, the trip itself is still reported below.
            try:
                from . import dump as _dump
                path = _dump.write(report, self.dump_dir, rank=rank)
                msg += f"; report written to {path}"
            except Exception as exc:
                msg += (f"; could not write the dump file ({type(exc).__name__}: {exc}): fix "
                        f"dump_dir={self.dump_dir!r}")
        warnings.warn(msg, NonFiniteWarning, stacklevel=4)

    def _after_raised_forward(self, exc):
        """The root forward raised. A trip another inspector already raised (or an abort) is not
        reported twice; otherwise a NaN recorded before the exception is reported now, as a
        warning (this rank only: the other ranks are not at a check), while the exception goes on."""
        self._batch_open = False
        self._seen.clear()
        if isinstance(exc, (NonFiniteError, AbortAfterBatch)):
            self._reset_after_trip()
            return
        values = self._state_buf.tolist()
        if values[0] != 0:
            self._where = f"the forward raised {type(exc).__name__}"
            host_ring = self._ring.cpu().numpy()
            self._handle_trip(values, [], host_ring, len(self._frames), self._batch_index(), False,
                              on_trip="warn" if self.on_trip == "raise" else self.on_trip)

    @_outside_inference_mode
    def _reset_after_trip(self):
        self._seen.clear()
        ops.reset_state(self._state)
        self._state_buf[4].fill_(0)
        # Frames recorded after the trip were not written (freeze on trip): forget them all.
        self._drop_frames(len(self._frames))
        self._floor = 0
        self._last_check_frames = 0

    def _emit(self, text):
        target = self.report_to
        if target is None:
            return
        try:
            if target is _STDOUT:
                print(text, file=sys.stdout, flush=True)
            elif callable(target) and not hasattr(target, "write"):
                target(text)
            else:
                print(text, file=target, flush=True)
        except Exception as exc:
            warnings.warn(f"numguard: could not print the report to report_to={target!r} "
                          f"({type(exc).__name__}: {exc}); it is still on the exception and in last_report",
                          InspectorWarning, stacklevel=4)

    # ------------------------------------------------------------------------------------------
    # Headroom

    @_outside_inference_mode
    def _handle_headroom(self, host_ring, boundary):
        R = host_ring.shape[0]
        limit = self.headroom
        reported = set()  # a tensor seen by several modules is reported for the first (its producer)
        for f in self._frames[:boundary]:
            owner = f[_F_OWNER]
            if owner.headroom == 0.0:
                continue
            t = 0
            for label, kind in zip(f[_F_LABELS], f[_F_KINDS]):
                if kind & 3 != _T:
                    continue
                dtype = f[_F_DTYPES][t]
                p = f[_F_POS][t]
                t += 1
                dmax = _LOW_PRECISION.get(dtype)
                if dmax is None or p < self._pos - R or p in reported:
                    continue
                reported.add(p)
                value = float(host_ring[p % R][_report.ABS_MAX])
                if value > limit * dmax:
                    self._warn_headroom(owner, label, value, dtype, dmax)
                    break
        if self._w_limits_inv is not None:
            tables = self._host_tables(list(self._wtables))
            limits = self._w_limits_inv.cpu().tolist()
            for owner in self._owners:
                for name, w in zip(owner.wnames, owner.widx):
                    if w >= len(limits) or limits[w] == 0.0:
                        continue
                    for stats, layout in tables.values():
                        if w < len(stats) and stats[w][_report.ABS_MAX] * limits[w] > limit:
                            dtype = getattr(torch, layout["dtypes"][w].replace("torch.", ""))
                            self._warn_headroom(owner, name, float(stats[w][_report.ABS_MAX]), dtype,
                                                _LOW_PRECISION[dtype], weight=True)
                            limits[w] = 0.0
                            break
            self._w_limits_inv = torch.tensor(limits, dtype=torch.float64).to(self._device) if any(limits) else None
        self._state[2].fill_(0)
        self._state[3].fill_(-1)
        self._state_buf[4].fill_(0)

    def _warn_headroom(self, owner, label, value, dtype, dmax, weight=False):
        if not weight:
            owner.headroom = 0.0  # warn once per module: this module no longer raises the flag
        key = ("headroom", id(owner), label if weight else None)
        if key in self._warned:
            return
        self._warned.add(key)
        name = owner.name or "(root module)"
        warnings.warn(f"numguard: {name} ({owner.cls}) {label} reached abs max {value:.4g}, "
                      f"{value / dmax:.0%} of {str(dtype).replace('torch.', '')}'s largest finite value "
                      f"{dmax:.6g} (headroom={self.headroom}); it may overflow soon: consider loss scaling, "
                      "a wider dtype for this module, or smaller activations", HeadroomWarning, stacklevel=4)

    # ------------------------------------------------------------------------------------------
    # Trace mode

    def _print_trace(self, batch):
        first = None
        for i in range(len(self._frames) - 1, self._floor - 1, -1):
            if self._frames[i][_F_BATCH] != batch:
                break
            first = i
        if first is None:
            return
        host_ring = self._ring.cpu().numpy()
        tables = self._host_tables({batch})
        frames = [self._frame_records(f, host_ring, tables, self._pos) for f in self._frames[first:]
                  if f[_F_SECTION] == "forward"]
        self._emit(_report.render_trace(frames, self.extras)[:-1])

    # ------------------------------------------------------------------------------------------
    # detect_overflow inside a watched forward

    def _record_detect(self, var, ctx, module):
        name = self._module_names.get(module) if module is not None else None
        if name is None:
            owner = self._root_owner
        else:
            owner = next((o for o in self._owners if o.name == name), self._root_owner)
        self._record(owner, [var], [str(ctx)], [_T | _EXTRA], "forward", False, False)


def watch(model: torch.nn.Module, max_frames_to_save=_env.UNSET, trace_batch_nums=_env.UNSET,
          abort_after_batch_num=_env.UNSET, **options) -> Inspector:
    """Watch every module of `model`; returns an Inspector (a context manager). See Inspector
    for the options (backward, check, check_every, on_trip, dump_dir, headroom, report_to,
    extras). Arguments left out take their NUMGUARD_* variable (numguard.env), then the defaults
    (max_frames_to_save=21, trace_batch_nums=(), abort_after_batch_num=None, backward=False,
    check="sync", check_every=1, on_trip="raise", dump_dir=None)."""
    passed = dict(options, max_frames_to_save=max_frames_to_save, trace_batch_nums=trace_batch_nums,
                  abort_after_batch_num=abort_after_batch_num)
    return Inspector(model, **_env.resolve_watch_options(passed))


class DebugUnderflowOverflow(Inspector):
    """Drop-in for ``transformers.debug_utils.DebugUnderflowOverflow``: the same signature, the
    same printed lines (nothing added), the same exception texts and the same public attributes
    (``batch_number`` counts finished batches, ``detected_overflow``, ``total_calls``, ``frames``,
    ``prefix``), from numguard's sync-free device-side recording.

    numguard's extras are options here, off by default: ``extras=True`` (keyword inputs, nested
    outputs and numguard's own report sections), ``headroom=0.5`` (warnings before fp16/bf16
    overflow), and every other ``watch()`` option.

    One deliberate difference: after a traced batch, Transformers' frame buffer loses its size
    limit (it becomes a list), so its next report, and its ``frames``, hold every frame since the
    trace; numguard keeps the last ``max_frames_to_save``, printed exactly as Transformers prints
    them. Keeping them all would grow memory for the rest of the job. And a NaN inside a traced
    batch is raised at that batch's end (after its trace), not at the next batch's first module."""

    prefix = " " * 17
    _trip_message = ("DebugUnderflowOverflow: inf/nan detected, aborting as there is no point running further. "
                     "Please scroll up above this traceback to see the activation values prior to this event.")

    def __init__(self, model, max_frames_to_save=21, trace_batch_nums=None, abort_after_batch_num=None, *,
                 extras=False, headroom=0.0, **options):
        super().__init__(model, max_frames_to_save, trace_batch_nums or [], abort_after_batch_num,
                         extras=extras, headroom=headroom, **options)
        self.trace_batch_nums = list(trace_batch_nums or [])  # as given, like Transformers keeps it
        self._model = model  # a strong reference, like Transformers' `model` attribute

    @property
    def model(self):
        return self._model

    _batch_offset = 0

    @property
    def batch_number(self) -> int:
        """Batches finished so far (Transformers' meaning: the batch running now, 0-indexed)."""
        return self._batches_done - self._batch_offset

    def _trip_reported(self, report, frames_after):
        # Transformers raises inside the offending module's hook: its counters stop there.
        self._batch_offset = self._batches_done - report["batch_number"]
        self._hf_calls -= frames_after

    @property
    def detected_overflow(self) -> bool:
        """Whether a NaN/Inf has been detected."""
        return self.trips > 0

    @property
    def total_calls(self) -> int:
        """Module forward calls recorded so far."""
        return self._hf_calls

    @property
    def frames(self):
        """The last `max_frames_to_save` frames as Transformers' text blocks. Reading it copies the
        ring to the host (one device->host copy), so it is for inspection, not for every step."""
        import collections

        kept = [f for f in self._frames[self._floor:] if f[_F_HF] and f[_F_SECTION] == "forward"]
        kept = kept[-self.max_frames_to_save:]
        texts = collections.deque([], self.max_frames_to_save)
        if kept:
            host_ring = self._ring.cpu().numpy()
            tables = self._host_tables({f[_F_BATCH] for f in kept})
            for f in kept:
                texts.append(_report.frame_text(self._frame_records(f, host_ring, tables, self._pos), False))
        return texts

    def _abort_message(self, batch):
        return (f"DebugUnderflowOverflow: aborting after {self._batches_done} batches due to "
                f"`abort_after_batch_num={self.abort_after_batch_num}` arg")


def _current_module(inspector):
    frame = sys._getframe(2)
    names = inspector._module_names
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, torch.nn.Module) and candidate in names:
            return candidate
        frame = frame.f_back
    return None


def detect_overflow(var, ctx) -> bool:
    """Inside a watched forward: record `var` as a line labelled `ctx` of the module whose forward
    is running (no host sync; returns False, the check happens at batch end). Outside: like
    Transformers' helper, print "<ctx> has nans" / "<ctx> has infs" and return whether either was
    found."""
    if _active and isinstance(var, torch.Tensor):
        inspector = _active[-1]
        try:
            inspector._record_detect(var, ctx, _current_module(inspector))
            return False
        except Exception as exc:
            warnings.warn(f"numguard.detect_overflow: could not record {ctx!r} ({exc}); checking it now",
                          InspectorWarning, stacklevel=2)
    stats = ops.tensor_stats(var).tolist()
    detected = False
    if stats[_report.NAN] > 0:
        detected = True
        print(f"{ctx} has nans")
    if stats[_report.POS_INF] + stats[_report.NEG_INF] > 0:
        detected = True
        print(f"{ctx} has infs")
    return detected
