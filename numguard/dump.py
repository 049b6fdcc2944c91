"""JSON dump files of numguard reports (on_trip="dump"), and reading them back.

A dump file holds one report dictionary, the same dictionary the inspector renders when it trips,
so ``render_file(path)`` gives the text that was printed at the trip. ``python -m numguard report
FILE`` prints it.

Schema (``format == "numguard-report"``, ``version == 1``); JSON numbers may be ``Infinity`` /
``NaN`` (as Python's json module writes them):

    {
      "format": "numguard-report", "version": 1,
      "batch_number": int,      # the number Transformers' header shows ("Detected inf/nan during batch_number=N")
      "batch": int,             # 0-indexed batch of the first offending frame
      "found_at_batch": int,    # batch at whose check the trip was found (async: one check later)
      "check": "sync" | "async", "check_every": int,
      "rank": int | null,       # null when torch.distributed was not initialized
      "ranks": [[rank, module | null], ...],   # every rank that tripped (distributed jobs)
      "first_fault": {"rank": int, "module": str | null, "labels": [str, ...], "kind": str | null,
                      "batch": int | null, "this_rank": bool},
                                # optional: the earliest NaN/Inf across ranks (schema.FAULT_KINDS);
                                # this_rank false: this rank's own came later, carried by a collective
      "module": str, "class": str,             # first offending module ("" = root) and its class
      "labels": [str, ...],     # the offending labels of that frame
      "section": "forward" | "backward" | ...,
      "max_frames_to_save": int, "headroom": float, "backend": "native" | "torch",
      "operation": {"op": str, "module": str, "class": str, "site": str,
                    "input_abs_max": float | null, "output_abs_max": float | null},
                                # optional: the operation that made the first NaN/Inf (watch(ops=True)),
                                # the module that ran it (may be inside the report's module)
      "history": {              # optional: the per-module history precision advice reads
        "window": int, "batches": [int, ...],  # batches covered, oldest first
        "loss_scale": float | null, "loss_scale_source": "GradScaler" | "assumed",
        "modules": [{"name": str, "class": str, "dtype": str | null, "grad_dtype": str | null,
                     "out_abs_max": [float | null, ...], "in_abs_max": [...], "min_nonzero": [...],
                     "grad_abs_max": [...], "grad_min_nonzero": [...], "grad_subnormal_share": [...]},
                    ...]},   # one value per batch; python -m numguard advise FILE
      "replay": {"module": str, "class": str, "reproduced": bool, "op": str | null, "site": str | null,
                 "op_module": str | null, "op_class": str | null, "reason": str},
                                # optional: watch(replay=True)'s re-run of the first bad module
      "rerun": {"verdict": "transient" | "reproducible" | "device" | null, "batch": int, "reason": str,
                "recovered": bool, "detail": str, "identical": bool | null, "module": str, "class": str},
                                # optional: watch(rerun=True)'s rerun of the batch (numguard.inspector.rerun)
      "outliers": [{"rank": int, "host": str, "metric": "activations" | "gradients" | "step_time",
                    "value": float, "median_of_others": float, "ratio": float, ...}, ...],
                                # optional: the ranks numguard.distributed.last_outliers() named
                                # when the file was written (distributed jobs)
      "frames": [               # oldest first; the last one is the offending frame
        {
          "name": str, "class": str, "section": str, "batch": int,
          "batch_start": int | null,   # Transformers' "*** Starting batch number=N ***" lines before this frame
          "hf": bool,                  # a frame Transformers prints (false: numguard's own, e.g. detect_overflow)
          "in_report": bool,           # part of the rendered report (the last max_frames_to_save frames)
          "offender": bool,
          "labels": [str, ...],        # one per line: "weight", "input[0]", "kwargs.mask", "output[1][0]", ...
          "kinds": ["tensor" | "none" | "not a tensor", ...],
          "extra": [bool, ...],        # a line Transformers does not print
          "dtypes": ["torch.float16" | null, ...],
          "shapes": [[int, ...] | null, ...],
          "records": [[abs_min, abs_max, min_nonzero, nan, pos_inf, neg_inf, zero, subnormal] | null, ...],
          "op": str, "site": str       # optional: an operation frame's aten op and call site (file:line)
        }, ...
      ]
    }

``load`` checks a file against this schema before anything renders it: a wrong type, a missing
field, or per-line lists of different lengths raise :class:`DumpError` naming the place, e.g.
``frames[3].records[2]: expected 8 numbers or null, got 'abc'``. Fields marked optional below may
be missing (older writers); unknown fields are ignored.
"""
from __future__ import annotations

import json
import math
import os
import sys

from . import report as _report

FORMAT = "numguard-report"
VERSION = 1

__all__ = ["DumpError", "write", "load", "validate", "render_file", "FORMAT", "VERSION"]

_HINT = "pass a file written by on_trip='dump' (NUMGUARD_ON_TRIP=dump)"


