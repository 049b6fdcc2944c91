"""Speed of numguard's tensor_stats kernel, measured side by side in one process against:

* torch.sum: a one-pass reduction, the memory-bandwidth reference;
* the per-tensor sequence of Transformers' DebugUnderflowOverflow: abs, min, max, isnan().any(),
  isinf().any() and four .item() calls;
* numguard's pure-PyTorch fallback (numguard._torch_ops.tensor_stats).

CPU: fp32/bf16/fp16, 4 KB up to --max-mb (default 64 MB; up to 512 MB on request), on 1 thread and
on all threads. Conditions are interleaved round by round and summarized by their median (the
machine may be shared); ratios are of medians. Targets (1 thread, 64 MB): tensor_stats <= 1.3x
torch.sum, and >= 10x faster than the Transformers sequence.

CUDA (when a GPU is present): the same comparison timed with CUDA events, bandwidth in GB/s
against a device-to-device copy, and multi_tensor_stats over 1000 tensors of 4 KB against 1000
separate tensor_stats calls.

Prints a table and writes benchmarks/results/bench_kernels.json.

    python benchmarks/bench_kernels.py [--max-mb 64 | --sizes-mb 64 512] [--rounds 7] [--threads 1]
                                       [--cuda-only | --cpu-only]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import platform
import statistics
import time

import torch

# Run from a checkout: the repository root (numguard built in place) comes first.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import numguard  # noqa: E402
from numguard import _torch_ops

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
KB = 1024
MB = 1024 * 1024


def transformers_sequence(x):
    """What DebugUnderflowOverflow does per tensor: two reductions of |x|, two non-finite checks,
    four blocking reads to the host."""
    abs_x = x.abs()
    return (abs_x.min().item(), abs_x.max().item(), torch.isnan(x).any().item(), torch.isinf(x).any().item())


def methods():
    native = numguard.backend() == "native"
    out = {}
    if native:
        out["numguard"] = torch.ops.numguard.tensor_stats.default
    out["torch.sum"] = torch.sum
    out["transformers"] = transformers_sequence
    out["fallback"] = _torch_ops.tensor_stats
    return out


def size_list(max_mb):
    sizes = []
    size = 4 * KB
    while size <= max_mb * MB:
        sizes.append(size)
        size *= 8 if size < MB else 4
    if sizes and sizes[-1] != max_mb * MB and max_mb * MB >= 4 * KB:
        sizes.append(max_mb * MB)
    return sizes


def make_input(nbytes, dtype, device="cpu"):
    n = nbytes // torch.empty((), dtype=dtype).element_size()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=gen, dtype=torch.float32).to(dtype)
    return x.to(device)


def human(nbytes):
    return f"{nbytes // MB} MB" if nbytes >= MB else f"{nbytes // KB} KB"


# ---------------------------------------------------------------------------------------------
# CPU

def time_cpu(fn, x, inner):
    """(wall, calling-thread CPU) seconds per call. On one thread all the work runs on the calling
    thread, so its CPU time is the cost of the call without the time other processes of a shared
    machine held the core."""
    c0, t0 = time.thread_time(), time.perf_counter()
    for _ in range(inner):
        fn(x)
    return (time.perf_counter() - t0) / inner, (time.thread_time() - c0) / inner


def bench_cpu(sizes, rounds, thread_counts, min_seconds):
    rows = []
    fns = methods()
    for nbytes in sizes:
        for dname, dtype in DTYPES.items():
            x = make_input(nbytes, dtype)
            for threads in thread_counts:
                torch.set_num_threads(threads)
                # Repeat small inputs inside one timing so each sample lasts >= min_seconds.
                inner = {}
                for name, fn in fns.items():
                    fn(x)  # warm up (page faults, lazy init)
                    once = time_cpu(fn, x, 1)[0]
                    inner[name] = max(1, min(10000, int(min_seconds / max(once, 1e-7))))
                samples = {name: [] for name in fns}
                cpu_samples = {name: [] for name in fns}
                for r in range(rounds):
                    order = list(fns.items())
                    if r % 2:
                        order.reverse()  # interleave: no method always runs right after another
                    for name, fn in order:
                        wall, cpu = time_cpu(fn, x, inner[name])
                        samples[name].append(wall)
                        cpu_samples[name].append(cpu)
                row = {"device": "cpu", "dtype": dname, "bytes": nbytes, "threads": threads,
                       "median_s": {k: statistics.median(v) for k, v in samples.items()},
                       "min_s": {k: min(v) for k, v in samples.items()}}
                if threads == 1:
                    row["median_thread_cpu_s"] = {k: statistics.median(v) for k, v in cpu_samples.items()}
                add_ratios(row)
                rows.append(row)
                print_row(row)
            del x
    return rows


def add_ratios(row):
    med = row["median_s"]
    if "numguard" in med:
        ng = med["numguard"]
        row["numguard_over_sum"] = ng / med["torch.sum"]
        row["transformers_over_numguard"] = med["transformers"] / ng
        row["fallback_over_numguard"] = med["fallback"] / ng
        row["numguard_over_sum_min"] = row["min_s"]["numguard"] / row["min_s"]["torch.sum"]
        row["numguard_GBps"] = row["bytes"] / ng / 1e9
    row["transformers_over_sum"] = med["transformers"] / med["torch.sum"]
    cpu = row.get("median_thread_cpu_s")
    if cpu and "numguard" in cpu:
        row["numguard_over_sum_thread_cpu"] = cpu["numguard"] / cpu["torch.sum"]
        row["transformers_over_numguard_thread_cpu"] = cpu["transformers"] / cpu["numguard"]


HEADER = (f"{'device':6} {'dtype':5} {'size':>7} {'thr':>3} | {'numguard':>10} {'torch.sum':>10} {'transf.':>10} "
          f"{'fallback':>10} | {'ng/sum':>6} {'(min)':>6} {'(cpu)':>6} {'tf/ng':>7} {'fb/ng':>6} {'ng GB/s':>8}")


def fmt_time(s):
    return f"{s * 1e3:8.3f}ms" if s >= 1e-4 else f"{s * 1e6:8.2f}us"


def print_row(row):
    med = row["median_s"]
    cells = [fmt_time(med[k]) if k in med else f"{'-':>10}" for k in ("numguard", "torch.sum", "transformers",
                                                                        "fallback")]
    cpu_ratio = f"{row['numguard_over_sum_thread_cpu']:6.2f}" if "numguard_over_sum_thread_cpu" in row else f"{'-':>6}"
    ratio = (f"{row['numguard_over_sum']:6.2f} {row['numguard_over_sum_min']:6.2f} {cpu_ratio} "
             f"{row['transformers_over_numguard']:7.1f} {row['fallback_over_numguard']:6.1f} "
             f"{row['numguard_GBps']:8.1f}") if "numguard_over_sum" in row else "(native kernels not loaded)"
    print(f"{row['device']:6} {row['dtype']:5} {human(row['bytes']):>7} {row['threads']:>3} | {' '.join(cells)} | "
          f"{ratio}", flush=True)


# ---------------------------------------------------------------------------------------------
# CUDA

def time_cuda(fn, iters, warmup=0):
    """Mean seconds per call of fn on the current stream (CUDA events)."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if warmup:
        torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def bench_cuda(sizes, rounds):
    rows = []
    fns = methods()
    for nbytes in sizes:
        for dname, dtype in DTYPES.items():
            x = make_input(nbytes, dtype, "cuda")
            dst = torch.empty_like(x)
            calls = {name: (lambda fn=fn: fn(x)) for name, fn in fns.items()}
            calls["copy"] = lambda: dst.copy_(x)
            for call in calls.values():
                call()
            torch.cuda.synchronize()
            iters = {}
            for name, call in calls.items():
                once = time_cuda(call, 1)
                iters[name] = max(1, min(200, int(0.02 / max(once, 1e-6))))
            samples = {name: [] for name in calls}
            for r in range(rounds):
                order = list(calls.items())
                if r % 2:
                    order.reverse()
                for name, call in order:
                    samples[name].append(time_cuda(call, iters[name]))
            row = {"device": "cuda", "dtype": dname, "bytes": nbytes, "threads": 0,
                   "median_s": {k: statistics.median(v) for k, v in samples.items()},
                   "min_s": {k: min(v) for k, v in samples.items()}}
            add_ratios(row)
            med = row["median_s"]
            row["copy_GBps"] = 2 * nbytes / med["copy"] / 1e9  # read + write
            row["sum_GBps"] = nbytes / med["torch.sum"] / 1e9
            if "numguard" in med:
                row["numguard_fraction_of_copy"] = row["numguard_GBps"] / row["copy_GBps"]
            rows.append(row)
            print_row(row)
            print(f"{'':6} copy {row['copy_GBps']:.0f} GB/s, sum {row['sum_GBps']:.0f} GB/s"
                  + (f", numguard {row['numguard_GBps']:.0f} GB/s = {row['numguard_fraction_of_copy']:.0%} of copy"
                     if "numguard" in med else ""), flush=True)
            del x, dst
    return rows


