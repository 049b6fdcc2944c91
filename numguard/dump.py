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
      "operation": {"op": str, "module": str, "class": str, "site": str, "backward_of": str | null,
                    "input_abs_max": float | null, "output_abs_max": float | null},
                                # optional: the operation that made the first NaN/Inf (watch(ops=True)),
                                # the module that ran it (may be inside the report's module)
      "history": {              # optional: the per-module history precision advice reads
        "window": int, "batches": [int, ...],  # batches covered, oldest first
        "loss_scale": float | null, "loss_scale_source": "GradScaler" | "assumed",
        "modules": [{"name": str, "class": str, "dtype": str | null, "grad_dtype": str | null,
                     "out_abs_max": [float | null, ...], "in_abs_max": [...], "min_nonzero": [...],
                     "grad_abs_max": [...], "grad_min_nonzero": [...], "grad_subnormal_share": [...]},
                    ...],    # one value per batch; python -m numguard advise FILE
        "quant": {"format": str, "rows": [{"module": str, "quantity": "output" | "grad_output",
                                           "underflow": float, "saturated": float, "mse": float,
                                           "batches": int}, ...]}},
                                # optional: watch(quant=...)'s what-if table, worst first
      "replay": {"module": str, "class": str, "reproduced": bool, "op": str | null, "site": str | null,
                 "op_module": str | null, "op_class": str | null, "reason": str},
                                # optional: watch(replay=True)'s re-run of the first bad module
      "rerun": {"verdict": "transient" | "reproducible" | "device" | null, "batch": int, "reason": str,
                "recovered": bool, "identical": bool | null, "watched_abs_max": float | null,
                "module": str, "class": str, "detail": str,
                "rank": int, "host": str, "device": str, "peer": int | null},
                                # optional: watch(rerun=True)'s rerun of the batch (numguard.inspector.rerun;
                                # rank/host/device/peer in multi-rank jobs: numguard.distributed.peer_rerun)
      "outliers": [{"rank": int, "host": str, "metric": "activations" | "gradients" | "step_time",
                    "value": float, "median_of_others": float, "ratio": float, ...}, ...],
                                # optional: the ranks numguard.distributed.last_outliers() named
                                # when the file was written (distributed jobs)
      "framework_step": {"name": str, "value": ...},  # optional: a training framework's step counter
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
          "op": str, "site": str,      # optional: an operation frame's aten op and call site (file:line)
          "backward_of": str           # optional: a backward operation's autograd node
        }, ...
      ]
    }

``load`` checks a file against this schema before anything renders it: a wrong type, a missing
field, or per-line lists of different lengths raise :class:`DumpError` naming the place, e.g.
``frames[3].records[2]: expected 8 numbers or null, got 'abc'``. Fields marked optional below may
be missing (older writers); unknown fields are ignored. The fields and their checks are declared
once, by the types of numguard.report_types (``Report.from_json`` reads a file's dictionary as them).
"""
from __future__ import annotations

import json
import os
import sys

from . import report as _report
from . import report_types as _types
from .report_types import FORMAT, VERSION

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


def validate(data, path="<dump>") -> dict:
    """Check a loaded dump against the schema; returns it with the optional per-line lists filled
    in. Raises DumpError naming the first problem and where it is."""
    if not isinstance(data, dict):
        raise DumpError(path, "", f"expected a JSON object, got {type(data).__name__} {_types.show(data)}; "
                                  f"this is not a numguard report: {_HINT}")
    if data.get("format") != FORMAT:
        raise DumpError(path, "format", f"expected {FORMAT!r}, got {_types.show(data.get('format'))}: this is "
                                        f"not a numguard report; {_HINT}")
    version = data.get("version")
    if not _types.POSITIVE.test(version):
        raise DumpError(path, "version", f"expected {_types.POSITIVE.expected}, got {_types.show(version)}")
    if version > VERSION:
        raise DumpError(path, "version", f"report version {version} is newer than this numguard reads "
                                         f"(version {VERSION}): upgrade numguard to render it")
    try:
        _types.Report.from_json(data)
    except _types.ReportFieldError as exc:
        raise DumpError(path, exc.where, exc.problem) from None
    for frame in data["frames"]:
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
