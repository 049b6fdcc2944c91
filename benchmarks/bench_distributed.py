"""Added latency per checked collective: numguard's check vs Accelerate's debug mode vs
TORCH_DISTRIBUTED_DEBUG=DETAIL (2 ranks, gloo, loopback, CPU).

    python benchmarks/bench_distributed.py [--iters 200] [--reps 7] [--numel 16]

Launch 1 (plain process group), in one process per rank, conditions interleaved call by call:
  - raw `dist.all_reduce` / `dist.all_gather` of a small fp32 tensor, and the same calls with
    `numguard.distributed.guard_collectives()` installed (added = guarded - raw); also with
    `shapes.FAST_PATH = "all_gather"` (every check all-gathers the full records) for comparison;
  - `accelerate.utils.operations.reduce` / `.gather` with `PartialState().debug` off and on
    (ACCELERATE_DEBUG_MODE is read once into `PartialState().debug`; the benchmark sets the
    variable and refreshes that field the same way; added = on - off);
  - `numguard.distributed.check_shapes` alone;
  - `accelerate.utils.operations.gather` of a dict of DICT_KEYS tensors with the guard passing
    calls through (`guard.active = False`) and checking (added per tensor vs one checked
    all_gather's added latency).
Launch 2: the raw collectives under TORCH_DISTRIBUTED_DEBUG=DETAIL (it wraps the process group at
creation, so it needs its own launch; added = DETAIL launch - plain launch, across launches).
Launch 3 (cross-rank numerics, `--only cross-rank` runs just this one): the 14M GPT-2 of
bench_hooks.MODELS under DDP on the same 2 gloo ranks, watched by numguard:
  - today's trip exchange (`exchange_trip` with a batch number: a 2-word all_gather) against the
    richer one (the same all_gather carrying numerics.FIELDS, plus the outlier rule on the
    gathered table), interleaved call by call, and the device-side fold of the numbers
    (`checks.batch_numbers` over one training step's frames) timed on its own;
  - one replica check of the parameters (`ReplicaSentinel.check`: fingerprint + one
    all_reduce of the bucket digests) against a plain `all_reduce` of the same parameters
    (flattened), interleaved; and the mean training step time, to state what a check every 100
    steps adds to a step.
Prints a table and writes benchmarks/results/bench_distributed.json (bench_cross_rank.json for
launch 3).
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

DICT_KEYS = 4
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
    raw_all_reduce, raw_all_gather = dist.all_reduce, dist.all_gather

    calls = {"raw all_reduce": lambda: raw_all_reduce(x),
             "raw all_gather": lambda: raw_all_gather(outs, x)}
    if mode == "plain":
        guard = ngd.guard_collectives()  # dist.all_reduce/all_gather are now the checked ones
        checked_all_reduce, checked_all_gather = dist.all_reduce, dist.all_gather

        def gather_records(fn):
            def call():
                shapes.FAST_PATH = "all_gather"
                try:
                    fn()
                finally:
                    shapes.FAST_PATH = "all_reduce"
            return call

        def accelerate(fn, debug):
            # ACCELERATE_DEBUG_MODE is read once into PartialState().debug; set both per call
            flag = "1" if debug else "0"

            def call():
                os.environ["ACCELERATE_DEBUG_MODE"] = flag
                state.debug = parse_flag_from_env("ACCELERATE_DEBUG_MODE")
                fn(x)
            return call

        # a batch-like dict of DICT_KEYS tensors: Accelerate gathers it one tensor at a time
        batch = {f"k{i}": torch.randn(numel) for i in range(DICT_KEYS)}

        def unguarded(fn):
            def call():
                guard.active = False  # the wrappers pass calls straight through
                try:
                    fn()
                finally:
                    guard.active = True
            return call

        calls.update({
            "numguard all_reduce": lambda: checked_all_reduce(x),
            "numguard all_gather": lambda: checked_all_gather(outs, x),
            "numguard(gather records) all_reduce": gather_records(lambda: checked_all_reduce(x)),
            "numguard(gather records) all_gather": gather_records(
                lambda: checked_all_gather(outs, x)),
            "numguard check_shapes alone": lambda: ngd.check_shapes(x, op="bench"),
            "accelerate reduce (debug off)": accelerate(acc_ops.reduce, False),
            "accelerate reduce (debug on)": accelerate(acc_ops.reduce, True),
            "accelerate gather (debug off)": accelerate(acc_ops.gather, False),
            "accelerate gather (debug on)": accelerate(acc_ops.gather, True),
            "accelerate gather dict (unguarded)": unguarded(lambda: acc_ops.gather(batch)),
            "accelerate gather dict (numguard)": lambda: acc_ops.gather(batch),
        })
    names = list(calls)
    samples = {name: [] for name in names}
    perf = time.perf_counter
    for rep in range(reps + 1):  # rep 0 warms up
        dist.barrier()
        # NOTE: conditions alternate call by call (rotating order), so load from other
        # processes on the machine hits every condition alike.
        for i in range(iters):
            k = i % len(names)
            for name in names[k:] + names[:k]:
                fn = calls[name]
                t0 = perf()
                fn()
                if rep:
                    samples[name].append((perf() - t0) * 1e6)
    if mode == "plain":
        guard.remove()
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"mode": mode,
                       "median_us": {k: statistics.median(v) for k, v in samples.items()},
                       "min_us": {k: statistics.quantiles(v, n=10)[0]
                                  for k, v in samples.items()},
                       "calls": {k: len(v) for k, v in samples.items()}}, f)
    dist.barrier()
    dist.destroy_process_group()


def _cross_rank_worker(out: str, iters: int, reps: int) -> None:
    """Launch 3 (see the module docstring)."""
    import torch
    import torch.distributed as dist

    sys.path.insert(0, HERE)
    from bench_hooks import MODELS

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    import numguard
    import numguard.distributed as ngd
    from numguard.distributed import trip_exchange
    from numguard.inspector import checks

    rank = dist.get_rank()
    torch.manual_seed(0)
    model, train_run, _ = MODELS["gpt2-14m"]()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
    insp = numguard.watch(ddp, report_to=None)
    perf = time.perf_counter

    def step():
        loss = train_run(ddp).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    step()
    step_times = []
    for _ in range(3):
        dist.barrier()
        t0 = perf()
        step()
        step_times.append(perf() - t0)

    insp.close(check=False)
    # the device-side fold over the frames of one whole step: an inspector that has not checked
    # yet holds them all
    held = numguard.watch(ddp, report_to=None, check_every=10 ** 6)
    step()
    ring = held._ring
    fold = []
    for _ in range(iters):
        t0 = perf()
        checks.batch_numbers(ring)
        fold.append((perf() - t0) * 1e6)
    frames = len(ring.frames) - ring.last_check_frames
    held.close(check=False)

    flag = torch.zeros((), dtype=torch.int64)
    numbers = [0.0, 1e-3, 1e-4, 1e-9, 0.0, 0.01]
    calls = {"exchange today": lambda i: trip_exchange.exchange_trip(flag, batch_number=i),
             "exchange with numbers": lambda i: trip_exchange.exchange_trip(flag, batch_number=i,
                                                                           numbers=numbers)}
    params = [p for p in ddp.parameters()]
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    sentinel = ngd.ReplicaSentinel(ddp, every=10 ** 9, gradients=False)
    replica_calls = {"replica check (parameters)": lambda i: sentinel.check("parameters", params),
                     "all_reduce of the parameters": lambda i: dist.all_reduce(flat)}
    samples = {name: [] for name in list(calls) + list(replica_calls)}
    for rep in range(reps + 1):  # rep 0 warms up
        dist.barrier()
        names = list(calls)
        for i in range(iters):  # conditions alternate call by call
            for name in (names if i % 2 else names[::-1]):
                t0 = perf()
                calls[name](i)
                if rep:
                    samples[name].append((perf() - t0) * 1e6)
        names = list(replica_calls)
        for i in range(max(3, iters // 50)):
            for name in (names if i % 2 else names[::-1]):
                dist.barrier()
                t0 = perf()
                replica_calls[name](i)
                if rep:
                    samples[name].append((perf() - t0) * 1e6)
    sentinel.remove()
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"median_us": {k: statistics.median(v) for k, v in samples.items()},
                       "calls": {k: len(v) for k, v in samples.items()},
                       "fold_median_us": statistics.median(fold), "frames_per_step": frames,
                       "step_s": statistics.median(step_times),
                       "param_bytes": flat.numel() * flat.element_size(),
                       "params": len(params)}, f)
    dist.barrier()
    dist.destroy_process_group()


def _cross_rank_report(args) -> dict:
    res = _launch("cross-rank", args, {})
    m = res["median_us"]
    today, richer = m["exchange today"], m["exchange with numbers"]
    added = richer - today + res["fold_median_us"]
    check, reduce = m["replica check (parameters)"], m["all_reduce of the parameters"]
    mb = res["param_bytes"] / 1e6
    every_100 = 2 * check / 100 / (res["step_s"] * 1e6)  # parameters and gradients, every 100 steps
    print(f"\ncross-rank numerics, 14M GPT-2, DDP, 2 gloo ranks (medians, {args.reps} x {args.iters} "
          "exchanges, interleaved)")
    print(f"  trip exchange today           {today:10.1f} us")
    print(f"  trip exchange with numbers    {richer:10.1f} us  (+{richer - today:.1f} us)")
    print(f"  device-side fold ({res['frames_per_step']} frames) {res['fold_median_us']:8.1f} us")
    print(f"  added per checked step        {added:10.1f} us = {added / today:.2f}x today's exchange "
          f"(target <= 1x: {'met' if added <= today else 'NOT met'})")
    print(f"  replica check of {res['params']} parameters ({mb:.1f} MB): {check / 1e3:.2f} ms "
          f"= {check / mb:.0f} us/MB; all_reduce of them: {reduce / 1e3:.2f} ms = {reduce / mb:.0f} us/MB; "
          f"ratio {check / reduce:.3f}")
    print(f"  training step {res['step_s'] * 1e3:.1f} ms: parameters + gradients checked every 100 steps "
          f"add {every_100 * 100:.3f}% (target < 1%: {'met' if every_100 < 0.01 else 'NOT met'})")
    result = dict(res, added_per_step_us=added, added_over_today=added / today,
                  replica_over_all_reduce=check / reduce, replica_every_100_fraction=every_100)
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    path = os.path.join(HERE, "results", "bench_cross_rank.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=300, help="calls per condition per round")
    ap.add_argument("--reps", type=int, default=3, help="timed rounds (after one warm-up)")
    ap.add_argument("--numel", type=int, default=16, help="elements of the fp32 tensor")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--only", choices=("collectives", "cross-rank"), default=None,
                    help="run only launches 1-2 (collectives) or launch 3 (cross-rank)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker == "cross-rank":
        _cross_rank_worker(args.out, args.iters, args.reps)
        return
    if args.worker:
        _worker(args.worker, args.out, args.iters, args.reps, args.numel)
        return
    if args.only == "cross-rank":
        _cross_rank_report(args)
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
        label = "median" if stat == "median_us" else "10th percentile"
        print(f"\n2 ranks, gloo, loopback, fp32[{args.numel}], {label} of {args.reps} x "
              f"{args.iters} calls per condition, interleaved call by call (microseconds per "
              "call; + = added latency)")
        print(f"{'collective':<11} {'raw':>8} {'+numguard':>10} {'+ng(gather)':>12} "
              f"{'+accelerate':>12} {'+DETAIL':>9} {'ng/acc':>7} {'ng/DETAIL':>9}")
        for r in rows:
            print(f"{r['collective']:<11} {r['raw_us']:8.1f} {r['numguard_added_us']:10.1f} "
                  f"{r['numguard_gather_records_added_us']:12.1f} {r['accelerate_added_us']:12.1f} "
                  f"{r['detail_added_us']:9.1f} {r['numguard_over_accelerate']:7.2f} "
                  f"{r['numguard_over_detail']:9.2f}")
    rows = tables["median_us"]
    m = plain["median_us"]
    # Accelerate's gather of a dict: one checked all_gather per tensor; numguard's check of the
    # dict's structure rides on the first tensor's check (no collective of its own)
    dict_raw = m["accelerate gather dict (unguarded)"]
    dict_added = m["accelerate gather dict (numguard)"] - dict_raw
    per_check = m["numguard all_gather"] - m["raw all_gather"]
    dict_row = {"keys": DICT_KEYS, "unguarded_us": dict_raw, "numguard_added_us": dict_added,
                "added_per_tensor_us": dict_added / DICT_KEYS,
                "added_per_tensor_over_one_check": dict_added / DICT_KEYS / per_check
                if per_check > 0 else float("nan")}
    print(f"\naccelerate gather of a dict of {DICT_KEYS} fp32[{args.numel}] (median): unguarded "
          f"{dict_raw:.1f} us, +numguard {dict_added:.1f} us = {dict_row['added_per_tensor_us']:.1f} "
          f"us per tensor = {dict_row['added_per_tensor_over_one_check']:.2f}x one checked "
          "all_gather's added latency")
    print("\nmedian per call (us): " + ", ".join(f"{k} {v:.1f}" for k, v in m.items()))
    print("+ng(gather) = numguard if every check all-gathered its 2 KiB records instead of one "
          "all_reduce(MAX) of 2 int64; +DETAIL compares two launches, the rest one process")
    print("target (medians): numguard added <= 1/3 of accelerate added -> "
          + ", ".join(f"{r['collective']}: {'met' if r['numguard_over_accelerate'] <= 1 / 3 else 'NOT met'}"
                      for r in rows))
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    path = os.path.join(HERE, "results", "bench_distributed.json")
    with open(path, "w") as f:
        json.dump({"rows": rows, "rows_fastest": tables["min_us"], "dict_gather": dict_row,
                   "plain": plain,
                   "detail": detail, "numel": args.numel,
                   "iters": args.iters, "reps": args.reps}, f, indent=1)
    print(f"wrote {path}")
    if args.only is None:
        _cross_rank_report(args)


if __name__ == "__main__":
    main()
