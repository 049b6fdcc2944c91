"""The doctor's output: a text report (rank 0), the JSON file and the optional plot."""
from __future__ import annotations

import json
import os
import tempfile

from . import findings
from .facts import TABLE_COLUMNS

__all__ = ["SCHEMA", "render", "unwritable", "write_json", "write_plot"]

SCHEMA = "numguard.doctor/1"
_GIB = 1024 ** 3


def _cell(f, key):
    if key == "memory":
        if f.get("memory_total") is None:
            return "-"
        return f"{(f.get('memory_free') or 0) / _GIB:.1f}/{f['memory_total'] / _GIB:.1f}"
    if key == "shm":
        return "-" if f.get("shm_total") is None else f"{f['shm_total'] / _GIB:.1f}"
    value = f.get(key)
    text = "-" if value is None else str(value)
    return text if len(text) <= 28 else text[:27] + "~"


def _table(headings, rows):
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(headings)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return [line(headings), line(["-" * w for w in widths])] + [line(r) for r in rows]


def _size(n):
    for unit, scale in (("GiB", 1024 ** 3), ("MiB", 1024 ** 2), ("KiB", 1024)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n} B"


def render(result):
    """The human report as text."""
    lines = [f"numguard doctor: {result['world_size']} rank(s), backend "
             f"{result['backend'] or '(not started)'}: "
             f"{result['status'].upper()}"]
    if result["missing_ranks"]:
        lines.append(f"Ranks that never joined within {result['options']['timeout']:g} s: "
                     f"{result['missing_ranks']} (arrived: "
                     + ", ".join(f"{r}@{h}" for r, h in sorted(result["arrived"].items(),
                                                               key=lambda kv: int(kv[0]))) + ")")
    for t in result["failures"]:
        lines.append(f"{t['kind'].upper()} on rank {t['rank']}: {t['message']}")
    if result["facts"]:
        lines += ["", "Ranks:"]
        lines += ["  " + s for s in _table([h for h, _ in TABLE_COLUMNS],
                                           [[_cell(f, k) for _, k in TABLE_COLUMNS]
                                            for f in result["facts"]])]
        same, differing = [], []
        for name, groups in findings.env_values(result["facts"]).items():
            if len(groups) == 1:
                same.append(f"{name}={next(iter(groups))}")
            else:
                differing.append(f"{name}: " + ", ".join(
                    f"{v} (rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, sorted(rs)))})"
                    for v, rs in groups.items()))
        if same:
            lines.append("  environment (every rank): " + ", ".join(same))
        for line in differing:
            lines.append("  environment differs: " + line)
    if result["checks"]:
        ok = [c for c in result["checks"] if c["ok"] and not c["skipped"]]
        bad = [c for c in result["checks"] if not c["ok"]]
        skipped = [c for c in result["checks"] if c["skipped"]]
        lines += ["", f"Correctness: {len(ok)} passed, {len(bad)} wrong, {len(skipped)} skipped"
                  " (results compared exactly on every rank)"]
        for c in bad:
            lines.append(f"  WRONG  {c['name']}: ranks {c['wrong_ranks']}")
        for c in skipped:
            lines.append(f"  skipped {c['name']}: {c['skipped']}")
    perf = result.get("performance") or {}
    if perf.get("bandwidth"):
        lines += ["", "Bandwidth (GB/s = 1e9 B/s; busbw as nccl-tests; time of the slowest rank):"]
        rows = [[r["op"], _size(r["bytes"]), f"{r['time_s'] * 1e6:.1f}", f"{r['algbw_GBps']:.3f}",
                 f"{r['busbw_GBps']:.3f}"] for r in perf["bandwidth"]]
        lines += ["  " + s for s in _table(["op", "size", "time us", "algbw", "busbw"], rows)]
    elif result["world_size"] == 1 and perf:
        lines += ["", "Bandwidth: not measured (one rank has no peer to exchange with)"]
    if perf.get("latency_s"):
        lat = perf["latency_s"]
        lines += ["", f"Latency of a 1-element all_reduce: {max(lat) * 1e6:.1f} us (median of the "
                      f"slowest rank; per rank: {', '.join(f'{x * 1e6:.0f}' for x in lat)} us)"]
    if perf.get("stragglers"):
        s = perf["stragglers"]
        lines.append("Straggler probe (median per rank): arrives late by "
                     + ", ".join(f"{x * 1e3:.2f}" for x in s["lateness_s"]) + " ms; compute "
                     + ", ".join(f"{x * 1e3:.2f}" for x in s["compute_s"]) + " ms")
    if perf.get("pairs"):
        m = perf["pairs"]
        lines += ["", "Send/recv round-trip bandwidth, GB/s "
                      f"({_size(perf['pair_bytes'])} each way):"]
        rows = [[str(i)] + ["-" if v is None else f"{v:.2f}" for v in row]
                for i, row in enumerate(m)]
        lines += ["  " + s for s in _table(["rank"] + [str(j) for j in range(len(m))], rows)]
    lines += ["", "Findings:" if result["findings"] else "Findings: none"]
    for f in result["findings"]:
        lines.append(f"  [{f['severity'].upper()}] {f['title']}")
        if f.get("detail"):
            lines.append(f"      {f['detail']}")
        lines.append(f"      what to do: {f['advice']}")
    if result.get("nccl_logs"):
        lines += ["", "NCCL logs: " + ", ".join(result["nccl_logs"])]
    return "\n".join(lines) + "\n"


