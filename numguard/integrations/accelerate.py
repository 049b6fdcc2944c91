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

``NUMGUARD_DIST_CHECK=1``: Accelerate's gather, reduce, broadcast, pad_across_processes and
gather_for_metrics call ``torch.distributed`` collectives by their module names, which
``numguard.distributed.guard_collectives`` wraps; a shape or dtype mismatch raises
``numguard.distributed.DistributedOperationException`` on every process instead of hanging.
When ``ACCELERATE_DEBUG_MODE`` is also set, ``watch`` turns Accelerate's own check off (numguard's
covers the same operations, and dtypes too) and says so once: the two never both run.
"""
from __future__ import annotations

import logging

from .. import env
from . import _common

__all__ = ["watch", "numerics_summary", "prefer_numguard_collective_check"]

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
