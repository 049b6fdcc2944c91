"""Performance: bus bandwidth over a sweep of sizes, tiny-collective latency, a straggler probe and
an optional pairwise send/recv matrix.

Bandwidth follows nccl-tests: ``algbw = bytes / time`` and ``busbw = algbw * factor`` with factor
``2(n-1)/n`` for all_reduce and ``(n-1)/n`` for all_gather and reduce_scatter (bytes: the full
buffer, i.e. the gathered output or the scattered input), so numbers compare with nccl-tests.

A collective ends at about the same moment on every rank, so its duration cannot name a slow
rank. The straggler probe instead aligns ranks with a barrier, times a fixed local compute probe,
then times how long each rank waits inside a tiny all_reduce: a rank that arrives late waits least,
and ``lateness = (longest wait on any rank) - (own wait)`` is how late it arrived, with no clock
shared between hosts. Per rank the median over the iterations is kept (a one-off scheduling hiccup
moves it little; a rank that is always late moves it fully).
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from .launcher import all_gather_single, reduce_scatter_single

__all__ = ["BUSBW_FACTOR", "DEFAULT_SIZES", "Z_THRESHOLD", "bandwidth_table", "measure",
           "pair_table", "robust_outliers", "stragglers"]

DEFAULT_SIZES = {"cpu": [4 ** k * 1024 for k in range(7)],          # 1 KiB .. 4 MiB
                 "cuda": [4 ** k * 1024 for k in range(10)] + [256 * 1024 ** 2]}  # .. 256 MiB
# Iglewicz & Hoaglin's cut-off for the modified z-score ((x - median) / (1.4826 MAD)): values past
# 3.5 are outliers; it keeps the false-alarm rate low for the few ranks a job has.
Z_THRESHOLD = 3.5
# Scale floors: identical healthy ranks have a MAD near 0, and jitter must not become a finding.
# Arriving 5 ms late is below what the host scheduler alone can cause on a busy machine; a compute
# probe within 10 % of the others is normal variation between devices of the same model.
LATENESS_FLOOR_S = 0.005
COMPUTE_FLOOR_FRACTION = 0.10


# nccl-tests' bus bandwidth factors (doc/PERFORMANCE.md there): busbw = algbw * factor(n), the
# bandwidth each link carries so that results compare with the hardware's peak whatever n is.
_BUSBW_FACTORS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
    "send_recv": lambda n: 1.0,
}


def BUSBW_FACTOR(op, n):  # noqa: N802 - reads like the formula's name in nccl-tests
    """nccl-tests' bus bandwidth factor for ``op`` on ``n`` ranks (0 for one rank: no bus)."""
    if op not in _BUSBW_FACTORS:
        raise ValueError(f"numguard doctor: no bus bandwidth factor for {op!r}; known: {sorted(_BUSBW_FACTORS)}")
    if n <= 1:
        return 0.0
    return _BUSBW_FACTORS[op](n)


def _poll(ctx, works, deadline, name):
    """Wait under the step's deadline; returns the perf_counter time the works completed."""
    return ctx.wait(works, deadline, name)


