"""Text rendering of numguard's reports.

The renderer reads frames (metadata + stats records) and nothing else: it knows nothing of hooks,
rings or devices. Its input is the report dictionary described in `numguard.dump` (the same
dictionary the JSON dump files hold), so a report printed at a trip and one rendered later from a
dump file are the same text.

Lines are those Transformers' ``DebugUnderflowOverflow`` prints:

    Detected inf/nan during batch_number=0
    Last 21 forward frames:
    abs min  abs max  metadata
                      encoder.block.2.layer.1.layer_norm T5LayerNorm
    8.69e-02 4.18e-01 weight
    2.65e-04 3.42e+03 input[0]
    1.79e-06 4.65e+00 output

What numguard adds goes on lines of its own: keyword inputs (``kwargs.name``), the contents of
dict / ModelOutput / dataclass / list outputs and deeper nesting, ``detect_overflow`` lines, backward
frames (a section per frame kind), where the trip was found, and a headroom section.
"""
from __future__ import annotations

import math

PREFIX = " " * 17
TABLE_HEADER = f"{'abs min':8} {'abs max':8} metadata"

# Record positions, line kinds and dtype limits: numguard.schema (the one copy).
from .schema import ABS_MAX, ABS_MIN, KIND_NONE, KIND_NOT_A_TENSOR, KIND_TENSOR, MIN_NONZERO, NAN, NEG_INF  # noqa: E402,F401
from .schema import DTYPES as _DTYPES, POS_INF, SUBNORMAL, ZERO  # noqa: E402,F401

# Largest finite value of the dtypes whose headroom numguard reports, keyed as dumps spell dtypes.
DTYPE_MAX = {f"torch.{name}": float(info.max) for name, info in _DTYPES.items() if info.low_precision}


def shown_abs_min_max(record) -> tuple[float, float]:
    """The abs min and abs max that ``x.abs().min()`` / ``x.abs().max()`` would give for the
    tensor the record describes (NaN wins; an Inf makes the max inf)."""
    if record[NAN] > 0:
        return math.nan, math.nan
    abs_max = math.inf if record[POS_INF] + record[NEG_INF] > 0 else float(record[ABS_MAX])
    return float(record[ABS_MIN]), abs_max


def stats_line(record, label: str) -> str:
    """``f"{abs_min:8.2e} {abs_max:8.2e} {label}"`` for a record."""
    abs_min, abs_max = shown_abs_min_max(record)
    return f"{abs_min:8.2e} {abs_max:8.2e} {label}"


def is_nonfinite(record) -> bool:
    return record is not None and (record[NAN] + record[POS_INF] + record[NEG_INF]) > 0


def value_line(kind: str, record, label: str) -> str:
    if kind == KIND_TENSOR:
        if record is None:
            return f"{'(not recorded)':>17} {label}"
        return stats_line(record, label)
    if kind == KIND_NONE:
        return f"{'None':>17} {label}"
    return f"{'not a tensor':>17} {label}"


def batch_start_lines(batch: int) -> list[str]:
    """The lines Transformers puts before the first frame of a batch."""
    return [f"\n\n{PREFIX} *** Starting batch number={batch} ***", TABLE_HEADER]


def frame_text(frame: dict, extras: bool = True) -> str:
    """One frame: (batch start lines,) the header, then one line per label."""
    lines = []
    if frame.get("batch_start") is not None:
        lines.extend(batch_start_lines(frame["batch_start"]))
    header = f"{PREFIX} {frame['name']} {frame['class']}"
    if frame.get("op"):  # an operation frame (watch(ops=True)): the op and its call site
        header += f" {frame['op']}" + op_where(frame)
    lines.append(header)
    extra_flags = frame.get("extra") or [False] * len(frame["labels"])
    for label, kind, record, extra in zip(frame["labels"], frame["kinds"], frame["records"], extra_flags):
        if extra and not extras:
            continue
        lines.append(value_line(kind, record, label))
    return "\n".join(lines)


def op_where(op: dict) -> str:
    """' at file.py:12' for a forward operation; for a backward one, the autograd node that ran it
    and the call site of the forward operation that made that node."""
    site = op.get("site")
    backward_of = op.get("backward_of")
    if backward_of:
        return f" in the backward of {backward_of}" + (f" (forward at {site})" if site else "")
    return f" at {site}" if site else ""


