"""Added latency per checked collective: numguard's check vs Accelerate's debug mode vs
TORCH_DISTRIBUTED_DEBUG=DETAIL (2 ranks, gloo, loopback, CPU).

    python benchmarks/bench_distributed.py [--iters 200] [--reps 7] [--numel 16]

Launch 1 (plain process group), in one process per rank, conditions interleaved block by block:
  - raw `dist.all_reduce` / `dist.all_gather` of a small fp32 tensor, and the same calls with
    `numguard.distributed.guard_collectives()` installed (added = guarded - raw); also with
    `shapes.FAST_PATH = "all_gather"` (every check all-gathers the full records) for comparison;
  - `accelerate.utils.operations.reduce` / `.gather` with `PartialState().debug` off and on
    (ACCELERATE_DEBUG_MODE is read once into `PartialState().debug`; the benchmark sets the
    variable and refreshes that field the same way; added = on - off);
  - `numguard.distributed.check_shapes` alone.
Launch 2: the raw collectives under TORCH_DISTRIBUTED_DEBUG=DETAIL (it wraps the process group at
creation, so it needs its own launch; added = DETAIL launch - plain launch, across launches).
Prints a table and writes benchmarks/results/bench_distributed.json.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(mode: str, args, extra_env: dict) -> dict:
    port = _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.json")
        procs = []
        for r in range(2):
            env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r),
                       WORLD_SIZE="2", LOCAL_RANK=str(r), OMP_NUM_THREADS="1",
                       PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
            env.pop("ACCELERATE_DEBUG_MODE", None)
            env.pop("NUMGUARD_DIST_CHECK", None)
            env.update(extra_env)
            procs.append(subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--worker", mode, "--out", out,
                 "--iters", str(args.iters), "--reps", str(args.reps), "--numel", str(args.numel)],
                env=env))
        try:
            for p in procs:
                p.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise SystemExit(f"benchmark launch {mode!r} timed out after {args.timeout} s")
        if any(p.returncode for p in procs):
            raise SystemExit(f"benchmark launch {mode!r} failed: {[p.returncode for p in procs]}")
        with open(out) as f:
            return json.load(f)


def _worker(mode: str, out: str, iters: int, reps: int, numel: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if mode == "plain":
        from accelerate.state import PartialState
        from accelerate.utils import operations as acc_ops
        from accelerate.utils.environment import parse_flag_from_env

        state = PartialState(cpu=True)  # initialises the gloo process group from the env
    else:
        dist.init_process_group("gloo")
    assert dist.get_backend() == "gloo"
    import numguard.distributed as ngd
    from numguard.distributed import shapes

    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.randn(numel)
    outs = [torch.empty(numel) for _ in range(world)]

    def raw_all_reduce():
        dist.all_reduce(x)

    def raw_all_gather():
        dist.all_gather(outs, x)

    def timed(fn) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return time.perf_counter() - t0

    def guarded(fn, fast_path):
        def block():
            shapes.FAST_PATH = fast_path
            g = ngd.guard_collectives()
            try:
                return timed(fn)
            finally:
                g.remove()
                shapes.FAST_PATH = "all_reduce"
        return block

    def accelerate(fn, debug):
        def block():
            # what PartialState does at start-up, refreshed for this block
            os.environ["ACCELERATE_DEBUG_MODE"] = "1" if debug else "0"
            state.debug = parse_flag_from_env("ACCELERATE_DEBUG_MODE")
            try:
                return timed(lambda: fn(x))
            finally:
                os.environ["ACCELERATE_DEBUG_MODE"] = "0"
                state.debug = False
        return block

    blocks = {"raw all_reduce": lambda: timed(raw_all_reduce),
              "raw all_gather": lambda: timed(raw_all_gather)}
    if mode == "plain":
        blocks.update({
            "numguard all_reduce": guarded(raw_all_reduce, "all_reduce"),
            "numguard all_gather": guarded(raw_all_gather, "all_reduce"),
            "numguard(gather records) all_reduce": guarded(raw_all_reduce, "all_gather"),
            "numguard(gather records) all_gather": guarded(raw_all_gather, "all_gather"),
            "numguard check_shapes alone": lambda: timed(lambda: ngd.check_shapes(x, op="bench")),
            "accelerate reduce (debug off)": accelerate(acc_ops.reduce, False),
            "accelerate reduce (debug on)": accelerate(acc_ops.reduce, True),
            "accelerate gather (debug off)": accelerate(acc_ops.gather, False),
            "accelerate gather (debug on)": accelerate(acc_ops.gather, True),
        })
    for block in blocks.values():  # warm-up
        block()
    samples = {name: [] for name in blocks}
    for _ in range(reps):  # conditions interleaved block by block
        for name, block in blocks.items():
            samples[name].append(block() / iters * 1e6)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"mode": mode,
                       "median_us": {k: statistics.median(v) for k, v in samples.items()},
                       "min_us": {k: min(v) for k, v in samples.items()},
                       "samples_us": samples}, f)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=200, help="calls per timed block")
    ap.add_argument("--reps", type=int, default=7, help="timed blocks per condition")
    ap.add_argument("--numel", type=int, default=16, help="elements of the fp32 tensor")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        _worker(args.worker, args.out, args.iters, args.reps, args.numel)
        return

    plain = _launch("plain", args, {})
    detail = _launch("detail", args, {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
    tables = {}
    for stat in ("median_us", "min_us"):
        m, d = plain[stat], detail[stat]
        rows = []
        for coll, acc_name in (("all_reduce", "reduce"), ("all_gather", "gather")):
            raw = m[f"raw {coll}"]
            ng = m[f"numguard {coll}"] - raw
            acc = m[f"accelerate {acc_name} (debug on)"] - m[f"accelerate {acc_name} (debug off)"]
            det = d[f"raw {coll}"] - raw
            alt = m[f"numguard(gather records) {coll}"] - raw
            rows.append({"collective": coll, "raw_us": raw, "numguard_added_us": ng,
                         "numguard_gather_records_added_us": alt,
                         "accelerate_added_us": acc, "detail_added_us": det,
                         "numguard_over_accelerate": ng / acc if acc > 0 else float("nan"),
                         "numguard_over_detail": ng / det if det > 0 else float("nan")})
        tables[stat] = rows
        label = "median" if stat == "median_us" else "fastest"
        print(f"\n2 ranks, gloo, loopback, fp32[{args.numel}], {label} of {args.reps} blocks x "
              f"{args.iters} calls (microseconds per call; + = added latency)")
        print(f"{'collective':<11} {'raw':>8} {'+numguard':>10} {'+ng(gather)':>12} "
              f"{'+accelerate':>12} {'+DETAIL':>9} {'ng/acc':>7} {'ng/DETAIL':>9}")
        for r in rows:
            print(f"{r['collective']:<11} {r['raw_us']:8.1f} {r['numguard_added_us']:10.1f} "
                  f"{r['numguard_gather_records_added_us']:12.1f} {r['accelerate_added_us']:12.1f} "
                  f"{r['detail_added_us']:9.1f} {r['numguard_over_accelerate']:7.2f} "
                  f"{r['numguard_over_detail']:9.2f}")
    rows = tables["median_us"]
    m = plain["median_us"]
    print("\nmedian per call (us): " + ", ".join(f"{k} {v:.1f}" for k, v in m.items()))
    print("+ng(gather) = numguard if every check all-gathered its 2 KiB records instead of one "
          "all_reduce(MAX) of 2 int64; +DETAIL compares two launches, the rest one process")
    print("target (medians): numguard added <= 1/3 of accelerate added -> "
          + ", ".join(f"{r['collective']}: {'met' if r['numguard_over_accelerate'] <= 1 / 3 else 'NOT met'}"
                      for r in rows))
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    path = os.path.join(HERE, "results", "bench_distributed.json")
    with open(path, "w") as f:
        json.dump({"rows": rows, "rows_fastest": tables["min_us"], "plain": plain,
                   "detail": detail, "numel": args.numel,
                   "iters": args.iters, "reps": args.reps}, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