class DumpError(ValueError):
    """A dump file numguard cannot render. ``path``: the file; ``where``: the place in it
    (``"frames[3].records[2]"``, or "" for the whole file); ``problem``: what is wrong there."""

    def __init__(self, path, where, problem):
        self.path, self.where, self.problem = path, where, problem
        place = f"{path}: {where}: " if where else f"{path}: "
        super().__init__(place + problem)


def write(report: dict, dump_dir=None, rank=None) -> str:
    """Write `report` as JSON into `dump_dir` (default: the current directory) and return the path.
    One file per rank and batch: numguard-trip-rank<R>-batch<B>.json."""
    directory = os.fspath(dump_dir) if dump_dir is not None else os.getcwd()
    os.makedirs(directory, exist_ok=True)
    rank_text = rank if rank is not None else 0
    base = f"numguard-trip-rank{rank_text}-batch{report.get('batch')}"
    path = os.path.join(directory, base + ".json")
    n = 1
    while os.path.exists(path):
        path = os.path.join(directory, f"{base}-{n}.json")
        n += 1
    tmp = path + ".tmp"
    report = _with_outliers(report)
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    os.replace(tmp, path)
    return path


def _with_outliers(report: dict) -> dict:
    """The report with the "outliers" field of a distributed job (numguard.distributed.numerics,
    when it is in use); a report that has one keeps it."""
    numerics = sys.modules.get("numguard.distributed.numerics")
    if numerics is None or "outliers" in report:
        return report
    try:
        outliers = numerics.last_outliers()
    except Exception:  # a dump must be written whatever the distributed state
        return report
    return dict(report, outliers=outliers)


# ------------------------------------------------------------------------------------------------
# Schema checks. Each check is (what is expected, in words; test of one value).


def _show(value, limit=60):
    """How an error shows the bad value: its repr (shortened), and a list's length."""
    text = repr(value)
    if len(text) > limit:
        text = text[:limit - 3] + "..."
    if isinstance(value, list):
        text += f" (a list of {len(value)})"
    return text


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _or_null(check):
    return lambda v: v is None or check(v)


def _count(v):  # a record's counts: whole, finite, >= 0 (JSON may write them as 3.0)
    return _is_number(v) and math.isfinite(v) and v >= 0 and float(v).is_integer()


def _is_record(v):
    return v is None or (isinstance(v, list) and len(v) == len(_RECORD_FIELDS)
                         and all(_is_number(x) for x in v[:3]) and all(_count(x) for x in v[3:]))


_RECORD_FIELDS = ("abs_min", "abs_max", "min_nonzero", "nan", "pos_inf", "neg_inf", "zero", "subnormal")
_STR = ("a string", lambda v: isinstance(v, str))
_STR_OR_NULL = ("a string or null", _or_null(lambda v: isinstance(v, str)))
_BOOL = ("true or false", lambda v: isinstance(v, bool))
_BATCH = ("a whole number >= 0", lambda v: _is_int(v) and v >= 0)
_BATCH_OR_NULL = ("a whole number >= 0 or null", _or_null(_BATCH[1]))
_POSITIVE = ("a whole number >= 1", lambda v: _is_int(v) and v >= 1)
_RANK_PAIR = ("a [rank, module or null] pair",
              lambda v: isinstance(v, list) and len(v) == 2 and _is_int(v[0]) and _STR_OR_NULL[1](v[1]))

# key: (required, (expected, test)); lists whose entries are checked one by one are ("list", ...).
_TOP = {
    "batch_number": (True, _BATCH),
    "frames": (True, None),  # checked below, frame by frame
    "batch": (False, _BATCH_OR_NULL),
    "found_at_batch": (False, _BATCH_OR_NULL),
    "check": (False, _STR),
    "check_every": (False, _POSITIVE),
    "where": (False, _STR_OR_NULL),
    "rank": (False, ("a whole number >= 0 or null", _or_null(lambda v: _is_int(v) and v >= 0))),
    "ranks": (False, ("list", _RANK_PAIR)),
    "outliers": (False, ("list", ("an outlier (an object with a whole-number rank and a metric)",
                                  lambda v: isinstance(v, dict) and _is_int(v.get("rank"))
                                  and isinstance(v.get("metric"), str)))),
    "first_fault": (False, ("an object with a whole-number rank",
                            lambda v: isinstance(v, dict) and _is_int(v.get("rank")))),
    "module": (False, _STR_OR_NULL),
    "class": (False, _STR),
    "labels": (False, ("list", _STR)),
    "section": (False, _STR),
    "max_frames_to_save": (False, _POSITIVE),
    "headroom": (False, ("a number", _is_number)),
    "backend": (False, _STR),
    "history": (False, ("an object", lambda v: isinstance(v, dict))),
    "replay": (False, ("an object", lambda v: isinstance(v, dict))),
    "rerun": (False, ("an object", lambda v: isinstance(v, dict))),
}
_FRAME = {
    "name": (True, _STR),
    "class": (True, _STR),
    "section": (False, _STR),
    "batch": (False, _BATCH_OR_NULL),
    "batch_start": (False, _BATCH_OR_NULL),
    "hf": (False, _BOOL),
    "in_report": (False, _BOOL),
    "offender": (False, _BOOL),
}
# One entry per line of the frame: these lists must all have the same length.
_LINES = {
    "labels": (True, _STR),
    "kinds": (True, ("'tensor', 'none' or 'not a tensor'",
                     lambda v: v in (_report.KIND_TENSOR, _report.KIND_NONE, _report.KIND_NOT_A_TENSOR))),
    "records": (True, ("8 numbers or null (abs_min, abs_max, min_nonzero, then 5 counts >= 0)",
                       _is_record)),
    "extra": (False, _BOOL),
    "dtypes": (False, _STR_OR_NULL),
    "shapes": (False, ("a list of whole numbers >= 0, or null",
                       _or_null(lambda v: isinstance(v, list) and all(_is_int(d) and d >= 0 for d in v)))),
}