def detected_lines(frame: dict) -> list[str]:
    """The "<label> has nans" / "<label> has infs" lines Transformers prints (from its
    detect_overflow) for the non-finite values of a frame, in line order."""
    out = []
    if not frame.get("hf", True):
        return out
    extra_flags = frame.get("extra") or [False] * len(frame["labels"])
    for label, kind, record, extra in zip(frame["labels"], frame["kinds"], frame["records"], extra_flags):
        if kind != KIND_TENSOR or record is None or extra:
            continue
        if record[NAN] > 0:
            out.append(f"{label} has nans")
        if record[POS_INF] + record[NEG_INF] > 0:
            out.append(f"{label} has infs")
    return out


def render_trace(frames, extras: bool = True) -> str:
    """Trace-mode text for frames, as Transformers prints them (one print per frame, each
    preceded by its "has nans" / "has infs" lines)."""
    parts = []
    for f in frames:
        if not (extras or f.get("hf", True)):
            continue
        parts.extend(line + "\n" for line in detected_lines(f))
        parts.append(frame_text(f, extras) + "\n")
    return "".join(parts)


def _sections(frames):
    order = []
    by_section = {}
    for f in frames:
        section = f.get("section", "forward")
        if section not in by_section:
            by_section[section] = []
            order.append(section)
        by_section[section].append(f)
    return order, by_section


def headroom_lines(frames, limit: int = 5) -> list[str]:
    """The low-precision tensors of `frames` closest to their dtype's max, closest first."""
    rows = []
    for f in frames:
        if f.get("op"):  # operation frames hold the module frames' tensors again: not repeated here
            continue
        for label, kind, record, dtype in zip(f["labels"], f["kinds"], f["records"], f["dtypes"]):
            dmax = DTYPE_MAX.get(dtype)
            if kind != KIND_TENSOR or dmax is None or record is None:
                continue
            abs_min, abs_max = shown_abs_min_max(record)
            if math.isnan(abs_max) or math.isinf(abs_max):
                fraction = math.inf
            else:
                fraction = abs_max / dmax
            rows.append((fraction, abs_max, dtype, f["name"], f["class"], label))
    if not rows:
        return []
    rows.sort(key=lambda r: (-r[0] if not math.isnan(r[0]) else -math.inf))
    out = ["Headroom (abs max as a fraction of the dtype's largest finite value, closest first):"]
    for fraction, abs_max, dtype, name, cls, label in rows[:limit]:
        shown = "overflow" if math.isinf(fraction) else f"{fraction:8.1%}"
        out.append(f"{shown:>8} {abs_max:8.2e} {dtype.replace('torch.', '')} {name or '(root)'} {cls} {label}")
    return out


def render(report: dict, extras: bool = True) -> str:
    """The report text for a report dictionary (see numguard.dump for the schema).

    With ``extras=False`` only the lines Transformers prints are kept (its frames, its labels).
    The text does not end with a newline; ``print(text)`` writes exactly what Transformers'
    ``DebugUnderflowOverflow`` writes, followed by numguard's own sections when `extras` is on."""
    frames = [f for f in report["frames"] if f.get("in_report", True)]
    order, by_section = _sections(frames)
    forward = [f for f in by_section.get("forward", []) if extras or f.get("hf", True)]
    count = sum(1 for f in forward if f.get("hf", True))
    offender = next((f for f in frames if f.get("offender")), None)
    head = detected_lines(offender) if offender is not None and offender.get("section", "forward") == "forward" else []
    head += ["", f"Detected inf/nan during batch_number={report['batch_number']}",
            f"Last {count} forward frames:", TABLE_HEADER]
    body = "\n".join(frame_text(f, extras) for f in forward)
    text = "\n".join(head) + "\n" + body
    if extras:
        more = []
        for section in order:
            if section == "forward":
                continue
            group = by_section[section]
            more.append(f"Last {len(group)} {section} frames:")
            more.append(TABLE_HEADER)
            more.extend(frame_text(f, extras) for f in group)
            more.append("")
        more.extend(summary_lines(report))
        more.extend(headroom_lines(frames))
        if more:
            text += "\n\n" + "\n".join(more)
    return text + "\n\n\n"


