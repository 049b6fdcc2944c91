"""What the framework integrations share: an Inspector whose reports name the framework's own
step, unwrapping the wrappers frameworks put around a model, the per-step numerics summary, and
taking over from detectors that would watch the same model twice."""
from __future__ import annotations

import warnings

import torch

from .. import env, schema
from ..errors import InspectorWarning
from ..inspector import core

# Integrations check parameter gradients before every optimizer step unless told otherwise
# (a backward= argument or NUMGUARD_BACKWARD).
DEFAULTS = dict(env.WATCH_DEFAULTS, backward=True)

_LOW_PRECISION_MAX = {getattr(torch, name): float(info.max) for name, info in schema.DTYPES.items()
                      if info.low_precision and hasattr(torch, name)}


def resolve_options(options: dict) -> dict:
    """watch() options for an integration: arguments, then NUMGUARD_* variables, then DEFAULTS.
    Raises numguard.env.OptionError (or EnvironmentSettingError) naming the first bad one."""
    return env.resolve_watch_options(dict(options), defaults=DEFAULTS)


class StepInspector(core.Inspector):
    """An Inspector whose trip message and report also give the framework's step counter.

    Args:
        model: the module the framework runs (unwrapped).
        step: a callable returning the framework's step now (e.g. Trainer.state.global_step),
            or None.
        step_label: how the step is named in messages, e.g. "Trainer global_step".
        options: resolved watch() options.
    """

    def __init__(self, model, step=None, step_label="global_step", **options):
        self._step = step
        self.step_label = step_label
        super().__init__(model, **options)

    def framework_step(self):
        """The framework's step counter now, or None when it cannot be read."""
        if self._step is None:
            return None
        try:
            value = self._step()
            return int(value) if value is not None else None
        except Exception:  # a counter numguard cannot read must not hide the trip
            return None

    def _trip_reported(self, report, frames_after):
        step = self.framework_step()
        reporter = getattr(self, "_reporter", None)
        if reporter is None or not hasattr(reporter, "trip_message"):
            return
        if step is None:
            reporter.trip_message = None
            return
        report["framework_step"] = {"name": self.step_label, "value": step}
        rank = report.get("rank")
        on_rank = f" on rank {rank}" if rank is not None else ""
        module = report.get("module") or "(root module)"
        reporter.trip_message = (
            f"numguard: inf/nan detected{on_rank} during batch_number={report['batch']} "
            f"({self.step_label}={step}) in {module} ({report.get('class', '')}) "
            f"[{', '.join(report.get('labels') or [])}]; the report above shows the frames that led to it")


def watch(model, options: dict, step=None, step_label="global_step") -> StepInspector:
    """A StepInspector on `model` with the integration's option resolution."""
    return StepInspector(model, step=step, step_label=step_label, **resolve_options(options))


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
        from .. import _startup
        watcher = _startup.auto_watcher()
    except Exception:
        return 0
    if watcher is None:
        return 0
    inside = {id(m) for m in model.modules()}
    closed = 0
    kept = []
    for ref, inspector in list(watcher.inspectors):
        root = ref()
        if root is not None and id(root) in inside:
            try:
                inspector.close()
            finally:
                closed += 1
        else:
            kept.append((ref, inspector))
    watcher.inspectors[:] = kept
    watcher.covered.update(model.modules())  # the start-up watcher leaves these modules to us
    return closed


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
        ring = inspector._ring
        frames = list(ring.frames)
        wanted = []
        for f in frames:
            for dtype, position in zip(f.dtypes, f.positions):
                dmax = _LOW_PRECISION_MAX.get(dtype)
                if dmax is not None and position >= ring.pos - ring.size:
                    wanted.append((position % ring.size, dmax))
        if not wanted:
            return 0.0
        host = ring.host_copy()
        worst = 0.0
        for row, dmax in wanted:
            record = host[row]
            if record[schema.NAN] + record[schema.POS_INF] + record[schema.NEG_INF] > 0:
                return float("inf")
            worst = max(worst, float(record[schema.ABS_MAX]) / dmax)
        return worst
    except Exception:
        return None


def warn(message):
    warnings.warn(message, InspectorWarning, stacklevel=3)
