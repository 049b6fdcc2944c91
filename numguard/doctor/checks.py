"""Correctness: collectives on known per-rank values, every result compared exactly on every rank.

Values are small whole numbers (all_reduce inputs are -1, 0 or 1), so every partial sum in any
reduction order is exact in every dtype checked, and a difference is a wrong result, not rounding.
Each rank records what it saw; the runner gathers the records and names the ranks that saw a
wrong result.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .launcher import CollectiveError, StepTimeout, all_gather_single, reduce_scatter_single

__all__ = ["ELEMENT_COUNTS", "run_checks"]

# 1 (scalar path), an odd count (uneven chunks in ring algorithms), a larger one (several chunks).
ELEMENT_COUNTS = {"cpu": (1, 1031, 65539), "cuda": (1, 1031, 4 * 1024 * 1024 + 13)}
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64)
# Largest rank count whose sums of -1/0/1 stay exact: bf16 and fp16 keep 8 and 11 bits.
_EXACT_UP_TO = {torch.bfloat16: 256, torch.float16: 2048}
_MAX_GATHERED = 16 * 1024 * 1024  # float32 elements


def _pattern(n, shift, offset=0):
    return ((torch.arange(offset, offset + n, dtype=torch.int64) + shift) % 3) - 1


def _pattern_sum(n, world, offset=0):
    """Sum over ranks of ``_pattern``: every 3 consecutive ranks add -1 + 0 + 1 = 0, so only the
    last ``world % 3`` count (no tensor per rank, whatever the rank count)."""
    total = torch.zeros(n, dtype=torch.int64)
    for r in range(world % 3):
        total += _pattern(n, r, offset)
    return total


def _gathered_elements(n, world):
    # all_gather output and reduce_scatter input hold world * n elements: cap them at 64 MiB.
    return max(1, min(n, _MAX_GATHERED // world))


def _name(dtype):
    return str(dtype).replace("torch.", "")


def _compare(got, expected):
    """None when equal, else a short description of the first difference."""
    got64, exp64 = got.to(torch.float64).cpu(), expected.to(torch.float64).cpu()
    bad = (got64 != exp64) & ~(torch.isnan(got64) & torch.isnan(exp64))
    if not bool(bad.any()):
        return None
    i = int(bad.nonzero()[0])
    return (f"{int(bad.sum())} of {bad.numel()} elements differ; first at index {i}: "
            f"got {got64[i].item():g}, expected {exp64[i].item():g}")


class _Checker:
    def __init__(self, ctx):
        self.ctx = ctx
        self.records = []

    def record(self, name, op, dtype, elements, run):
        entry = {"name": name, "op": op, "dtype": _name(dtype) if dtype else None,
                 "elements": elements, "ok": True, "error": None, "skipped": None}
        try:
            problem = run()
        except (TypeError, ValueError, RuntimeError) as exc:
            if isinstance(exc, (StepTimeout, CollectiveError)):
                raise  # the job is broken, not the dtype unsupported
            # Refused when issued: the same on every rank (a backend without this dtype or op).
            entry["skipped"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            problem = None
        if problem:
            entry["ok"], entry["error"] = False, problem
        self.records.append(entry)

    def all_reduce(self, dtype, n):
        ctx = self.ctx
        t = _pattern(n, ctx.rank).to(dtype).to(ctx.device)
        expected = _pattern_sum(n, ctx.world).to(dtype)
        ctx.step(f"all_reduce sum {_name(dtype)} x{n}",
                 lambda: [dist.all_reduce(t, op=dist.ReduceOp.SUM, async_op=True)])
        return _compare(t, expected)

    def all_gather(self, n):
        ctx = self.ctx
        # (rank % 4096) * 4096 + (k % 4096) < 2**24: exact in float32, and says whose chunk it is.
        def values(r):
            return ((r % 4096) * 4096 + torch.arange(n) % 4096).to(torch.float32)
        out = torch.full((ctx.world * n,), -1.0, device=ctx.device)
        mine = values(ctx.rank).to(ctx.device)
        ctx.step(f"all_gather float32 x{n}",
                 lambda: [all_gather_single()(out, mine, async_op=True)])
        return _compare(out, torch.cat([values(r) for r in range(ctx.world)]))

    def broadcast(self, n, root):
        ctx = self.ctx
        expected = ((torch.arange(n) * 31 + root) % 1000).to(torch.float32)
        t = expected.clone() if ctx.rank == root else torch.full((n,), -1.0)
        t = t.to(ctx.device)
        ctx.step(f"broadcast from rank {root} x{n}",
                 lambda: [dist.broadcast(t, src=root, async_op=True)])
        return _compare(t, expected)

    def reduce_scatter(self, n):
        ctx = self.ctx
        inp = _pattern(ctx.world * n, ctx.rank).to(torch.float32).to(ctx.device)
        out = torch.full((n,), -7.0, device=ctx.device)
        expected = _pattern_sum(n, ctx.world, offset=ctx.rank * n).to(torch.float32)
        rs = reduce_scatter_single()
        ctx.step(f"reduce_scatter sum float32 x{n}",
                 lambda: [rs(out, inp, op=dist.ReduceOp.SUM, async_op=True)])
        return _compare(out, expected)

    def barrier(self):
        self.ctx.step("barrier", lambda: [dist.barrier(async_op=True)])


def run_checks(ctx):
    """Run every check on this rank; returns this rank's records (JSON-ready)."""
    c = _Checker(ctx)
    counts = ELEMENT_COUNTS["cuda" if ctx.device.type == "cuda" else "cpu"]
    for dtype in _DTYPES:
        for n in counts:
            name = f"all_reduce sum {_name(dtype)} x{n}"
            if ctx.world > _EXACT_UP_TO.get(dtype, ctx.world):
                c.records.append({"name": name, "op": "all_reduce", "dtype": _name(dtype),
                                  "elements": n, "ok": True, "error": None,
                                  "skipped": f"sums of {ctx.world} ranks are not exact in {dtype}"})
                continue
            c.record(name, "all_reduce", dtype, n, lambda d=dtype, m=n: c.all_reduce(d, m))
    gathered = sorted({_gathered_elements(n, ctx.world) for n in counts})
    for n in gathered:
        c.record(f"all_gather float32 x{n}", "all_gather", torch.float32, n,
                 lambda m=n: c.all_gather(m))
    for root in sorted({0, ctx.world - 1}):
        n = counts[1]
        c.record(f"broadcast from rank {root} x{n}", "broadcast", torch.float32, n,
                 lambda r=root, m=n: c.broadcast(m, r))
    for n in gathered:
        c.record(f"reduce_scatter sum float32 x{n}", "reduce_scatter", torch.float32, n,
                 lambda m=n: c.reduce_scatter(m))
    c.record("barrier", "barrier", None, 0, c.barrier)
    return c.records