def replay_lines(replay) -> list[str]:
    """What watch(replay=True)'s re-run of the first bad module found (numguard.inspector.replay)."""
    if not isinstance(replay, dict):
        return []
    module = f"{replay.get('module') or '(root module)'} ({replay.get('class', '')})"
    if replay.get("reproduced"):
        site = f" at {replay['site']}" if replay.get("site") else ""
        return [f"numguard: replay of {module} on its last inputs (grad off, random state restored): first "
                f"non-finite operation: {replay.get('op')} in {replay.get('op_module') or '(root module)'} "
                f"({replay.get('op_class', '')}){site}"]
    reason = replay.get("reason") or "no reason given"
    if "did not reproduce" in reason:
        return [f"numguard: replay of {module} did NOT reproduce the non-finite value: {reason}"]
    return [f"numguard: could not replay {module}: {reason}"]


def rerun_text(rerun) -> str:
    """One sentence on what watch(rerun=True)'s rerun of the batch said (numguard.inspector.rerun)."""
    if not isinstance(rerun, dict):
        return ""
    verdict = rerun.get("verdict")
    if not verdict:
        return f"rerun of batch {rerun.get('batch')}: no verdict ({rerun.get('reason') or 'no reason given'})"
    return f"rerun verdict: {verdict} ({rerun.get('detail') or ''})"


def rerun_lines(rerun) -> list[str]:
    text = rerun_text(rerun)
    return [f"numguard: {text}"] if text else []


def first_fault_lines(fault, own_module, own_section) -> list[str]:
    """The earliest NaN/Inf across ranks, when it was on another rank than this report's: this
    rank's own non-finite values came after it, carried by a collective (NOTE: [earliest fault]
    in numguard.distributed.trip_exchange)."""
    if not isinstance(fault, dict) or fault.get("this_rank", True):
        return []
    name = fault.get("module")
    name = "(unknown module)" if name is None else (name if name else "(root module)")
    labels = ", ".join(str(v) for v in fault.get("labels") or [])
    batch = fault.get("batch")
    where = f", batch_number={batch}" if batch is not None else ""
    kind = fault.get("kind") or "unknown kind"
    own = own_module if own_module else "(root module)"
    return [f"numguard: earliest non-finite value across ranks: rank {fault.get('rank')} in {name} [{labels}], "
            f"{kind}{where}; this rank's own ({own}, {own_section or 'forward'} pass) came after it, carried "
            "here by a collective (DDP's gradient all_reduce, FSDP's reduce-scatter, a collective in the "
            "forward): it is not where the NaN/Inf started"]


def summary_lines(report: dict) -> list[str]:
    """numguard's own lines: where the first non-finite value was, and when it was found."""
    out = []
    module = report.get("module")
    where = f"batch_number={report.get('batch')}" if report.get("batch") is not None else ""
    rank = report.get("rank")
    rank_text = f" on rank {rank}" if rank is not None else ""
    if module is not None:
        labels = ", ".join(report.get("labels") or [])
        name = module if module else "(root module)"
        out.append(f"numguard: first non-finite value in {name} ({report.get('class', '')}) {labels}, "
                   f"{report.get('section', 'forward')} pass, {where}{rank_text}")
    operation = report.get("operation")
    if isinstance(operation, dict):  # unknown fields of an older or foreign dump are ignored
        # The module that ran the operation (a dump without it: the report's module).
        op_module = operation.get("module", module)
        name = op_module if op_module else "(root module)"
        op_class = operation.get("class", report.get("class", ""))
        site = op_where(operation)
        values = []
        for key, text in (("input_abs_max", "input abs max"), ("output_abs_max", "output")):
            value = operation.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                values.append(f"{text} {value:.1e}")
        out.append(f"numguard: first non-finite operation: {operation.get('op')} in {name} "
                   f"({op_class}){site}" + (": " + ", ".join(values) if values else ""))
    out.extend(replay_lines(report.get("replay")))
    out.extend(rerun_lines(report.get("rerun")))
    ranks = report.get("ranks") or []
    if ranks:
        out.append("numguard: ranks that tripped: " + ", ".join(
            f"{r} ({m if m else '(root module)'})" if m is not None else str(r) for r, m in ranks))
    out.extend(first_fault_lines(report.get("first_fault"), module, report.get("section")))
    where = report.get("where")
    if where and where not in ("batch end", "close"):
        out.append(f"numguard: found at the check {where!r}")
    found = report.get("found_at_batch")
    if report.get("check") == "async" and found is not None:
        out.append(f"numguard: check=\"async\" found this trip at the end of batch_number={found}, "
                   "one batch after the batch that tripped")
    elif found is not None and report.get("batch") is not None and found != report["batch"]:
        out.append(f"numguard: found at the check after batch_number={found} "
                   f"(check_every={report.get('check_every', 1)})")
    return out
