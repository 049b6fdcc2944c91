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

Framework operations that recurse into containers (Accelerate's gather, gather_for_metrics,
reduce, broadcast, pad_across_processes) are checked as a whole: see NOTE: [container
operations].
"""
from __future__ import annotations

import functools
import importlib
import threading
import warnings

import torch
import torch.distributed as dist

from .. import patches as _patches
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


# NOTE: [container operations]
# Accelerate's gather (and reduce, broadcast, pad_across_processes) walks a nested container and
# makes one collective per tensor, in the container's own order. Checked tensor by tensor, dicts
# whose keys differ between ranks pass (rank 0 gets rank 1's "c" under "b"), and a key that one
# rank alone has is one collective more on that rank: the others wait in vain, which reads like
# a hang. So the operation announces its whole container (container_operation), and the first
# guarded collective inside it checks the container's description (structure, dict keys in
# order, shapes, dtypes, the operation's arguments) in place of its own tensor's, in the same
# single exchange: no collective is added, and a difference is reported before any rank has made
# the first of its own collectives. A rank whose container makes no collective at all (empty, or
# a non-tensor leaf comes first) checks it on its own at once, meeting the other ranks' first
# check. The integration that knows the framework (numguard.integrations.accelerate) installs the
# announcement when the framework's module is imported while a guard is active
# (_CONTAINER_FRAMEWORKS).
_CONTAINER_FRAMEWORKS = {"accelerate.utils.operations": "numguard.integrations.accelerate"}
_following: set = set()


class _Container:
    __slots__ = ("op", "describe", "details", "site", "checked")

    def __init__(self, op, describe, details, site):
        self.op, self.describe, self.details, self.site = op, describe, details, site
        self.checked = False


def accepts_container() -> bool:
    """Whether an operation announced now would be checked: a guard is active and this thread is
    not inside an announced operation already (nested calls belong to the outer one)."""
    g = _installed
    return (g is not None and g.active and getattr(_local, "container", None) is None
            and not getattr(_local, "busy", False))


def container_operation(op: str, describe, details: str = "", collective_first: bool = True,
                        site=None):
    """Announce a framework operation over a whole container (NOTE: [container operations]).

    Args:
        op: the operation's name, e.g. ``"accelerate.utils.operations.gather"``.
        describe: returns what the ranks must agree on (the container, or a description of it
            with :class:`~numguard.distributed.shapes.TensorSpec` leaves).
        details: the operation's arguments that must agree, as text.
        collective_first: whether this rank's first leaf makes a guarded collective; when not,
            the container is checked now.
        site: returns the caller's ``file:line`` for the message (default: the first frame
            outside numguard and torch).

    Returns a token for :func:`end_container_operation`, or None when there is nothing to do
    (no active guard, already inside an announced operation, inside numguard's own check).
    """
    g = _installed
    if (g is None or not g.active or getattr(_local, "container", None) is not None
            or getattr(_local, "busy", False) or _compiling()):
        return None
    container = _Container(op, describe, details, site)
    if not collective_first:
        container.checked = True
        _check_container(g, container, None)
    _local.container = container
    return container


def end_container_operation(token) -> None:
    """The operation announced by :func:`container_operation` has returned (or raised)."""
    if token is not None and getattr(_local, "container", None) is token:
        _local.container = None


def _check_container(g, container, group) -> bool:
    """Check the announced container; False when it could not be described (the caller then
    checks its own collective as usual)."""
    try:
        obj = container.describe()
        site = container.site() if container.site is not None else None
    except Exception as exc:  # numguard's failure must not stop the job
        warnings.warn(f"numguard: could not describe the container of `{container.op}` "
                      f"({type(exc).__name__}: {exc}); its tensors are checked one by one",
                      RuntimeWarning, stacklevel=4)
        return False
    _local.busy = True
    try:
        check_shapes(obj, op=container.op, group=group, timeout=g.timeout,
                     details=container.details, site=site)
    finally:
        _local.busy = False
    return True


def _follow_container_frameworks() -> None:
    """Have each framework of _CONTAINER_FRAMEWORKS announce its container operations, now if
    it is imported, else when it is."""
    from .._imports import after_import

    for module_name, integration in _CONTAINER_FRAMEWORKS.items():
        if module_name in _following:
            continue
        _following.add(module_name)
        after_import(module_name, functools.partial(_follow_framework, module_name, integration))


def _follow_framework(module_name: str, integration: str) -> None:
    _following.discard(module_name)
    g = _installed
    if g is None or not g.active:
        return
    try:
        undo = importlib.import_module(integration).follow_container_operations()
    except Exception as exc:  # numguard's failure must not stop the job
        warnings.warn(f"numguard: the operations of {module_name} that recurse into containers "
                      f"are checked tensor by tensor only: {type(exc).__name__}: {exc}",
                      RuntimeWarning, stacklevel=2)
        return
    if undo is not None:
        g._undo.append(undo)


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
            container = getattr(_local, "container", None)
            if container is not None and not container.checked:
                # the first collective of an announced container operation checks the whole
                # container instead (NOTE: [container operations])
                container.checked = True
                if _check_container(g, container, group):
                    return original(*args, **kwargs)
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
        self._wrappers: dict = {}
        self._undo: list = []  # frameworks' container operations (NOTE: [container operations])

    def _install(self):
        for name, (spec, group_index, details) in _COLLECTIVES.items():
            original = getattr(dist, name, None)
            if original is None:
                continue
            original = getattr(original, "__numguard_original__", original)
            wrapper = _wrap(self, name, original, spec, group_index, details)
            self._wrappers[name] = wrapper
            _patches.replace(dist, name, wrapper, target=f"torch.distributed.{name}", calls=original,
                             why="guard_collectives(): check shapes and dtypes across ranks first")

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
            for name in self._wrappers:
                _patches.restore(f"torch.distributed.{name}")
            for undo in self._undo:
                undo()
            self._undo.clear()
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
        _follow_container_frameworks()
        return guard


def unguard_collectives() -> None:
    """Remove the installed guard, if any."""
    g = _installed
    if g is not None:
        g.remove()


def installed_guard() -> CollectiveGuard | None:
    return _installed
