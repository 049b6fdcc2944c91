"""What the framework integrations share: an Inspector whose reports name the framework's own
step, unwrapping the wrappers frameworks put around a model, the per-step numerics summary, and
taking over from detectors that would watch the same model twice."""
from __future__ import annotations

import warnings

import torch

from .. import env, ownership
from ..errors import InspectorWarning
from ..inspector import core

# Integrations check parameter gradients before every optimizer step unless told otherwise
# (a backward= argument or NUMGUARD_BACKWARD).
DEFAULTS = dict(env.WATCH_DEFAULTS, backward=True)



def resolve_options(options: dict) -> dict:
    """watch() options for an integration: arguments, then NUMGUARD_* variables, then DEFAULTS.
    Raises numguard.env.OptionError (or EnvironmentSettingError) naming the first bad one."""
    return env.resolve_watch_options(dict(options), defaults=DEFAULTS)


def watch(model, options: dict, step=None, step_label="global_step") -> core.Inspector:
    """An Inspector on `model` with the integration's option resolution; `step()` (the
    framework's step counter) is named next to the batch number in trip messages and reports."""
    inspector = core.Inspector(model, **resolve_options(options))
    if step is not None:
        inspector.set_step_counter(step, step_label)
    return inspector


def unwrap(model):
    """The module a framework's wrappers run: through torch.compile's OptimizedModule,
    DistributedDataParallel and DataParallel, to the user's model."""
    parallel = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)
    for _ in range(8):  # wrappers nest a few levels at most
        inner = getattr(model, "_orig_mod", None)
        if isinstance(inner, torch.nn.Module):
            model = inner
        elif isinstance(model, parallel) and isinstance(getattr(model, "module", None), torch.nn.Module):
            model = model.module
        else:
            break
    return model


def take_over_from_start_up(model) -> int:
    """Close the inspectors NUMGUARD=1's start-up watcher put on `model` or inside it, so the
    integration's own inspector is the only one. Returns how many were closed."""
    try:
        return ownership.give_way(model=model)
    except Exception:  # numguard's own trouble: both inspectors keep watching
        return 0


def numerics_summary(inspector) -> dict:
    """Numbers for the framework's logger: trips handled so far ("nonfinite"), optimizer steps
    GradScaler skipped ("skipped_steps"), and "worst_headroom": the largest abs max of a
    float16/bfloat16/float8 tensor among the frames numguard holds (the last checked step's
    context), as a fraction of its dtype's largest finite value (0.0 when none is low precision).
    Reading the headroom copies the small ring to the host once."""
    watcher = inspector.backward_watcher
    summary = {"nonfinite": float(inspector.trips),
               "skipped_steps": float(watcher.scaler_skipped_steps if watcher is not None else 0)}
    headroom = worst_headroom(inspector)
    if headroom is not None:
        summary["worst_headroom"] = headroom
    return summary


def worst_headroom(inspector):
    """See numerics_summary; None when numguard cannot read it (it never raises)."""
    try:
        return inspector.worst_headroom()
    except Exception:
        return None


def warn(message):
    warnings.warn(message, InspectorWarning, stacklevel=3)