def bench_cuda_many(rounds, count=1000, nbytes=4 * KB):
    xs = [make_input(nbytes, torch.float32, "cuda") for _ in range(count)]
    multi = numguard.multi_tensor_stats
    single = numguard.tensor_stats

    def separate():
        for x in xs:
            single(x)

    multi(xs)
    separate()
    torch.cuda.synchronize()
    samples = {"multi_tensor_stats": [], "separate_calls": []}
    for _ in range(rounds):
        samples["multi_tensor_stats"].append(time_cuda(lambda: multi(xs), 5))
        samples["separate_calls"].append(time_cuda(separate, 1))
    med = {k: statistics.median(v) for k, v in samples.items()}
    row = {"device": "cuda", "what": f"{count} x {human(nbytes)} fp32", "median_s": med,
           "separate_over_multi": med["separate_calls"] / med["multi_tensor_stats"]}
    print(f"cuda   {row['what']}: multi_tensor_stats {fmt_time(med['multi_tensor_stats'])}, "
          f"{count} tensor_stats calls {fmt_time(med['separate_calls'])}, "
          f"ratio {row['separate_over_multi']:.1f}x (target >= 20x)", flush=True)
    return row


# ---------------------------------------------------------------------------------------------

def bench_quant(rounds, nbytes, device="cpu", dtype=torch.float32):
    """numguard.quant_stats of each format against torch.sum of the same tensor of `dtype` (1 thread
    on the CPU), interleaved rounds, medians. On the CPU the ratio is also taken of the calling
    thread's CPU time (time_cpu), which a shared machine disturbs less than the wall clock.
    Targets (issue: low-precision formats): <= 1.5x for the per-tensor formats, <= 2x for the block
    formats."""
    x = make_input(nbytes, dtype, device)
    dtype_name = str(dtype).replace("torch.", "")
    rows = []
    cuda = torch.device(device).type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for fmt, spec in numguard.schema.QUANT_FORMATS.items():
        fns = {"sum": lambda t: torch.sum(t), "quant": lambda t, f=fmt: numguard.quant_stats(t, f)}
        times = {k: [] for k in fns}
        cpu_times = {k: [] for k in fns}
        for _ in range(rounds):
            for k, fn in fns.items():
                fn(x)
                sync()
                c0, t0 = time.thread_time(), time.perf_counter()
                fn(x)
                sync()
                times[k].append(time.perf_counter() - t0)
                cpu_times[k].append(time.thread_time() - c0)
        med = {k: statistics.median(v) for k, v in times.items()}
        cpu_med = {k: statistics.median(v) for k, v in cpu_times.items()}
        target = 1.5 if spec.block == 0 else 2.0
        ratio = med["quant"] / med["sum"]
        cpu_ratio = None if cuda else cpu_med["quant"] / cpu_med["sum"]
        judged = ratio if cpu_ratio is None else cpu_ratio
        rows.append({"format": fmt, "dtype": dtype_name, "bytes": nbytes, "device": device, "quant_s": med["quant"],
                     "sum_s": med["sum"], "ratio": ratio, "cpu_ratio": cpu_ratio, "target": target,
                     "met": judged <= target})
        cpu_text = "" if cpu_ratio is None else f", CPU time {cpu_ratio:5.2f}x"
        print(f"  quant_stats {fmt:<14} {dtype_name:<8} {human(nbytes)} {device}: {med['quant'] * 1e3:8.2f} ms, "
              f"torch.sum "
              f"{med['sum'] * 1e3:7.2f} ms: wall {ratio:6.2f}x{cpu_text} (target <= {target:g}: "
              f"{'met' if judged <= target else 'NOT met'})")
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-mb", type=int, default=64, help="largest CPU size in MB (default 64; up to 512)")
    parser.add_argument("--sizes-mb", type=float, nargs="*", default=None,
                        help="exact CPU sizes in MB instead of the 4 KB..--max-mb sweep (e.g. --sizes-mb 64)")
    parser.add_argument("--cuda-max-mb", type=int, default=512, help="largest CUDA size in MB (default 512)")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds per condition (median taken)")
    parser.add_argument("--min-ms", type=float, default=20.0,
                        help="minimum duration of one CPU timing sample (small inputs repeat inside it)")
    parser.add_argument("--threads", type=int, nargs="*", default=None,
                        help="CPU thread counts (default: 1 and all)")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--cuda-only", action="store_true", help="skip the CPU sweep")
    group.add_argument("--cpu-only", action="store_true", help="skip the CUDA sweep")
    parser.add_argument("--output", default=os.path.join(RESULTS, "bench_kernels.json"))
    parser.add_argument("--quant", action="store_true",
                        help="only numguard.quant_stats of each format against torch.sum (16 MB float32, bfloat16, "
                             "float16)")
    args = parser.parse_args(argv)
    if args.quant:
        torch.set_num_threads(1)
        print(f"numguard.quant_stats against torch.sum, 1 CPU thread; torch {torch.__version__}")
        rows = []
        for dtype in (torch.float32, torch.bfloat16, torch.float16):  # what training tensors are
            rows += bench_quant(args.rounds, 16 * MB, dtype=dtype)
        if torch.cuda.is_available():
            rows += bench_quant(args.rounds, 256 * MB, "cuda")
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        with open(args.output.replace("bench_kernels.json", "bench_quant.json"), "w") as f:
            json.dump(rows, f, indent=1)
        return

    native = numguard.backend() == "native"
    caps = numguard.ops.native_module().cpu_capabilities() if native else []
    all_threads = torch.get_num_threads()
    threads = args.threads or sorted({1, all_threads})
    print(f"numguard backend={numguard.backend()} {' '.join(caps)}; torch {torch.__version__}; "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch threads {all_threads}")
    result = {"backend": numguard.backend(), "cpu_capabilities": caps, "torch": torch.__version__,
              "cpu_count": os.cpu_count(), "rounds": args.rounds, "cpu": [], "cuda": [], "cuda_many": None}
    print(HEADER)
    if not args.cuda_only:
        sizes = [int(mb * MB) for mb in args.sizes_mb] if args.sizes_mb else size_list(args.max_mb)
        result["cpu"] = bench_cpu(sizes, args.rounds, threads, args.min_ms / 1e3)
        torch.set_num_threads(all_threads)
    if not args.cpu_only:
        if torch.cuda.is_available():
            cuda_sizes = [s for s in (4 * KB, MB, 16 * MB, 256 * MB, 512 * MB) if s <= args.cuda_max_mb * MB]
            result["cuda"] = bench_cuda(cuda_sizes, args.rounds)
            result["cuda_many"] = bench_cuda_many(args.rounds)
        else:
            print("cuda: no GPU, CUDA columns skipped")

    print("\nSummary (1 thread, largest size; ratios of medians, wall clock / calling-thread CPU time):")
    largest = max((row["bytes"] for row in result["cpu"]), default=0)
    for row in result["cpu"]:
        if row["threads"] == 1 and row["bytes"] == largest and "numguard_over_sum" in row:
            print(f"  {row['dtype']} {human(row['bytes'])}: tensor_stats = {row['numguard_over_sum']:.2f}x / "
                  f"{row['numguard_over_sum_thread_cpu']:.2f}x torch.sum (target <= 1.3); Transformers sequence = "
                  f"{row['transformers_over_numguard']:.1f}x / {row['transformers_over_numguard_thread_cpu']:.1f}x "
                  "tensor_stats (target >= 10)")
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
