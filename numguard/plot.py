"""Plot a numguard dump: abs max and min-nonzero per frame on a log axis, with each float dtype's
largest finite value and smallest normal value drawn as horizontal lines.

matplotlib is an optional dependency (``pip install matplotlib``); it is imported only here, and
drawn with the Agg backend (no display needed, pyplot's global state untouched).
"""
import math

__all__ = ["PlotUnavailableError", "frame_series", "plot_dump", "plot_advice", "plot_quant"]

# finfo.max and finfo.tiny (smallest normal) per dtype name, so that a dump plots without torch.
_DTYPE_LIMITS = {
    "float64": (1.7976931348623157e308, 2.2250738585072014e-308),
    "float32": (3.4028234663852886e38, 1.1754943508222875e-38),
    "float16": (65504.0, 6.103515625e-05),
    "bfloat16": (3.3895313892515355e38, 1.1754943508222875e-38),
    "float8_e4m3fn": (448.0, 0.015625),
    "float8_e5m2": (57344.0, 6.103515625e-05),
}
_DTYPE_ALIASES = {"half": "float16", "float": "float32", "double": "float64"}
# Field positions in a stats record (numguard.STAT_FIELDS).
_ABS_MAX, _MIN_NONZERO, _NAN, _POS_INF, _NEG_INF = 1, 2, 3, 4, 5


class PlotUnavailableError(RuntimeError):
    """matplotlib is not installed."""


def _dtype_name(dtype):
    name = str(dtype or "")
    name = name.rsplit(".", 1)[-1]
    return _DTYPE_ALIASES.get(name, name)


def dtype_limits(dtype):
    """``(finfo.max, finfo.tiny)`` of a float dtype named as in a dump, or None for other dtypes."""
    return _DTYPE_LIMITS.get(_dtype_name(dtype))


def frame_series(dump):
    """Per frame of a loaded dump: ``(label, abs_max, min_nonzero, non_finite, dtypes)``.

    abs_max is the largest finite magnitude over the frame's tensors (None when it has none),
    min_nonzero the smallest finite non-zero magnitude (None when there is none), non_finite
    whether any of its tensors holds NaN or Inf, dtypes the float dtype names it holds.
    """
    series = []
    frames = dump.get("frames", [])
    if any("in_report" in frame for frame in frames):  # the frames the text report shows
        frames = [frame for frame in frames if frame.get("in_report", True)]
    for frame in frames:
        records = frame.get("records") or []
        dtypes = frame.get("dtypes") or [None] * len(records)
        abs_max, min_nonzero, non_finite, names = None, None, False, []
        for record, dtype in zip(records, dtypes):
            if not record or len(record) < 6:
                continue
            if record[_NAN] > 0 or record[_POS_INF] > 0 or record[_NEG_INF] > 0:
                non_finite = True
            if dtype_limits(dtype) is not None and _dtype_name(dtype) not in names:
                names.append(_dtype_name(dtype))
            high, low = record[_ABS_MAX], record[_MIN_NONZERO]
            if high is not None and math.isfinite(high) and high > 0:
                abs_max = high if abs_max is None else max(abs_max, high)
            if low is not None and math.isfinite(low) and low > 0:
                min_nonzero = low if min_nonzero is None else min(min_nonzero, low)
        label = f"{frame.get('name') or '(root)'} {frame.get('class') or ''}".strip()
        section = frame.get("section")
        if section and section != "forward":
            label = f"{label} ({section})"
        series.append((label, abs_max, min_nonzero, non_finite, names))
    return series


def _figure(width, height=5.0):
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise PlotUnavailableError(
            f"plotting needs matplotlib, which is not installed ({exc}): pip install matplotlib"
        ) from None
    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    return fig


