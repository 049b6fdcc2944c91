"""numguard with Hugging Face Accelerate:

    from numguard.integrations.accelerate import watch
    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    inspector = watch(accelerator, model)          # after prepare(); a context manager

``watch`` watches the model the prepared one wraps (``accelerator.unwrap_model``), so reports use
the model's own module names, with ``backward=True`` unless told otherwise: parameter gradients are
checked right before each optimizer step. A step that the accelerator's GradScaler skips under
fp16 is counted (``inspector.backward_watcher.scaler_skipped_steps``), not a trip. In a
multi-process run (the accelerator's process state has initialized torch.distributed) a trip on
one process stops every process at the same check.

``NUMGUARD_DIST_CHECK=1`` (or ``numguard.distributed.guard_collectives()``): Accelerate's gather,
reduce, broadcast, pad_across_processes and gather_for_metrics call ``torch.distributed``
collectives by their module names, which the guard wraps, one collective per tensor of the
container they are given. numguard checks the whole container at the first of them (NOTE:
[container operations] in numguard/distributed/guard.py): its structure (dict keys in their
order, list lengths, tensors vs other values), shapes and dtypes, so that dicts whose keys differ
between processes raise ``numguard.distributed.DistributedOperationException`` on every process,
naming each process's keys, before any tensor is exchanged, instead of gathering values under the
wrong keys or waiting for a collective that one process never makes. Accelerate gathers a dict's
values in the dict's order, so the same keys in another order are a mismatch too (Accelerate's
debug mode lets that through). When ``ACCELERATE_DEBUG_MODE`` is also set, ``watch`` turns
Accelerate's own check off (numguard's covers the same operations, and dtypes too) and says so
once: the two never both run.
"""
from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Mapping

from .. import env
from . import _common

__all__ = ["watch", "numerics_summary", "prefer_numguard_collective_check",
           "follow_container_operations"]

_log = logging.getLogger("numguard")
_told = set()


def _dist_check_on() -> bool:
    try:
        guard = __import__("numguard.distributed.guard", fromlist=["installed_guard"]).installed_guard()
        if guard is not None and guard.active:
            return True
    except Exception:
        pass
    try:
        return bool(env.dist_settings_from_env()["dist_check"])
    except Exception:
        return False


def prefer_numguard_collective_check() -> bool:
    """With numguard's collective check on (NUMGUARD_DIST_CHECK=1 or guard_collectives()),
    install it and turn Accelerate's debug-mode check off: ACCELERATE_DEBUG_MODE is set to 0 for
    states made from now on, and any state made already stops checking. Says so once. Returns
    whether Accelerate's check was on. For NUMGUARD=1 jobs, call it at start-up; watch() calls it."""
    import os
    import sys

    if not _dist_check_on():
        return False
    from .. import distributed

    distributed.guard_collectives()
    was_on = os.environ.get("ACCELERATE_DEBUG_MODE", "").strip().lower() in ("1", "true", "yes", "y", "on")
    if was_on:
        os.environ["ACCELERATE_DEBUG_MODE"] = "0"
    state_module = sys.modules.get("accelerate.state")
    if state_module is not None:
        for cls in (getattr(state_module, "PartialState", None), getattr(state_module, "AcceleratorState", None)):
            shared = getattr(cls, "_shared_state", None)
            if isinstance(shared, dict) and shared.get("debug"):
                shared["debug"] = False  # Accelerate's verify_operation reads PartialState().debug
                was_on = True
    if was_on and "debug" not in _told:
        _told.add("debug")
        _common.warn("numguard: NUMGUARD_DIST_CHECK=1 and ACCELERATE_DEBUG_MODE are both set; Accelerate's "
                     "operations are checked by numguard's collective check only (Accelerate's debug-mode "
                     "check is off: it would exchange the same shapes a second time)")
    return was_on


def watch(accelerator, model, **watch_options):
    """Watch a model prepared by `accelerator`; returns the Inspector (a context manager).

    Args:
        accelerator: the ``accelerate.Accelerator`` that prepared `model`.
        model: the prepared model (or the model itself).
        **watch_options: numguard.watch() options; ``backward`` defaults to True here.
    """
    prefer_numguard_collective_check()
    inner = _common.unwrap(accelerator.unwrap_model(model, keep_torch_compile=False))
    # No step counter here: Accelerate's own (accelerator.step) counts accumulate() calls only.
    inspector = _common.watch(inner, watch_options)
    scaler = getattr(accelerator, "scaler", None)
    watcher = inspector.backward_watcher
    if scaler is not None and watcher is not None:
        import torch

        if not isinstance(scaler, torch.amp.GradScaler):
            _common.warn(f"numguard: the accelerator's scaler is a {type(scaler).__name__}, not a "
                         "torch.amp.GradScaler: the steps it skips are not counted, and a skipped step's "
                         "inf gradients are a trip")
    return inspector


def numerics_summary(inspector) -> dict:
    """``numguard/worst_headroom``, ``numguard/nonfinite``, ``numguard/skipped_steps`` for
    ``accelerator.log(...)``."""
    return {"numguard/" + key: value for key, value in _common.numerics_summary(inspector).items()}