def _sweep_one(ctx, op, nbytes, iters):
    """Mean seconds per ``op`` of ``nbytes`` on this rank (iterations issued back to back)."""
    n = ctx.world
    elems = max(n, nbytes // 4 // n * n)  # float32, divisible by the rank count
    if op == "all_reduce":
        buf = torch.ones(elems, device=ctx.device)
        issue = lambda: dist.all_reduce(buf, async_op=True)  # noqa: E731
    elif op == "all_gather":
        out = torch.empty(elems, device=ctx.device)
        chunk = torch.ones(elems // n, device=ctx.device)
        issue = lambda: all_gather_single()(out, chunk, async_op=True)  # noqa: E731
    else:
        inp = torch.ones(elems, device=ctx.device)
        part = torch.empty(elems // n, device=ctx.device)
        issue = lambda: reduce_scatter_single()(part, inp, async_op=True)  # noqa: E731
    timing = {}

    name = f"bandwidth {op} {nbytes} B"

    def run():
        deadline = time.monotonic() + ctx.timeout
        _poll(ctx, [dist.barrier(async_op=True)], deadline, name)
        _poll(ctx, [issue()], deadline, name)  # warm-up: the first use of a size sets up buffers
        t0 = time.perf_counter()
        works = [issue() for _ in range(iters)]
        timing["seconds"] = (_poll(ctx, works, deadline, name) - t0) / iters
        return []
    ctx.step(name, run)
    return {"op": op, "bytes": elems * 4, "seconds": timing["seconds"]}


def _compute_probe(device):
    # About a millisecond or two of fixed work on either device: long enough to time, short
    # enough to repeat; ones stay ones, so no value can overflow.
    n = 2048 if device.type == "cuda" else 128
    a = torch.ones(n, n, device=device)
    for _ in range(8 if device.type == "cuda" else 4):
        a = torch.mm(a, a) * (1.0 / a.shape[0])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return a


def _latency(ctx, iters):
    t = torch.zeros(1, device=ctx.device)
    times = []

    def run():
        deadline = time.monotonic() + ctx.timeout
        _poll(ctx, [dist.all_reduce(t, async_op=True)], deadline, "latency")  # warm-up
        for _ in range(iters):
            t0 = time.perf_counter()
            times.append(_poll(ctx, [dist.all_reduce(t, async_op=True)], deadline, "latency") - t0)
        return []
    ctx.step("latency (1-element all_reduce)", run)
    return statistics.median(times)


def _straggler_probe(ctx, iters):
    t = torch.zeros(1, device=ctx.device)
    compute, waits = [], []

    def run():
        deadline = time.monotonic() + ctx.timeout
        for _ in range(iters):
            _poll(ctx, [dist.barrier(async_op=True)], deadline, "straggler probe")
            t0 = time.perf_counter()
            _compute_probe(ctx.device)
            t1 = time.perf_counter()
            work = dist.all_reduce(t, async_op=True)
            t2 = time.perf_counter()
            compute.append(t1 - t0)
            waits.append(_poll(ctx, [work], deadline, "straggler probe") - t2)
        return []
    ctx.step("straggler probe", run)
    return {"compute_s": compute, "wait_s": waits}


def _pairs(ctx, nbytes, reps=3):
    """Round-trip bandwidth from this rank to each higher rank (ping-pong), in bytes/s."""
    buf = torch.ones(max(1, nbytes // 4), device=ctx.device)
    back = torch.empty_like(buf)
    row = {}
    for i in range(ctx.world):
        for j in range(i + 1, ctx.world):
            def run(i=i, j=j):
                name = f"send/recv {i}<->{j}"
                deadline = time.monotonic() + ctx.timeout
                _poll(ctx, [dist.barrier(async_op=True)], deadline, name)
                if ctx.rank not in (i, j):
                    return []
                for rep in range(reps + 1):  # the first round trip is a warm-up
                    t0 = time.perf_counter()
                    if ctx.rank == i:
                        _poll(ctx, [dist.isend(buf, j)], deadline, name)
                        back_at = _poll(ctx, [dist.irecv(back, j)], deadline, name)
                        if rep:
                            row.setdefault(j, []).append(back_at - t0)
                    else:
                        _poll(ctx, [dist.irecv(back, i)], deadline, name)
                        _poll(ctx, [dist.isend(back, i)], deadline, name)
                return []
            ctx.step(f"send/recv {i}<->{j}", run)
    return {str(j): 2 * buf.numel() * 4 / statistics.median(ts) for j, ts in row.items()}


def measure(ctx, sizes, iters, pairs, pair_bytes):
    """This rank's raw timings (JSON-ready); combine every rank's with the table functions."""
    out = {"sweep": [], "latency_s": None, "probe": None, "pairs": None}
    if ctx.world > 1:
        for op in ("all_reduce", "all_gather", "reduce_scatter"):
            for nbytes in sizes:
                out["sweep"].append(_sweep_one(ctx, op, nbytes, iters))
    out["latency_s"] = _latency(ctx, max(iters, 10))
    out["probe"] = _straggler_probe(ctx, max(iters, 10))
    if pairs and ctx.world > 1:
        out["pairs"] = _pairs(ctx, pair_bytes)
    return out


def bandwidth_table(per_rank, world):
    """Rows of op, bytes, time (slowest rank), algbw and busbw in GB/s (10**9, as nccl-tests)."""
    rows = []
    for k, first in enumerate(per_rank[0]["sweep"]):
        times = [p["sweep"][k]["seconds"] for p in per_rank]
        seconds = max(times)
        algbw = first["bytes"] / seconds / 1e9
        rows.append({"op": first["op"], "bytes": first["bytes"], "time_s": seconds,
                     "algbw_GBps": algbw, "busbw_GBps": algbw * BUSBW_FACTOR(first["op"], world),
                     "per_rank_time_s": times})
    return rows


def pair_table(per_rank, world):
    """Symmetric matrix (list of lists, GB/s; None on the diagonal) or None when not measured."""
    if not per_rank or per_rank[0].get("pairs") is None:
        return None
    m = [[None] * world for _ in range(world)]
    for i, p in enumerate(per_rank):
        for j, bw in (p.get("pairs") or {}).items():
            m[i][int(j)] = m[int(j)][i] = bw / 1e9
    return m


def robust_outliers(values, floor):
    """Indices whose leave-one-out robust z-score exceeds :data:`Z_THRESHOLD` (high side only).

    Each value is compared with the median and MAD of the *other* values, so that with two ranks
    the slow one is still measured against the fast one, and the scale is at least ``floor``.
    Returns ``{index: z}``.
    """
    found = {}
    for i, x in enumerate(values):
        others = [v for j, v in enumerate(values) if j != i]
        if not others:
            continue
        med = statistics.median(others)
        mad = statistics.median(abs(v - med) for v in others)
        z = (x - med) / max(1.4826 * mad, floor)
        if z > Z_THRESHOLD:
            found[i] = z
    return found


def stragglers(per_rank):
    """Per-rank lateness and compute medians, and the ranks that stand out (with their z)."""
    waits = [p["probe"]["wait_s"] for p in per_rank]
    iters = min(len(w) for w in waits)
    late = [[] for _ in per_rank]
    for k in range(iters):
        longest = max(w[k] for w in waits)
        for r, w in enumerate(waits):
            late[r].append(longest - w[k])
    lateness = [statistics.median(x) for x in late]
    compute = [statistics.median(p["probe"]["compute_s"]) for p in per_rank]
    compute_floor = COMPUTE_FLOOR_FRACTION * statistics.median(compute)
    return {"lateness_s": lateness, "compute_s": compute, "z_threshold": Z_THRESHOLD,
            "late_ranks": robust_outliers(lateness, LATENESS_FLOOR_S),
            "slow_compute_ranks": robust_outliers(compute, max(compute_floor, 1e-6))}