def plot_advice(advice, out_path, limit=40):
    """Draw numguard.advice.Advice to ``out_path`` (PNG): per module (worst first, `limit` of
    them), the range from its smallest non-zero magnitude to its abs max, forward values and
    activation gradients side by side, against float16's largest finite value, smallest normal
    and smallest subnormal. Returns ``out_path``."""
    rows = [r for r in advice.modules if r.abs_max is not None or r.grad_abs_max is not None][:limit]
    if not rows:
        raise ValueError("the history holds no module values to plot")
    fig = _figure(max(6.0, min(24.0, 0.35 * len(rows) + 3.0)))
    ax = fig.add_subplot(1, 1, 1)
    ax.set_yscale("log")
    for x, r in enumerate(rows):
        if r.abs_max is not None:
            ax.vlines(x - 0.12, r.min_nonzero or r.abs_max, r.abs_max, color="tab:blue", lw=5,
                      label="forward: min nonzero .. abs max" if x == 0 else None)
        if r.grad_abs_max is not None:
            ax.vlines(x + 0.12, r.grad_min_nonzero or r.grad_abs_max, r.grad_abs_max, color="tab:orange", lw=5,
                      label="gradient: min nonzero .. abs max" if x == 0 else None)
        if r.keep:
            ax.axvspan(x - 0.45, x + 0.45, color="tab:red", alpha=0.08)
    largest, smallest_normal = _DTYPE_LIMITS["float16"]
    ax.axhline(largest, color="black", ls="--", lw=1, label=f"float16 max {largest:.3g}")
    ax.axhline(smallest_normal, color="gray", ls="--", lw=1, label=f"float16 smallest normal {smallest_normal:.3g}")
    ax.axhline(2.0 ** -24, color="gray", ls=":", lw=1, label=f"float16 smallest subnormal {2.0 ** -24:.3g}")
    ax.set_xticks(list(range(len(rows))))
    ax.set_xticklabels([f"{r.name or '(root)'} {r.cls}" for r in rows], rotation=75, ha="right", fontsize=7)
    ax.set_ylabel("magnitude")
    ax.set_title(f"numguard advice: range per module, worst first (red: keep fp32/bf16)\n"
                 f"gradients at loss scale {advice.loss_scale:g}", fontsize=9)
    ax.grid(True, which="major", axis="y", alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(out_path, format="png", dpi=100)
    return out_path


def plot_quant(advice, out_path, limit=40):
    """Draw watch(quant=...)'s per-batch underflow (numguard.advice.Advice's quant rows with their
    series) to ``out_path`` (PNG): a heatmap, one row per module and quantity (worst first, `limit`
    of them), one column per batch, the colour the % of non-zero elements that underflow to zero,
    grey where that batch measured nothing; Transformer Engine's 5% AutoswitchGemm threshold is
    marked on the colour bar. Returns ``out_path``."""
    rows = [r for r in advice.quant_rows if r.get("series")][:limit]
    batches = advice.quant_batches
    if not rows or not batches:
        raise ValueError("the history holds no per-batch quant= values to plot (watch(..., quant=FORMAT) "
                         "writes them; older dumps have only the totals)")
    import numpy as np
    from matplotlib import colormaps

    values = np.ma.masked_invalid(np.array([[np.nan if v is None else 100.0 * v for v in r["series"]]
                                            for r in rows], dtype=float))
    fig = _figure(max(6.0, min(20.0, 0.18 * len(batches) + 5.0)), max(3.0, min(16.0, 0.3 * len(rows) + 1.8)))
    ax = fig.add_subplot(1, 1, 1)
    cmap = colormaps["magma_r"].with_extremes(bad="#d9d9d9")
    top = max(5.0, float(values.max()) if values.count() else 5.0)
    image = ax.imshow(values, aspect="auto", cmap=cmap, vmin=0.0, vmax=top, interpolation="nearest")
    bar = fig.colorbar(image, ax=ax, fraction=0.04, pad=0.02)
    bar.set_label("underflow, % of non-zero elements", fontsize=8)
    from .advice import QUANT_UNDERFLOW
    bar.ax.axhline(100.0 * QUANT_UNDERFLOW, color="tab:cyan", lw=2)
    bar.ax.text(1.6, 100.0 * QUANT_UNDERFLOW, f" {QUANT_UNDERFLOW:.0%}\n AutoswitchGemm", fontsize=6,
                va="center", transform=bar.ax.get_yaxis_transform())
    ax.set_yticks(list(range(len(rows))))
    ax.set_yticklabels([f"{r['module'] or '(root)'} {r['quantity']}" + (f" ({r['format']})" if r.get("format") else "")
                        for r in rows], fontsize=7)
    step = max(1, len(batches) // 16)
    ax.set_xticks(list(range(0, len(batches), step)))
    ax.set_xticklabels([str(b) for b in batches[::step]], fontsize=7)
    ax.set_xlabel("batch")
    ax.set_title(f"numguard what-if: underflow as {advice.quant_format} (current scaling), per module and batch",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(out_path, format="png", dpi=100)
    return out_path


def plot_dump(dump, out_path, title=None):
    """Draw a loaded dump (``numguard.dump.load``) to ``out_path`` (PNG). Returns ``out_path``.

    A dictionary that does not follow the dump schema raises numguard.dump.DumpError (a
    ValueError) naming the bad place, before anything is drawn."""
    from .dump import validate

    validate(dump)
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise PlotUnavailableError(
            f"plotting needs matplotlib, which is not installed ({exc}): pip install matplotlib"
        ) from None
    series = frame_series(dump)
    if not series:
        raise ValueError("the dump holds no frames to plot")
    xs = list(range(len(series)))
    fig = Figure(figsize=(max(6.0, min(24.0, 0.35 * len(series) + 3.0)), 5.0))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ax.set_yscale("log")
    highs = [(x, s[1]) for x, s in zip(xs, series) if s[1] is not None]
    lows = [(x, s[2]) for x, s in zip(xs, series) if s[2] is not None]
    if highs:
        ax.plot([p[0] for p in highs], [p[1] for p in highs], "o-", color="tab:blue", label="abs max")
    if lows:
        ax.plot([p[0] for p in lows], [p[1] for p in lows], "s-", color="tab:green",
                label="min nonzero")
    bad = [x for x, s in zip(xs, series) if s[3]]
    for number, x in enumerate(bad):
        ax.axvline(x, color="tab:red", alpha=0.35, lw=3, label="NaN/Inf" if number == 0 else None)
    seen = []
    for s in series:
        seen.extend(name for name in s[4] if name not in seen)
    styles = ["--", ":", "-.", (0, (5, 1))]
    for number, name in enumerate(seen):
        largest, smallest_normal = _DTYPE_LIMITS[name]
        style = styles[number % len(styles)]
        ax.axhline(largest, color="black", ls=style, lw=1, label=f"{name} max {largest:.3g}")
        ax.axhline(smallest_normal, color="gray", ls=style, lw=1,
                   label=f"{name} smallest normal {smallest_normal:.3g}")
    ax.set_xticks(xs)
    ax.set_xticklabels([s[0] for s in series], rotation=75, ha="right", fontsize=7)
    ax.set_xlabel("frame")
    ax.set_ylabel("magnitude")
    if title is None:
        batch = dump.get("batch_number", dump.get("batch"))
        rank = dump.get("rank")
        title = "numguard dump" + (f", batch {batch}" if batch is not None else "") + (
            f", rank {rank}" if rank is not None else "")
    ax.set_title(title)
    ax.grid(True, which="major", axis="y", alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(out_path, format="png", dpi=100)
    return out_path
