"""``guard_collectives``: run :func:`~numguard.distributed.check_shapes` before every
``torch.distributed`` collective, with what that collective needs ranks to agree on.

The guard replaces names in the ``torch.distributed`` namespace only (``dist.all_reduce`` etc.).
It does not see functions imported by name before it was installed (``from torch.distributed
import all_reduce``), torch's functional collectives, or calls torch makes internally through
``torch.distributed.distributed_c10d`` (numguard's own collectives go through those, so the guard
never checks itself).

What each collective checks (shapes and dtypes must be equal on every rank; the reduce op and
the src/dst rank must agree too where the collective has them):

==========================================  ================================================
collective                                  checked
==========================================  ================================================
all_reduce, broadcast, reduce               ``tensor``
all_gather                                  the tensor this rank contributes and the
                                            length of ``tensor_list``; with uneven entries
                                            (NCCL) the list itself, and that each rank's
                                            tensor matches its own entry
gather                                      the tensor this rank contributes
all_gather_single / all_gather_into_tensor  ``input_tensor`` and ``output_tensor``
reduce_scatter_single / _tensor             ``input`` and ``output``
scatter                                     ``tensor`` (the receive buffer; ``scatter_list``
                                            exists on the source rank only)
all_to_all_single                           dtype and trailing dims; also the first dim when
                                            no split sizes are given (with split sizes the
                                            first dims legitimately differ)
barrier, monitored_barrier                  only that every rank is at the same operation
all_gather_object, broadcast_object_list    the length of the object list (and src); the
                                            objects themselves are pickled, sizes may differ
gather_object, scatter_object_list          dst / src
==========================================  ================================================

Barriers and object collectives are checked so that a rank waiting in one meets the checks of
ranks that are elsewhere: one rank running an extra guarded collective while the other waits in
a barrier is a mismatch naming both operations, and a rank still in an unchecked collective
(DDP's gradient all_reduce in one more step) is named by the waiting rank's timeout.
"""
from __future__ import annotations

import functools
import threading

import torch
import torch.distributed as dist

from ._env import dist_timeout
from .shapes import TensorSpec, check_shapes

_NAMESPACE = "torch.distributed"


def _arg(args, kwargs, index, name, default=None):
    if len(args) > index:
        return args[index]
    return kwargs.get(name, default)


def _first(name, index):
    def spec(args, kwargs):
        return _arg(args, kwargs, index, name)
    return spec


def _in_out(out_name, in_name):
    def spec(args, kwargs):
        return {out_name: _arg(args, kwargs, 0, out_name), in_name: _arg(args, kwargs, 1, in_name)}
    return spec


def _all_gather(args, kwargs):
    """all_gather: ranks must agree on the output list; each rank's contribution must match its
    own entry. With equal entries (the common case) that is the contributed tensor itself."""
    outs = _arg(args, kwargs, 0, "tensor_list")
    tensor = _arg(args, kwargs, 1, "tensor")
    if (isinstance(outs, (list, tuple)) and outs and isinstance(tensor, torch.Tensor)
            and all(isinstance(t, torch.Tensor) for t in outs)
            and any(t.shape != outs[0].shape for t in outs)):
        return {"tensor_list": list(outs)}  # uneven sizes (NCCL): the list is what must agree
    return tensor


def _all_gather_details(args, kwargs, group):
    outs = _arg(args, kwargs, 0, "tensor_list")
    tensor = _arg(args, kwargs, 1, "tensor")
    if not isinstance(outs, (list, tuple)) or not isinstance(tensor, torch.Tensor):
        return ""
    n = f"tensor_list of {len(outs)}"
    if outs and all(isinstance(t, torch.Tensor) for t in outs):
        if all(t.shape == outs[0].shape for t in outs):
            return n
        me = dist.get_rank(group)
        own = outs[me] if 0 <= me < len(outs) else None
        ok = own is not None and own.shape == tensor.shape and own.dtype == tensor.dtype
        return n + (", own tensor matches its entry" if ok else
                    ", own tensor does NOT match its entry")
    return n


def _all_to_all_single(args, kwargs):
    out = _arg(args, kwargs, 0, "output")
    inp = _arg(args, kwargs, 1, "input")
    out_splits = _arg(args, kwargs, 2, "output_split_sizes")
    in_splits = _arg(args, kwargs, 3, "input_split_sizes")
    if not isinstance(out, torch.Tensor) or not isinstance(inp, torch.Tensor):
        return {"output": out, "input": inp}
    if out_splits is None and in_splits is None:
        return {"output": out, "input": inp}
    def spec(t):
        return TensorSpec((-1,) + tuple(t.shape[1:]), t.dtype) if t.dim() else t
    return {"output": spec(out), "input": spec(inp)}


def _nothing(args, kwargs):
    return None


def _object_list(index, name):
    def details(args, kwargs, group):
        objects = _arg(args, kwargs, index, name)
        return f"{name} of {len(objects)}" if isinstance(objects, (list, tuple)) else ""
    return details


def _op_name(op) -> str:
    name = getattr(op, "name", None)
    return name if isinstance(name, str) else type(op).__name__


def _reduce_op(index):
    def details(args, kwargs, group):
        return "op=" + _op_name(_arg(args, kwargs, index, "op", dist.ReduceOp.SUM))
    return details


def _root_rank(args, kwargs, index, name, group):
    """src/dst as a global rank, whether given as ``src`` or ``group_src`` (default 0)."""
    value = _arg(args, kwargs, index, name)
    if value is None:
        value = kwargs.get("group_" + name)
        if value is not None and group is not None:
            value = dist.get_global_rank(group, value)
    return f"{name}={0 if value is None else value}"