def _check_fields(path, prefix, obj, fields):
    for key, (required, spec) in fields.items():
        if key not in obj:
            if required:
                raise DumpError(path, f"{prefix}{key}", "missing; the file is damaged or not a numguard dump")
            continue
        if spec is None:
            continue
        value = obj[key]
        if spec[0] == "list":
            expected, test = spec[1]
            if not isinstance(value, list):
                raise DumpError(path, f"{prefix}{key}", f"expected a list, got {_show(value)}")
            for i, item in enumerate(value):
                if not test(item):
                    raise DumpError(path, f"{prefix}{key}[{i}]", f"expected {expected}, got {_show(item)}")
        elif not spec[1](value):
            raise DumpError(path, f"{prefix}{key}", f"expected {spec[0]}, got {_show(value)}")


def _check_frame(path, index, frame):
    prefix = f"frames[{index}]."
    if not isinstance(frame, dict):
        raise DumpError(path, f"frames[{index}]", f"expected a frame (an object), got {_show(frame)}")
    _check_fields(path, prefix, frame, _FRAME)
    lengths = {}
    for key, (required, (expected, test)) in _LINES.items():
        if key not in frame:
            if required:
                raise DumpError(path, prefix + key, "missing; the file is damaged or not a numguard dump")
            continue
        values = frame[key]
        if not isinstance(values, list):
            raise DumpError(path, prefix + key, f"expected a list with one entry per line, got {_show(values)}")
        for i, value in enumerate(values):
            if not test(value):
                raise DumpError(path, f"{prefix}{key}[{i}]", f"expected {expected}, got {_show(value)}")
        lengths[key] = len(values)
    if len(set(lengths.values())) > 1:
        counts = ", ".join(f"{key} has {n}" for key, n in lengths.items())
        raise DumpError(path, f"frames[{index}]", f"the per-line lists differ in length ({counts}); "
                                                  "each line needs one entry in each")


def validate(data, path="<dump>") -> dict:
    """Check a loaded dump against the schema; returns it with the optional per-line lists filled
    in. Raises DumpError naming the first problem and where it is."""
    if not isinstance(data, dict):
        raise DumpError(path, "", f"expected a JSON object, got {type(data).__name__} {_show(data)}; "
                                  f"this is not a numguard report: {_HINT}")
    if data.get("format") != FORMAT:
        raise DumpError(path, "format", f"expected {FORMAT!r}, got {_show(data.get('format'))}: this is "
                                        f"not a numguard report; {_HINT}")
    version = data.get("version")
    if not _is_int(version) or version < 1:
        raise DumpError(path, "version", f"expected a whole number >= 1, got {_show(version)}")
    if version > VERSION:
        raise DumpError(path, "version", f"report version {version} is newer than this numguard reads "
                                         f"(version {VERSION}): upgrade numguard to render it")
    _check_fields(path, "", data, _TOP)
    frames = data["frames"]
    if not isinstance(frames, list) or not frames:
        raise DumpError(path, "frames", f"expected a non-empty list of frames, got {_show(frames)}")
    for index, frame in enumerate(frames):
        _check_frame(path, index, frame)
        lines = len(frame["labels"])
        frame.setdefault("dtypes", [None] * lines)
        frame.setdefault("shapes", [None] * lines)
        frame.setdefault("extra", [False] * lines)
    return data


def load(path) -> dict:
    """Read and validate a dump file. Raises DumpError (a ValueError) naming the file and what is
    wrong where; OSError when the file cannot be opened."""
    with open(path, "rb") as f:
        raw = f.read()
    if not raw.strip():
        raise DumpError(path, "", f"the file is empty; {_HINT}")
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise DumpError(path, "", f"not UTF-8 text (byte {exc.start}); {_HINT}") from None
    except json.JSONDecodeError as exc:
        raise DumpError(path, "", f"not valid JSON ({exc}); the file is cut short or damaged; "
                                  f"{_HINT}") from None
    except (ValueError, RecursionError) as exc:  # e.g. a 5000-digit number, nesting 10**5 deep
        raise DumpError(path, "", f"cannot be read as JSON ({type(exc).__name__}: {exc}); {_HINT}") from None
    return validate(data, path)


def render_file(path, extras: bool = True) -> str:
    """The report text of a dump file (what was printed when it tripped)."""
    return _report.render(load(path), extras)
