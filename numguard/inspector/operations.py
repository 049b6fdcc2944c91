"""Operation mode (``watch(model, ops=True)`` / ``NUMGUARD_OPS=1``): while the watched forward
runs, a TorchDispatchMode records the floating-point outputs (and tensor inputs) of every aten
operation into the Inspector's ring, one ``record_`` launch per operation and no host sync, as
frames of the "operations" section. A trip then names the first operation that made a NaN/Inf,
the module whose forward ran it and the call site (file:line) in the user's code.

With ``backward=True`` too, the operations of the backward are recorded as well (section
"backward operations"): numguard.backward enters this mode around ``torch.autograd.backward``
(autograd copies the thread-local dispatch modes active when the backward starts to the threads
that run it, so the mode also sees a CUDA backward's worker thread). Each backward operation is
named by the autograd node that ran it (``SqrtBackward0``) and by the module and call site of the
forward operation that made that node: the forward tags each node with them when a later
operation consumes its output (inside a dispatch mode an output has no grad_fn yet). Gradients
computed with ``torch.autograd.grad`` are not recorded as operations (only ``backward()``).
"""
from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .. import ops as _ops
from .. import process as _process
from .. import schema
from . import frames as _frames
from .features import Feature

SECTION = "operations"
BACKWARD_SECTION = "backward operations"
_FLOATING = frozenset(d for d in (torch.float64, torch.float32, torch.float16, torch.bfloat16,
                                  getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None))
                      if d is not None)
_Tensor = torch.Tensor
_dead = lambda: None  # noqa: E731  (a weakref that never matches)


def call_site():
    """'file.py:123' of the innermost frame outside torch and numguard ('' when there is none)."""
    return _process.call_site(basename=True, unknown="")


def _skipped(func):
    """numguard's own ops, views and metadata-only ops: nothing new to look at."""
    if func.namespace == "numguard":
        return True
    try:
        return func.is_view or func._schema.name in _METADATA
    except Exception:
        return True


_METADATA = frozenset({"aten::detach", "aten::alias", "aten::lift_fresh", "aten::sym_size", "aten::sym_stride",
                       "aten::sym_numel", "aten::sym_storage_offset", "aten::_local_scalar_dense",
                       "aten::is_same_size", "aten::empty_like", "aten::empty", "aten::empty_strided",
                       "aten::set_", "aten::resize_"})


# Operations that turn -inf into finite values (a -inf attention mask ends here).
_CLEARS_INTENDED = frozenset({"aten::_softmax", "aten::softmax", "aten::_safe_softmax", "aten::exp",
                              "aten::sigmoid"})
_INF = float("inf")


def _clears_intended(op):
    return op in _CLEARS_INTENDED or "scaled_dot_product" in op


def _nonfinite_scalar(values):
    """Whether a Python number among `values` is inf or NaN (e.g. masked_fill(mask, -inf))."""
    for v in values:
        if type(v) is float and (v != v or v == _INF or v == -_INF):
            return True
    return False


_SCRATCH_SLOTS = 4096  # recording states for operation frames, reused after this many per pass
_LINEAGE_LIMIT = 200_000
_TAG = "numguard_op"   # key of an autograd node's metadata: (module owner, call site) of its forward op
_current_node = torch._C._current_autograd_node


_SEEN_OUTPUTS = 8192


def _storage_key(x):
    """(device index, storage address) of `x`, shared by all its views; None when it has none."""
    try:
        ptr = x.untyped_storage().data_ptr()
    except Exception:   # tensors without storage (subclasses, sparse): followed by identity only
        return None
    return (x.get_device(), ptr) if ptr else None


def _made_at(made, x):
    """Ring position of the record of the operation that last wrote `x`'s values this pass, or -1.
    NOTE: [lineage through views] Views are not recorded (nothing new to look at), so `x` may be a
    view (view, t, expand, a slice) of what an operation made, and an in-place operation on one
    view changes every other view of the same storage: besides `x` itself, the last recorded
    output that shares its storage (while it, or the base it is a view of, is alive, so the
    storage cannot have been reused) counts, whichever was written later."""
    hit = made.get(id(x))
    found = hit[1] if hit is not None and hit[0]() is x else -1
    key = _storage_key(x)
    if key is not None:
        hit = made.get(key)
        if hit is not None and hit[1] > found:
            other = hit[0]()
            if other is not None and _storage_key(other) == key:
                found = hit[1]
    return found