def _root(index, name, op_index=None, list_details=None):
    def details(args, kwargs, group):
        text = _root_rank(args, kwargs, index, name, group)
        if op_index is not None:
            text += ", op=" + _op_name(_arg(args, kwargs, op_index, "op", dist.ReduceOp.SUM))
        if list_details is not None:
            text += ", " + list_details(args, kwargs, group)
        return text
    return details


# name -> (what to check, index of the group argument, other arguments that must agree)
_COLLECTIVES = {
    "all_reduce": (_first("tensor", 0), 2, _reduce_op(1)),
    "broadcast": (_first("tensor", 0), 2, _root(1, "src")),
    "reduce": (_first("tensor", 0), 3, _root(1, "dst", op_index=2)),
    "all_gather": (_all_gather, 2, _all_gather_details),
    "gather": (_first("tensor", 0), 3, _root(2, "dst")),
    "scatter": (_first("tensor", 0), 3, _root(2, "src")),
    "all_gather_single": (_in_out("output_tensor", "input_tensor"), 2, None),
    "all_gather_into_tensor": (_in_out("output_tensor", "input_tensor"), 2, None),
    "reduce_scatter_single": (_in_out("output", "input"), 3, _reduce_op(2)),
    "reduce_scatter_tensor": (_in_out("output", "input"), 3, _reduce_op(2)),
    "all_to_all_single": (_all_to_all_single, 4, None),
    "barrier": (_nothing, 0, None),
    "monitored_barrier": (_nothing, 0, None),
    "all_gather_object": (_nothing, 2, _object_list(0, "object_list")),
    "gather_object": (_nothing, 3, _root(2, "dst")),
    "broadcast_object_list": (_nothing, 2, _root(1, "src",
                                                 list_details=_object_list(0, "object_list"))),
    "scatter_object_list": (_nothing, 3, _root(2, "src")),
}

_lock = threading.Lock()
_local = threading.local()
_installed: "CollectiveGuard | None" = None


def _compiling() -> bool:
    try:
        return torch.compiler.is_compiling()
    except Exception:
        return False


def _wrap(guard, name, original, spec, group_index, details):
    qualname = f"{_NAMESPACE}.{name}"

    @functools.wraps(original)
    def guarded(*args, **kwargs):
        g = guard  # each wrapper serves its own guard: a removed one passes calls through
        if g.active and not getattr(_local, "busy", False) and not _compiling():
            group = _arg(args, kwargs, group_index, "group")
            _local.busy = True
            try:
                check_shapes(spec(args, kwargs), op=qualname, group=group, timeout=g.timeout,
                             details=details(args, kwargs, group) if details is not None else "")
            finally:
                _local.busy = False
        return original(*args, **kwargs)

    guarded.__numguard_original__ = original
    return guarded


class CollectiveGuard:
    """Handle returned by :func:`guard_collectives`; ``remove()`` (or leaving the ``with`` block)
    restores the original functions."""

    def __init__(self, timeout):
        self.timeout = timeout
        self.active = True
        self._originals: dict = {}
        self._wrappers: dict = {}

    def _install(self):
        for name, (spec, group_index, details) in _COLLECTIVES.items():
            original = getattr(dist, name, None)
            if original is None:
                continue
            original = getattr(original, "__numguard_original__", original)
            wrapper = _wrap(self, name, original, spec, group_index, details)
            self._originals[name] = original
            self._wrappers[name] = wrapper
            setattr(dist, name, wrapper)

    @property
    def names(self) -> list[str]:
        """The ``torch.distributed`` functions this guard wraps."""
        return sorted(self._wrappers)

    def remove(self) -> None:
        """Undo the guard (idempotent). A function someone else wrapped on top of ours is left in
        place, and our wrapper inside it passes calls through unchecked."""
        global _installed
        with _lock:
            if not self.active:
                return
            self.active = False
            for name, wrapper in self._wrappers.items():
                if getattr(dist, name, None) is wrapper:
                    setattr(dist, name, self._originals[name])
            if _installed is self:
                _installed = None

    undo = remove

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()
        return False

    def __repr__(self):
        state = "active" if self.active else "removed"
        return f"<numguard CollectiveGuard {state}: {', '.join(self.names)}>"


def guard_collectives(timeout: float | None = None) -> CollectiveGuard:
    """Check shapes and dtypes across ranks before every ``torch.distributed`` collective.

    Args:
        timeout: seconds each check waits for every rank before naming the missing ones
            (default: ``NUMGUARD_DIST_TIMEOUT``, else 60).

    Returns a :class:`CollectiveGuard`; call ``.remove()`` or use it as a context manager to undo.
    Calling again while a guard is installed returns that same guard (updating its timeout when
    one is given); nothing is wrapped twice. ``NUMGUARD_DIST_CHECK=1`` installs it when
    ``numguard.distributed`` is imported.
    """
    global _installed
    if timeout is not None:
        timeout = dist_timeout(timeout)  # validate now, not at the first collective
    with _lock:
        if _installed is not None and _installed.active:
            if timeout is not None:
                _installed.timeout = timeout
            return _installed
        guard = CollectiveGuard(timeout)
        guard._install()
        _installed = guard
        return guard


def unguard_collectives() -> None:
    """Remove the installed guard, if any."""
    g = _installed
    if g is not None:
        g.remove()


def installed_guard() -> CollectiveGuard | None:
    return _installed
