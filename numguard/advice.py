"""Precision advice from a module history (``Inspector.advice()``, ``python -m numguard advise DUMP``).

The history (numguard.inspector.history; the "history" field of a dump) holds, per module and
batch, the abs max and smallest non-zero magnitude of the forward tensors and of the activation
gradients. From it this module says, worst first:

* which modules will overflow float16 (their forward abs max against 65504, and how many batches
  that is away at the growth seen over the history);
* which modules' gradients fall below float16's smallest normal (6.1e-05) at the current loss
  scale (the share of elements, exact when the gradients are float16);
* the loss-scale range that keeps every non-zero gradient in float16's normal range;
* which modules to keep in float32 / bfloat16 under autocast;
* with watch(quant=FORMAT) (the history's "quant" table), which modules to keep in bf16 rather than
  FORMAT: above Transformer Engine's AutoswitchGemm thresholds (5% underflow or 1e-4 MSE);
* for a per-tensor float8 FORMAT, where delayed scaling would saturate: a batch whose abs max (of
  a module's outputs, or of its gradients) is above the largest of the DELAYED_HISTORY batches
  before it. Delayed scaling divides by that window's amax, so such a batch's largest values are
  clamped at the format's max; current scaling (the what-if's) never is.

Plain Python: a dump is advised on without torch.
"""
from __future__ import annotations

import dataclasses
import math

from .schema import DTYPES, QUANT_FORMATS

__all__ = ["Advice", "ModuleAdvice", "advise", "AdviceError"]

FP16_MAX = float(DTYPES["float16"].max)
FP16_TINY = float(DTYPES["float16"].tiny)      # smallest normal
OVERFLOW_SHARE = 0.125    # forward abs max above this share of fp16's max: keep the module wider
OVERFLOW_SOON = 100       # batches: an overflow projected this close is a risk now
UNDERFLOW_SHARE = 0.01    # share of float16 gradient elements that may be subnormal
_FP16_SPAN = math.log2(FP16_MAX / FP16_TINY)
_GROWTH_BATCHES = 8       # the growth rate is measured over the last batches of the history
# A GradScaler keeps its scale in float32: loss scales are powers of two within its normal range.
SCALE_EXP_MIN, SCALE_EXP_MAX = -126, 127
_NORMAL_MIN = 2.2250738585072014e-308   # float64's smallest normal
_LN2 = math.log(2.0)
_LN_FLOAT_MAX = 709.0
# Transformer Engine's AutoswitchGemm thresholds: a GEMM goes back to high precision above these.
QUANT_UNDERFLOW = 0.05    # fraction of non-zero elements that quantize to zero
QUANT_MSE = 1e-4          # mean squared error of the round trip
_QUANT_FRACTIONS = ("underflow", "saturated")
REAL_FORMATS = ("float8_e4m3fn", "float8_e5m2")   # the formats of a real cast's row (numguard.float8)
DELAYED_HISTORY = 16      # batches of amax history (torchao's delayed scaling default)


class AdviceError(ValueError):
    """A history numguard cannot advise on (e.g. a dump written without one)."""


@dataclasses.dataclass
class ModuleAdvice:
    """What the history says about one module (None: not seen)."""
    name: str
    cls: str
    index: int                        # forward order (named_modules order)
    dtype: str | None                 # dtype of its forward outputs
    grad_dtype: str | None            # dtype of its activation gradients
    abs_max: float | None             # largest forward output abs max over the history
    last_abs_max: float | None        # ... in the last batch it ran
    input_abs_max: float | None       # largest forward input abs max
    min_nonzero: float | None         # smallest non-zero forward magnitude
    fp16_fraction: float | None       # abs_max / float16's largest finite value
    growth: float | None              # abs max growth per batch (None: not growing)
    batches_to_overflow: float | None  # at that growth (0: over fp16's max already; None: never)
    grad_abs_max: float | None
    grad_min_nonzero: float | None
    underflow_share: float | None     # share of float16 gradient elements subnormal (float16 grads only)
    grad_underflows: bool             # its smallest non-zero gradient is below fp16's smallest normal
    keep: bool = False                # keep in float32 / bfloat16 under autocast
    reasons: list = dataclasses.field(default_factory=list)   # why to keep it wider
    notes: list = dataclasses.field(default_factory=list)     # what a loss scale fixes

    @property
    def carries(self) -> bool:
        """It passes on large values it received rather than making them (e.g. an activation
        after the layer that grows): ranked after the module that made them."""
        return (self.input_abs_max is not None and self.abs_max is not None
                and self.input_abs_max >= 0.5 * self.abs_max)