# ---------------------------------------------------------------------------------------------
# Accelerate's operations over containers, checked as a whole by numguard's collective guard
# (NOTE: [container operations] in numguard/distributed/guard.py)

_OPERATIONS_MODULE = "accelerate.utils.operations"
_NO_LEAF = object()


def _first_leaf(data):
    """The first value recursively_apply reaches (it walks lists, tuples and Mappings in order)."""
    if isinstance(data, (list, tuple)):
        values = data
    elif isinstance(data, Mapping):
        values = data.values()
    else:
        return data
    for value in values:
        leaf = _first_leaf(value)
        if leaf is not _NO_LEAF:
            return leaf
    return _NO_LEAF


def _is_tensor(leaf, kwargs) -> bool:
    import torch

    return isinstance(leaf, torch.Tensor)


def _is_padded(leaf, kwargs) -> bool:
    """pad_across_processes makes a collective only for a tensor that has its ``dim``."""
    if not _is_tensor(leaf, kwargs) or getattr(leaf, "is_nested", False):
        return False
    dim = kwargs.get("dim", 0)
    return -leaf.dim() <= dim < leaf.dim()


def _as_is(data, kwargs):
    return data


def _any_size(data, kwargs):
    """What ranks must agree on before padding: structure and each tensor's number of dims (which
    decides whether it makes a collective); sizes and dtypes may differ."""
    import torch

    from ..distributed.shapes import TensorSpec

    if isinstance(data, torch.Tensor):
        return TensorSpec((-1,) * data.dim(), None)
    if isinstance(data, (list, tuple)):
        return type(data)(_any_size(v, kwargs) for v in data) if not hasattr(data, "_fields") \
            else tuple(_any_size(v, kwargs) for v in data)
    if isinstance(data, Mapping):
        return {k: _any_size(v, kwargs) for k, v in data.items()}
    return data


# The function each Accelerate operation hands to recursively_apply (by qualified name) ->
# (operation, its arguments that every rank must pass alike, whether a leaf makes a collective,
# what the ranks compare).
_CONTAINER_OPERATIONS = {
    "_gpu_gather.<locals>._gpu_gather_one":
        ("gather", lambda kw: "", _is_tensor, _as_is),
    "_gpu_broadcast.<locals>._gpu_broadcast_one":
        ("broadcast", lambda kw: f"from_process={kw.get('src', 0)}", _is_tensor, _as_is),
    "reduce.<locals>._reduce_across_processes":
        ("reduce", lambda kw: f"reduction={kw.get('reduction', 'mean')}", _is_tensor, _as_is),
    "pad_across_processes.<locals>._pad_across_processes":
        ("pad_across_processes", lambda kw: f"dim={kw.get('dim', 0)}", _is_padded, _any_size),
}


def _caller_site() -> str:
    """``file:line`` of the first frame outside numguard, torch and Accelerate: the line that
    called the Accelerate operation."""
    import os

    from .. import process

    package = os.path.dirname(os.path.dirname(sys.modules[_OPERATIONS_MODULE].__file__)) + os.sep
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not process.is_internal(frame.f_code) and not filename.startswith(package):
            return f"{filename}:{frame.f_lineno}"
        frame = frame.f_back
    return "<unknown>"


def follow_container_operations():
    """Make Accelerate's gather, reduce, broadcast and pad_across_processes announce their whole
    container to numguard's collective guard, which checks it at their first collective.

    Called by ``numguard.distributed.guard_collectives()`` once ``accelerate.utils.operations`` is
    imported. Accelerate's operations call ``recursively_apply`` through their module, so
    wrapping that one name covers every entry point (``accelerator.gather``, ``gather_for_metrics``,
    ``accelerate.utils.gather``...). Returns the callable that undoes it (the guard calls it on
    ``remove()``), or None when already done or Accelerate is not imported.
    """
    operations = sys.modules.get(_OPERATIONS_MODULE)
    if operations is None:
        return None
    original = getattr(operations, "recursively_apply", None)
    if original is None:
        raise AttributeError(f"{_OPERATIONS_MODULE} has no recursively_apply (an Accelerate "
                             "version numguard does not know)")
    if getattr(original, "__numguard_original__", None) is not None:
        return None
    from ..distributed import guard

    @functools.wraps(original)
    def recursively_apply(func, data, *args, **kwargs):
        entry = _CONTAINER_OPERATIONS.get(getattr(func, "__qualname__", None))
        if (entry is None or getattr(func, "__module__", None) != _OPERATIONS_MODULE
                or not guard.accepts_container()):
            return original(func, data, *args, **kwargs)
        name, details, makes_collective, describe = entry
        token = guard.container_operation(
            f"{_OPERATIONS_MODULE}.{name}", functools.partial(describe, data, kwargs),
            details(kwargs), collective_first=makes_collective(_first_leaf(data), kwargs),
            site=_caller_site)
        try:
            return original(func, data, *args, **kwargs)
        finally:
            guard.end_container_operation(token)

    from .. import patches

    patch = patches.replace(operations, "recursively_apply", recursively_apply,
                            target=f"{_OPERATIONS_MODULE}.recursively_apply",
                            why="guard_collectives(): check the whole container of Accelerate's gather/reduce/"
                                "broadcast/pad_across_processes")
    return lambda: patches.restore(patch)