_written_cache = {}   # operator -> (index, name, is out=) of each argument it writes


def _written_arguments(func):
    hit = _written_cache.get(func)
    if hit is None:
        try:
            hit = tuple((i, a.name, a.is_out) for i, a in enumerate(func._schema.arguments)
                        if a.alias_info is not None and a.alias_info.is_write)
        except Exception:
            hit = ()
        _written_cache[func] = hit
    return hit


def _written_tensors(func, args, kwargs):
    """(tensors an in-place operation reads and writes, tensors an out= operation only writes)."""
    both, only = [], []
    for i, name, is_out in _written_arguments(func):
        value = args[i] if i < len(args) else kwargs.get(name)
        into = only if is_out else both
        if isinstance(value, _Tensor):
            into.append(value)
        elif isinstance(value, (list, tuple)):
            into.extend(v for v in value if isinstance(v, _Tensor))
    return both, only


class OpOwner(_frames.Owner):
    """The owner of an operation frame: the module whose forward ran it, the op and the call site;
    for a backward operation, `backward_of` names the autograd node that ran it."""
    __slots__ = ("op", "site", "module", "backward_of")

    def __init__(self, module_owner, op, site, backward_of=None):
        super().__init__(-1, module_owner.name, module_owner.cls, module_owner.ref, headroom=0.0)
        self.op = op
        self.site = site
        self.module = module_owner
        self.backward_of = backward_of