def unwritable(path, option):
    """None when a file can be written at ``path`` (its folder is created), else why not.

    A throw-away file in the folder is the only sure test: permissions, read-only mounts, a
    file where a folder should be and full disks all show, root or not.
    """
    full = os.path.abspath(path)
    if os.path.isdir(full):
        return (f"{option} {path!r} is a folder; give the path of a file to write, e.g. "
                f"{os.path.join(path, 'doctor.json')!r}")
    folder = os.path.dirname(full)
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".numguard-doctor-"):
            pass
    except OSError as exc:
        return (f"{option} {path!r} cannot be written ({exc.strerror or exc}"
                f"{': ' + exc.filename if exc.filename else ''}); give a path in a folder you "
                "can write to")
    return None


def write_json(result, path):
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = path + ".tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1, sort_keys=True)
        os.replace(tmp, path)  # a reader never sees half a file
    except OSError:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def write_plot(result, path):
    """Bandwidth against size and the pair matrix as a heat map.

    Raises RuntimeError when matplotlib is missing.
    """
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError(f"--plot needs matplotlib ({exc}); pip install matplotlib") from None
    perf = result.get("performance") or {}
    pairs = perf.get("pairs")
    fig, axes = plt.subplots(1, 2 if pairs else 1, figsize=(12 if pairs else 7, 4.5), squeeze=False)
    ax = axes[0][0]
    for op in ("all_reduce", "all_gather", "reduce_scatter"):
        rows = [r for r in perf.get("bandwidth") or [] if r["op"] == op]
        if rows:
            ax.plot([r["bytes"] for r in rows], [r["busbw_GBps"] for r in rows], marker="o",
                    label=op)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("bytes")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(f"{result['world_size']} ranks, {result['backend']}")
    if perf.get("bandwidth"):
        ax.legend()
    if pairs:
        import math

        ax = axes[0][1]
        data = [[math.nan if v is None else v for v in row] for row in pairs]
        image = ax.imshow(data, cmap="viridis")
        fig.colorbar(image, ax=ax, label="GB/s (round trip)")
        n = len(pairs)
        ax.set_xticks(range(n))
        ax.set_yticks(range(n))
        if n <= 16:  # beyond that the numbers would not fit their cells
            for i in range(n):
                for j in range(n):
                    if pairs[i][j] is not None:
                        ax.text(j, i, f"{pairs[i][j]:.2f}", ha="center", va="center",
                                color="white", fontsize=8)
        ax.set_xlabel("rank")
        ax.set_ylabel("rank")
        ax.set_title("send/recv pairs")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