@dataclasses.dataclass
class Advice:
    """Precision advice, worst module first. ``str(advice)`` is the table."""
    modules: list                     # ModuleAdvice, worst first
    batches: list                     # batches the history covers, oldest first
    loss_scale: float
    loss_scale_source: str            # "GradScaler" or "assumed"
    scale_range: tuple | None         # (lowest, highest) power-of-two loss scale keeping gradients in range
    scale_note: str
    keep_wider: list                  # module names to keep in float32 / bfloat16 under autocast
    quant_format: str | None = None   # watch(quant=...)'s format, None when the history has no what-if
    quant_rows: list = dataclasses.field(default_factory=list)  # its table, worst first
    quant_batches: list = dataclasses.field(default_factory=list)  # the batches of the rows' "series"
    keep_bf16: list = dataclasses.field(default_factory=list)   # (module, reason): keep in bf16, not the format
    # DelayedOverflow rows, worst first: where delayed scaling of a per-tensor format would saturate
    delayed_overflow: list = dataclasses.field(default_factory=list)

    def __str__(self) -> str:
        return render(self)


def _is_value(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _values(series):
    return [v for v in series if _is_value(v)] if isinstance(series, list) else []


def _log2_ratio(a, b, scale=1.0):
    """log2(a / (b / scale)) for a, b, scale > 0, also where the quotients leave float64's range
    (a subnormal minimum, an abs max near float64's largest): then as a sum of logarithms."""
    q = b / scale
    if _NORMAL_MIN <= q < math.inf:
        r = a / q
        if _NORMAL_MIN <= r < math.inf:
            return math.log2(r)
    return math.log2(a) - math.log2(b) + math.log2(scale)


def _growth(batches, series):
    """(per-batch growth, its natural log) of the last values of `series`; (None, None) when it
    does not grow. The log is what projections use: the growth itself may pass float64's range."""
    points = [(b, v) for b, v in zip(batches, series if isinstance(series, list) else ())
              if _is_value(v) and v > 0 and _is_value(b)][-_GROWTH_BATCHES:]
    if len(points) < 2 or points[-1][0] == points[0][0]:
        return None, None
    (b0, v0), (b1, v1) = points[0], points[-1]
    log_rate = _log2_ratio(v1, v0) * _LN2 / (b1 - b0)
    if log_rate <= math.log(1.01):
        return None, None
    return (math.exp(log_rate) if log_rate < _LN_FLOAT_MAX else math.inf), log_rate


# The history's fields per module (numguard.inspector.history.FIELDS): one value per batch.
_SERIES = ("out_abs_max", "in_abs_max", "min_nonzero", "grad_abs_max", "grad_min_nonzero", "grad_subnormal_share")


def _bad(where, expected, value):
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    raise AdviceError(f"malformed history: {where}: expected {expected}, got {text}; pass the history "
                      "numguard wrote (Inspector.history(), or a dump's \"history\" field)")


def _is_number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check(history):
    """Raise AdviceError naming the first field of `history` that numguard could not have written."""
    if not isinstance(history, dict) or not isinstance(history.get("modules"), list) \
            or not isinstance(history.get("batches"), list):
        raise AdviceError("no module history: advice needs the history numguard keeps while watching "
                          "(Inspector.advice(), or a dump written by this version of numguard)")
    batches = history["batches"]
    for i, b in enumerate(batches):
        if not (isinstance(b, int) and not isinstance(b, bool) and b >= 0) or (i and b <= batches[i - 1]):
            _bad(f"batches[{i}]", "whole numbers >= 0 in increasing order", b)
    scale = history.get("loss_scale")
    if scale is not None and not (_is_number(scale) and math.isfinite(scale) and scale > 0):
        _bad("loss_scale", "a finite number > 0 or null", scale)
    if not isinstance(history.get("loss_scale_source"), (str, type(None))):
        _bad("loss_scale_source", "a string or null", history.get("loss_scale_source"))
    for index, m in enumerate(history["modules"]):
        where = f"modules[{index}]"
        if not isinstance(m, dict):
            _bad(where, "an object", m)
        for key in ("name", "class"):
            if not isinstance(m.get(key, ""), str):
                _bad(f"{where}.{key}", "a string", m[key])
        for key in ("dtype", "grad_dtype"):
            if not isinstance(m.get(key), (str, type(None))):
                _bad(f"{where}.{key}", "a dtype name or null", m[key])
        for key in _SERIES:
            series = m.get(key)
            if series is None:
                continue  # a field an older writer left out: no values
            if not isinstance(series, list) or len(series) != len(batches):
                _bad(f"{where}.{key}", f"a list of {len(batches)} values (one per batch)", series)
            top = 1.0 if key == "grad_subnormal_share" else math.inf
            for i, v in enumerate(series):
                if v is not None and not (_is_number(v) and 0 <= v <= top and math.isfinite(v)):
                    _bad(f"{where}.{key}[{i}]", "a finite number >= 0" + (" and <= 1" if top == 1.0 else "")
                         + " or null", v)


def _check_quant(quant):
    """The "quant" table of a history: a known format, fractions in [0, 1], MSE a finite number
    >= 0 (None for a real float8 cast's row, which names its own float8 format)."""
    if quant is None:
        return
    if not isinstance(quant, dict) or not isinstance(quant.get("format"), str) \
            or not isinstance(quant.get("rows"), list):
        _bad("quant", 'an object with a "format" string and a "rows" list', quant)
    if quant["format"] not in QUANT_FORMATS:
        _bad("quant.format", "one of " + ", ".join(QUANT_FORMATS), quant["format"])
    for i, row in enumerate(quant["rows"]):
        where = f"quant.rows[{i}]"
        if not isinstance(row, dict) or not isinstance(row.get("module"), str) \
                or not isinstance(row.get("quantity"), str):
            _bad(where, "an object with module and quantity strings", row)
        real = row.get("format")
        if real is not None and real not in REAL_FORMATS:
            _bad(f"{where}.format", "one of " + ", ".join(REAL_FORMATS) + " (a real float8 cast) or absent", real)
        for key in _QUANT_FRACTIONS:
            value = row.get(key)
            if not (_is_number(value) and 0 <= value <= 1):  # also refuses NaN
                _bad(f"{where}.{key}", "a fraction from 0 to 1", value)
        mse = row.get("mse")
        if not (_is_number(mse) and 0 <= mse < math.inf) and not (real is not None and mse is None):
            _bad(f"{where}.mse", "a finite number >= 0" + (" or null" if real is not None else ""), mse)
        series = row.get("series")
        if series is None:
            continue  # an older writer's row: totals only
        batches = quant.get("batches")
        if not isinstance(series, list) or not isinstance(batches, list) or len(series) != len(batches):
            _bad(f"{where}.series", f"a list of {len(batches) if isinstance(batches, list) else 'quant.batches'} "
                                    "fractions (one per batch of quant.batches)", series)
        for j, v in enumerate(series):
            if v is not None and not (_is_number(v) and 0 <= v <= 1):
                _bad(f"{where}.series[{j}]", "a fraction from 0 to 1 or null", v)


@dataclasses.dataclass
class DelayedOverflow:
    """A module whose abs max rose above its last DELAYED_HISTORY batches' in some batches: delayed
    scaling (scale = format max / that window's amax) would have clamped them there."""
    module: str
    quantity: str        # "output" or "gradient"
    batches: list        # the batches above their window
    tested: int          # batches with a full window before them in the history
    worst: float         # largest abs max / window amax among them


def _delayed_overflow(history, quant_format) -> list:
    """DelayedOverflow rows of a history, worst first ([] for block-scaled formats or none)."""
    spec = QUANT_FORMATS.get(quant_format)
    if spec is None or spec.block:
        return []
    batches = history["batches"]
    out = []
    for m in (m for m in history["modules"] if isinstance(m, dict)):
        for key, quantity in (("out_abs_max", "output"), ("grad_abs_max", "gradient")):
            series = m.get(key) if isinstance(m.get(key), list) else []
            points = [(b, v) for b, v in zip(batches, series) if _is_value(v) and v > 0]
            over, worst = [], 1.0
            for i in range(DELAYED_HISTORY, len(points)):
                window = max(v for _, v in points[i - DELAYED_HISTORY:i])
                if points[i][1] > window:
                    over.append(points[i][0])
                    worst = max(worst, points[i][1] / window)
            if over:
                out.append(DelayedOverflow(str(m.get("name") or ""), quantity, over,
                                           max(0, len(points) - DELAYED_HISTORY), worst))
    return sorted(out, key=lambda r: -r.worst)


def _worst_first(row):
    """Sort key of the what-if rows: most underflow, then largest MSE (a real cast's is unknown)."""
    return -row["underflow"], -(row["mse"] or 0.0)


def _keep_bf16(rows):
    """(module, reason) for each module a row puts above the AutoswitchGemm thresholds, worst first."""
    keep = {}
    for row in rows:
        if row.get("format") is not None:
            continue  # a real cast: its zeros are not all underflow (NOTE: [real float8 casts])
        why = []
        if row["underflow"] > QUANT_UNDERFLOW:
            why.append(f"{row['quantity']} {row['underflow']:.1%} underflow")
        if row["mse"] > QUANT_MSE:
            why.append(f"{row['quantity']} MSE {row['mse']:.2e}")
        if why:
            keep.setdefault(row["module"], []).extend(why)
    return [(name, "; ".join(why)) for name, why in keep.items()]


def advise(history: dict, loss_scale=None, loss_scale_source=None) -> Advice:
    """Advice from a history dictionary (see numguard.inspector.history). `loss_scale`: the loss
    scale the recorded gradients were computed with (default: the history's, else 1, assumed)."""
    _check(history)
    quant = history.get("quant")
    _check_quant(quant)
    if loss_scale is None:
        loss_scale = history.get("loss_scale")
        loss_scale_source = history.get("loss_scale_source")
    elif not (_is_number(loss_scale) and math.isfinite(loss_scale) and loss_scale > 0):
        raise AdviceError(f"advise(loss_scale={loss_scale!r}): expected a finite number > 0 (or None: the "
                          "history's)")
    if loss_scale is None:
        loss_scale, loss_scale_source = 1.0, "assumed"
    loss_scale_source = loss_scale_source or "assumed"
    batches = history["batches"]
    rows = []
    for index, m in enumerate(m for m in history["modules"] if isinstance(m, dict)):
        out = _values(m.get("out_abs_max"))
        ins = _values(m.get("in_abs_max"))
        mins = [v for v in _values(m.get("min_nonzero")) if v > 0]
        gmax = _values(m.get("grad_abs_max"))
        gmin = [v for v in _values(m.get("grad_min_nonzero")) if v > 0]
        share = _values(m.get("grad_subnormal_share"))
        last = next((v for v in reversed(_values(m.get("out_abs_max")))), None)
        abs_max = max(out) if out else None
        fraction = abs_max / FP16_MAX if abs_max is not None else None
        growth, log_growth = _growth(batches, m.get("out_abs_max"))
        if fraction is None:
            to_overflow = None
        elif abs_max > FP16_MAX:
            to_overflow = 0.0
        elif growth is not None and last:
            to_overflow = max(0.0, _log2_ratio(FP16_MAX, last) * _LN2 / log_growth)
        else:
            to_overflow = None
        grad_dtype = m.get("grad_dtype") if isinstance(m.get("grad_dtype"), str) else None
        grad_min = min(gmin) if gmin else None
        rows.append(ModuleAdvice(
            name=str(m.get("name") or ""), cls=str(m.get("class") or ""), index=index,
            dtype=m.get("dtype") if isinstance(m.get("dtype"), str) else None,
            grad_dtype=grad_dtype, abs_max=abs_max, last_abs_max=last, input_abs_max=max(ins) if ins else None,
            min_nonzero=min(mins) if mins else None,
            fp16_fraction=fraction, growth=growth, batches_to_overflow=to_overflow,
            grad_abs_max=max(gmax) if gmax else None, grad_min_nonzero=grad_min,
            underflow_share=(max(share) if share else None) if grad_dtype == "torch.float16" else None,
            grad_underflows=grad_min is not None and grad_min < FP16_TINY))
    scale_range, highest, note = _scale_range(rows, loss_scale)
    for r in rows:
        if r.batches_to_overflow is not None and r.batches_to_overflow <= OVERFLOW_SOON:
            n = max(1, math.ceil(r.batches_to_overflow))
            r.reasons.append("overflows fp16" if r.batches_to_overflow == 0 else
                             f"overflows fp16 in ~{n} batch{'es' if n > 1 else ''}")
        elif r.fp16_fraction is not None and r.fp16_fraction >= OVERFLOW_SHARE:
            r.reasons.append(f"abs max at {r.fp16_fraction:.0%} of fp16's max")
        if r.grad_min_nonzero is not None and r.grad_abs_max \
                and _log2_ratio(r.grad_abs_max, r.grad_min_nonzero) > _FP16_SPAN:
            r.reasons.append("gradients span more than fp16's range")
        elif r.grad_min_nonzero is not None and scale_range is None and highest is not None \
                and _log2_ratio(r.grad_min_nonzero, loss_scale, 1.0 / highest) < math.log2(FP16_TINY):
            r.reasons.append(f"gradients underflow even at loss scale {_pow2(highest)}")
        if r.underflow_share is not None and r.underflow_share >= UNDERFLOW_SHARE:
            r.notes.append(f"{r.underflow_share:.0%} of gradients subnormal at loss scale {loss_scale:g}")
        elif r.grad_underflows:
            r.notes.append(f"gradients below fp16's smallest normal at loss scale {loss_scale:g}")
        r.keep = bool(r.reasons)
    rows.sort(key=_risk)
    return Advice(modules=rows, batches=list(batches), loss_scale=float(loss_scale),
                  loss_scale_source=loss_scale_source, scale_range=scale_range, scale_note=note,
                  keep_wider=[r.name for r in rows if r.keep],
                  quant_format=quant["format"] if quant else None,
                  quant_rows=sorted(quant["rows"], key=_worst_first) if quant else [],
                  quant_batches=list(quant.get("batches") or []) if quant else [],
                  keep_bf16=_keep_bf16(quant["rows"]) if quant else [],
                  delayed_overflow=_delayed_overflow(history, quant["format"]) if quant else [])


def _risk(r):
    """Sort key, worst first: soonest overflow (whole batches), modules that make large values
    before those that pass them on, largest share of fp16's max, most underflow, forward order."""
    soon = math.ceil(r.batches_to_overflow) if r.batches_to_overflow is not None else math.inf
    fraction = r.fp16_fraction or 0.0
    return (not r.keep, soon, soon != math.inf and r.carries, -(r.underflow_share or 0.0), -fraction, r.index)


def _scale_range(rows, scale):
    """(lowest, highest) power-of-two loss scale that keeps every non-zero activation gradient in
    float16's normal range (None when none does), the highest scale that does not overflow, and a
    sentence about it. Float16 gradients cannot show values below its smallest subnormal: with
    subnormal ones, the lowest scale is a lower bound. Scales are powers of two a GradScaler can
    hold (float32: 2^-126 .. 2^127); computed in logarithms, so any float64 history works."""
    gmax = [r.grad_abs_max for r in rows if r.grad_abs_max]
    gmin = [r.grad_min_nonzero for r in rows if r.grad_min_nonzero]
    if not gmax and not gmin:
        return None, None, "no gradients in the history (watch with backward=True to get loss-scale advice)"
    if not gmax or not gmin:
        return None, None, ("the history holds gradient " + ("minimums but no maximums" if gmin else
                                                             "maximums but no non-zero minimums")
                            + ": no loss-scale advice")
    top, bottom = max(gmax), min(gmin)
    lo_e = math.ceil(_log2_ratio(FP16_TINY, bottom, scale))
    safe = _log2_ratio(FP16_MAX, top, scale)   # log2 of the largest scale that does not overflow
    hi_e = min(SCALE_EXP_MAX, max(SCALE_EXP_MIN, math.floor(safe)))
    hi = 2.0 ** hi_e
    span = _log2_ratio(top, bottom) / math.log2(10.0)
    if max(lo_e, SCALE_EXP_MIN) <= hi_e <= safe:
        lo = 2.0 ** max(lo_e, SCALE_EXP_MIN)
        return (lo, hi), hi, (f"loss scales {_pow2(lo)} .. {_pow2(hi)} keep every non-zero gradient in "
                              f"fp16's normal range (gradients span {span:.1f} decades)")
    return None, hi, (
        f"no loss scale keeps every non-zero gradient in fp16's normal range: they span {span:.1f} decades, "
        f"fp16's normal range 9.0; the largest safe scale is {_pow2(hi)}, and the modules whose gradients "
        "underflow there are best kept in float32 / bfloat16")


def _pow2(x):
    e = math.log2(x)
    return f"2^{int(e)}" if e == int(e) else f"{x:.3g}"


def _num(v, spec=".2e"):
    return "-" if v is None else format(v, spec)


def render(advice: Advice, limit: int = 20) -> str:
    """The advice as a table, worst first (`limit` rows)."""
    b = advice.batches
    span = f"batches {b[0]}..{b[-1]}" if len(b) > 1 else (f"batch {b[0]}" if b else "no batches")
    scale = (f"loss scale {advice.loss_scale:g} (from GradScaler)" if advice.loss_scale_source == "GradScaler"
             else f"loss scale {advice.loss_scale:g} assumed (no GradScaler seen)")
    lines = [f"numguard precision advice (float16), {len(b)} batches of history ({span}), {scale}:"]
    header = (f"{'module':40} {'class':18} {'dtype':9} {'abs max':>8} {'% fp16':>8} {'growth':>7} "
              f"{'overflow':>9} {'grad max':>8} {'grad min':>8} {'subnorm':>7}  advice")
    lines.append(header)
    for r in advice.modules[:limit]:
        if r.batches_to_overflow is None:
            when = "-"
        elif r.batches_to_overflow == 0:
            when = "now"
        else:
            when = f"~{max(1, math.ceil(r.batches_to_overflow))} b"
        growth = f"x{r.growth:.2f}" if r.growth is not None else "-"
        share = f"{r.underflow_share:.1%}" if r.underflow_share is not None else "-"
        dtype = (r.dtype or r.grad_dtype or "-").replace("torch.", "")
        advice_text = ("keep fp32/bf16: " + "; ".join(r.reasons)) if r.keep else (
            "; ".join(r.notes) if r.notes else "ok in fp16")
        lines.append(f"{(r.name or '(root)')[:40]:40} {r.cls[:18]:18} {dtype[:9]:9} {_num(r.abs_max):>8} "
                     f"{_num(r.fp16_fraction, '.1%'):>8} {growth:>7} {when:>9} {_num(r.grad_abs_max):>8} "
                     f"{_num(r.grad_min_nonzero):>8} {share:>7}  {advice_text}")
    if len(advice.modules) > limit:
        lines.append(f"... {len(advice.modules) - limit} more modules (all ok in fp16)" if not any(
            r.keep for r in advice.modules[limit:]) else f"... {len(advice.modules) - limit} more modules")
    lines.append("numguard: " + advice.scale_note + (
        "" if advice.loss_scale_source == "GradScaler" or advice.scale_range is None and not any(
            r.grad_abs_max for r in advice.modules) else
        " (gradients taken as computed at loss scale 1: no GradScaler seen)"))
    under = sorted((r for r in advice.modules if r.notes), key=lambda r: -(r.underflow_share or 0.0))
    if under:
        worst = under[0]
        share = f" {worst.underflow_share:.0%} subnormal" if worst.underflow_share is not None else ""
        fix = (f"; loss scales {_pow2(advice.scale_range[0])} .. {_pow2(advice.scale_range[1])} keep them normal"
               if advice.scale_range else "")
        lines.append(f"numguard: at loss scale {advice.loss_scale:g}, {len(under)} modules' gradients fall below "
                     f"fp16's smallest normal (worst: {worst.name or '(root)'}{share}){fix}")
    if advice.keep_wider:
        lines.append("numguard: under autocast, keep in float32 / bfloat16: " + ", ".join(
            n or "(root)" for n in advice.keep_wider))
    else:
        lines.append("numguard: every watched module stays in float16's range over this history")
    if advice.quant_format is not None:
        lines.extend(render_quant(advice))
    return "\n".join(lines)


def render_quant(advice: Advice, limit: int = 20) -> list:
    """The what-if lines of watch(quant=...): its table, worst first, and the modules to keep in bf16."""
    fmt = advice.quant_format
    lines = [f"numguard what-if: the watched tensors as {fmt} with current scaling:",
             f"{'module':40} {'quantity':16} {'underflow':>9} {'saturated':>9} {'mse':>9} {'batches':>7}"]
    for r in advice.quant_rows[:limit]:
        mse = "-" if r["mse"] is None else f"{r['mse']:.2e}"
        lines.append(f"{(r['module'] or '(root)')[:40]:40} {r['quantity'][:16]:16} {r['underflow']:>9.2%} "
                     f"{r['saturated']:>9.2%} {mse:>9} {r.get('batches', '-'):>7}"
                     + (f"  real {r['format']}" if r.get("format") else ""))
    if any(r.get("format") for r in advice.quant_rows[:limit]):
        lines.append("numguard: a real float8 row counts the data's zeros as underflow and its values at the format's "
                     "max as saturated (upper bounds: a float8 tensor cannot tell a zero it was given from one the "
                     "cast made); its MSE is unknown")
    thresholds = (f"Transformer Engine's AutoswitchGemm thresholds ({QUANT_UNDERFLOW:.0%} underflow or "
                  f"{QUANT_MSE:.0e} MSE)".replace("e-0", "e-"))
    if advice.keep_bf16:
        lines.append(f"numguard: above {thresholds}, keep in bf16 rather than {fmt}: " + ", ".join(
            f"{name or '(root)'} ({why})" for name, why in advice.keep_bf16))
    else:
        lines.append(f"numguard: every watched module stays within {thresholds} as {fmt}")
    spec = QUANT_FORMATS.get(fmt)
    if spec is not None and not spec.block:
        lines.extend(_render_delayed(advice.delayed_overflow, fmt, limit, len(advice.batches)))
    return lines


def _render_delayed(rows, fmt, limit, batches):
    head = f"numguard: with delayed scaling ({DELAYED_HISTORY} batches of amax history) as {fmt},"
    if batches <= DELAYED_HISTORY:
        return [f"{head} not judged: the history holds {batches} batches, a window and one more are needed"]
    if not rows:
        return [f"{head} no watched abs max rose above its window's: no batch would saturate"]
    lines = [f"{head} these batches' abs max rose above the window's amax, so their largest values "
             "would be clamped at the format's max (current scaling, as measured above, is not):"]
    for r in rows[:limit]:
        shown = ", ".join(map(str, r.batches[:8])) + (", ..." if len(r.batches) > 8 else "")
        lines.append(f"  {(r.module or '(root)')[:40]:40} {r.quantity:8} {len(r.batches)} of {r.tested} batches "
                     f"(up to {r.worst:.2f}x the window's amax): {shown}")
    return lines