class OperationRecorder(TorchDispatchMode, Feature):
    """Records aten operations into `inspector`'s ring while entered. Owners come from a stack of
    the modules whose forward is running (pushed by pre-hooks, popped by always-called hooks)."""

    def __init__(self, inspector):
        super().__init__()
        self.inspector = inspector
        self.stack = []
        self.paused = 0        # > 0 while numguard itself runs torch code inside the forward
        self.off = False       # an internal error switched operation mode off for this inspector
        self.entered = False
        self.backward = False   # recording a backward (numguard.backward enters the mode around it)
        self.tag_nodes = False  # tag autograd nodes for naming backward operations (backward=True)
        self.produced = {}      # id(output) -> (weakref, (module owner, site)): nodes not tagged yet
        self._owners = {}      # (module owner index, op, site) -> OpOwner
        # id(tensor) -> weakref: tensors non-finite by intent (made with an explicit inf/NaN
        # number, e.g. a -inf attention mask) and what is computed from them up to a softmax.
        self.intended = {}
        # NOTE: [operation frames do not trip] An operation's NaN/Inf explains a module's trip; it
        # is not a trip by itself (a model may make one and throw it away, e.g. T5's log(0) in
        # its relative-position buckets, dropped by torch.where). Each operation frame updates a
        # recording state of its own (a row of `_scratch`) and records every tensor afresh, so
        # module frames trip exactly as without operation mode; after a module trip the report
        # follows `lineage` back from the module's bad output to the operation that made it.
        self._scratch = None
        self._slot = 0
        self.made = {}          # id(output) -> (weakref, ring position of its record), this pass
        self.lineage = {}       # operation frame start -> ring positions of the records that made its inputs

    def _op_state(self, ring):
        """A fresh recording state for one operation frame (a row of a scratch buffer on the ring's
        device; rows are re-armed with one fill per pass, never read)."""
        scratch = self._scratch
        slot = self._slot
        if scratch is None or scratch.device != ring.device:
            with torch.inference_mode(False):
                scratch = self._scratch = torch.zeros((_SCRATCH_SLOTS, len(schema.STATE_INITIAL)),
                                                      dtype=torch.int64, device=ring.device)
            slot = 0
        elif slot >= _SCRATCH_SLOTS:
            slot = 0
        if slot == 0:
            scratch.select(1, schema.TRIPPED).zero_()
        self._slot = slot + 1
        return scratch[slot]

    def _new_pass(self):
        self._slot = 0
        self.made.clear()
        if len(self.lineage) > _LINEAGE_LIMIT:
            self.lineage.clear()

    # -- module stack (hooks installed only with ops=True) ---------------------------------------
    def push(self, owner):
        if self.entered:
            self.stack.append(owner)

    def pop(self, owner):
        if self.entered and self.stack and self.stack[-1] is owner:
            self.stack.pop()

    def start(self, top_owner):
        if self.off or self.entered:
            return
        self._new_pass()
        self.stack = [top_owner]
        self.__enter__()
        self.entered = True

    def stop(self):
        if not self.entered:
            return
        self.entered = False
        self.backward = False
        self.stack = []
        self.intended.clear()
        if self.produced:
            self._tag_returned()
        self.__exit__(None, None, None)

    def close(self):
        self.stop()

    def enter_backward(self) -> bool:
        """Enter the mode for a backward (numguard.inspector.gradients); whether it did. Its
        failure switches operation mode off, never the job."""
        if self.inspector._batch.closed:
            return False
        try:
            return self.start_backward()
        except Exception as exc:
            self.inspector._ops_failed(exc)
            return False

    def leave_backward(self) -> None:
        """Leave the mode after a backward that enter_backward entered."""
        self.inspector._ops_call("stop")

    def start_backward(self):
        """Enter the mode for a backward; False when it is off or already entered."""
        if self.off or self.entered:
            return False
        self._new_pass()
        self.stack = []
        self.backward = True
        self.__enter__()
        self.entered = True
        return True

    def _tag_returned(self):
        """Tag the nodes of outputs no operation consumed in the forward (what the model returned)."""
        try:
            for ref, info in self.produced.values():
                x = ref()
                node = x.grad_fn if x is not None else None
                if node is not None and _TAG not in node.metadata:
                    node.metadata[_TAG] = info
        finally:
            self.produced.clear()

    # -- the mode --------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        before = None
        if not (self.off or self.paused) and _written_arguments(func):
            self.paused += 1
            try:
                before = self._stats_before(func, args, kwargs)
            except Exception as exc:  # numguard's own failure must not kill the job
                self.inspector._ops_failed(exc)
            finally:
                self.paused -= 1
        out = func(*args, **kwargs)
        if self.off or self.paused or _skipped(func):
            return out
        self.paused += 1   # what recording runs is numguard's own work, never recorded
        try:
            self._record(func, args, kwargs, out, before)
        except Exception as exc:  # numguard's own failure must not kill the job
            self.inspector._ops_failed(exc)
        finally:
            self.paused -= 1
        return out

    def _pick(self, func, args, kwargs, out, only_written=()):
        """(op name, tensor inputs, floating outputs, output labels) of an operation worth looking
        at, or None: no floating output, or non-finite by intent (not a numerics bug).
        `only_written`: ids of out= tensors, which are outputs, not inputs."""
        if type(out) is _Tensor:
            if out.dtype not in _FLOATING:
                return None
            outs = [out]
            out_labels = ["output"]
        else:
            flat, _ = tree_flatten(out)
            outs = [x for x in flat if isinstance(x, _Tensor) and x.dtype in _FLOATING]
            if not outs:
                return None
            out_labels = [f"output[{i}]" for i in range(len(outs))]
        flat_in, _ = tree_flatten((args, kwargs))
        ins = [x for x in flat_in if isinstance(x, _Tensor) and id(x) not in only_written]
        op = func._schema.name
        intended = self.intended
        if intended:
            kept = [x for x in ins if (intended.get(id(x)) or _dead)() is not x]
            tainted = len(kept) < len(ins)
        else:
            kept, tainted = ins, False
        if _nonfinite_scalar(flat_in) or (tainted and not _clears_intended(op)):
            # Non-finite by intent: not a numerics bug, so not recorded (the module frames still
            # see whatever reaches a module's output).
            if len(intended) > 4096:
                intended.clear()
            for x in outs:
                intended[id(x)] = weakref.ref(x)
            return None
        return op, kept, outs, out_labels

    def _stats_before(self, func, args, kwargs):
        """NOTE: [inputs of in-place operations] An in-place or out= operation overwrites its
        input, and records are taken after an operation runs: the input's record would show the
        result, and the blame would pass the operation by. The stats of the tensors it writes are
        taken before it runs (one launch, no sync) and put in place of their input records; an
        out= tensor's old values are no input at all and are left out.
        Returns ({id(tensor): row}, stats, ids of out= tensors) or None."""
        if _skipped(func):
            return None
        xs, only = _written_tensors(func, args, kwargs)
        rows = {}
        unique = []
        for x in xs:
            if id(x) not in rows:
                rows[id(x)] = len(unique)
                unique.append(x)
        stats = _ops.multi_tensor_stats(self.inspector._ring.sanitize(unique)) if unique else None
        return rows, stats, {id(x) for x in only}

    def _record(self, func, args, kwargs, out, before=None):
        picked = self._pick(func, args, kwargs, out, before[2] if before is not None else ())
        if picked is None:
            return
        op, ins, outs, out_labels = picked
        insp = self.inspector
        backward_of = None
        if self.backward:
            node = _current_node()
            info = node.metadata.get(_TAG) if node is not None else None
            module_owner, site = info if info is not None else (insp._root_owner, "")
            backward_of = node.name() if node is not None else "(autograd engine)"
            section = BACKWARD_SECTION
        else:
            module_owner = self.stack[-1] if self.stack else insp._root_owner
            site = call_site()
            section = SECTION
            if self.tag_nodes:  # also under no_grad: a custom Function's forward makes its output so
                self._tag(ins, outs, module_owner, site)
        key = (id(module_owner), op, site, backward_of)
        owner = self._owners.get(key)
        if owner is None:
            if len(self._owners) > 100_000:  # bounded however many call sites a job has
                self._owners.clear()
            owner = self._owners[key] = OpOwner(module_owner, op, site, backward_of)
        labels = [f"input[{i}]" for i in range(len(ins))] + out_labels
        kinds = [_frames.TENSOR] * len(labels)
        ring = insp._ring
        start = ring.pos
        made = self.made
        self.lineage[start] = tuple(_made_at(made, x) for x in ins)
        # NOTE: [operation frames do not trip]: every tensor recorded afresh, inputs then outputs.
        ring.record(owner, ins + outs, labels, kinds, section, False, False, insp._batch.done,
                    self._op_state(ring))
        if before is not None:   # NOTE: [inputs of in-place operations]
            rows, stats, _ = before
            for i, x in enumerate(ins):
                k = rows.get(id(x))
                if k is not None:
                    ring.ring[(start + i) % ring.size].copy_(stats[k])
        if len(made) > _SEEN_OUTPUTS:
            made.clear()
        for i, x in enumerate(outs, start + len(ins)):
            ref = weakref.ref(x)
            made[id(x)] = (ref, i)
            key = _storage_key(x)
            if key is not None:   # NOTE: [lineage through views]
                # A view written in place is often a temporary (h[:, :2].mul_(k)): its base lives on.
                base = x._base
                made[key] = (ref if base is None else weakref.ref(base), i)

    def _tag(self, ins, outs, module_owner, site):
        """Tag the nodes of this operation's inputs with the module and site that made them, and
        remember its outputs for the operation that consumes them."""
        produced = self.produced
        for x in ins:
            node = x.grad_fn
            if node is not None:
                metadata = node.metadata
                if _TAG not in metadata:
                    hit = produced.pop(id(x), None)
                    if hit is not None and hit[0]() is x:
                        metadata[_TAG] = hit[1]
        if len(produced) > 65536:   # bounded: the oldest untagged outputs are forgotten
            produced.clear()
        info = (module_owner, site)
        for x in outs:
            produced[id(x)] = (weakref.ref(x), info)
