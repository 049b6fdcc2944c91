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
      "module": str, "class": str,             # first offending module ("" = root) and its class
      "labels": [str, ...],     # the offending labels of that frame
      "section": "forward" | "backward" | ...,
      "max_frames_to_save": int, "headroom": float, "backend": "native" | "torch",
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
          "records": [[abs_min, abs_max, min_nonzero, nan, pos_inf, neg_inf, zero, subnormal] | null, ...]
        }, ...
      ]
    }
"""
from __future__ import annotations

import json
import os

from . import report as _report

FORMAT = "numguard-report"
VERSION = 1

__all__ = ["write", "load", "render_file", "FORMAT", "VERSION"]


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
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    os.replace(tmp, path)
    return path


def load(path) -> dict:
    """Read a dump file; raises ValueError naming the file when it is not a numguard report."""
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"numguard: {path} is not valid JSON ({exc}); pass a file written by "
                             "on_trip='dump'") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"numguard: {path} is not a numguard report (format={data.get('format') if isinstance(data, dict) else None!r}, "
                         f"expected {FORMAT!r}); pass a file written by on_trip='dump'")
    if data.get("version") != VERSION:
        raise ValueError(f"numguard: {path} has report version {data.get('version')!r}; this numguard reads "
                         f"version {VERSION}: render it with the numguard version that wrote it")
    for i, frame in enumerate(data.get("frames", [])):
        for key in ("name", "class", "labels", "kinds", "records"):
            if key not in frame:
                raise ValueError(f"numguard: {path}: frame {i} has no {key!r} field; the file is damaged")
        frame.setdefault("dtypes", [None] * len(frame["labels"]))
        frame.setdefault("shapes", [None] * len(frame["labels"]))
        frame.setdefault("extra", [False] * len(frame["labels"]))
    return data


def render_file(path, extras: bool = True) -> str:
    """The report text of a dump file (what was printed when it tripped)."""
    return _report.render(load(path), extras)
