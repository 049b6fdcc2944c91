"""CUDA bandwidth of numguard's kernels, measured side by side in one process:

* tensor_stats on 256 MB and 1 GB tensors (fp32, bf16, fp16) against a device-to-device copy
  (bytes read + written) and torch.sum (one read); target: stats >= 80% of copy bandwidth;
* multi_tensor_stats over 1000 tensors of 4 KB against 1000 separate tensor_stats calls;
  target: >= 20x faster;
* multi_tensor_fingerprint over a GPT-2-small-like parameter list against a copy of the same bytes;
  target: no slower than the copy (it reads each byte once, the copy reads and writes it);
* tensor_stats of views read in place (rows with gaps, stride 2, short rows, transposed + sliced)
  against torch.sum of the same view; target <= 1.5x;
* quant_stats per format against torch.sum of the same tensor (issue 24's targets: <= 1.5x for the
  per-tensor formats, <= 2x for the block formats), timed only through a native CUDA kernel: a
  build without one prints the row as SKIPPED with the reason.

Prints a table and writes JSON to benchmarks/results/bench_cuda_bandwidth.json; refuses to time
anything unless numguard's CUDA kernels serve (never the pure-PyTorch fallback).

    python benchmarks/bench_cuda_bandwidth.py [--sizes-mb 256 1024] [--iters 20] [--figures]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

# Run from a checkout: the repository root (numguard built in place) comes first.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import numguard  # noqa: E402
from numguard import _torch_ops, ops

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernels import time_cuda  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def time_wall(fn, reps: int) -> float:
    """Best-of-reps wall seconds of fn including the device work it queued."""
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def bandwidth_rows(sizes_mb, iters):
    rows = []
    device = torch.device("cuda")
    for mb in sizes_mb:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            nbytes = mb * 1024 * 1024
            n = nbytes // torch.empty((), dtype=dtype).element_size()
            x = torch.randn(n, device=device, dtype=torch.float32).to(dtype)
            dst = torch.empty_like(x)
            got = numguard.tensor_stats(x)
            want = _torch_ops.tensor_stats(x)  # reference on the same device
            exact = bool(torch.equal(got, want))
            t_stats = time_cuda(lambda: numguard.tensor_stats(x), iters, warmup=3)
            t_copy = time_cuda(lambda: dst.copy_(x), iters, warmup=3)
            t_sum = time_cuda(lambda: torch.sum(x), iters, warmup=3)
            stats_gbs = nbytes / t_stats / 1e9
            copy_gbs = 2 * nbytes / t_copy / 1e9
            sum_gbs = nbytes / t_sum / 1e9
            rows.append({"size_mb": mb, "dtype": str(dtype).replace("torch.", ""), "stats_ms": t_stats * 1e3,
                         "stats_gb_s": stats_gbs, "copy_gb_s": copy_gbs, "sum_gb_s": sum_gbs,
                         "stats_vs_copy": stats_gbs / copy_gbs, "stats_vs_sum": stats_gbs / sum_gbs,
                         "matches_reference": exact})
            del x, dst
            torch.cuda.empty_cache()
    return rows


def view_rows(iters: int) -> list[dict]:
    """tensor_stats of views read in place (NOTE: [strided reads] in csrc/cuda) against torch.sum
    of the same view, which reads it in place too."""
    x = torch.randn(16384, 8192, device="cuda")  # 512 MB
    views = {"rows with gaps x[:, :8000]": x[:, :8000], "stride-2 rows x[:, ::2]": x[:, ::2],
             "short rows x[:, :6]": x[:, :6], "transposed + sliced x.t()[:4096]": x.t()[:4096]}
    rows = []
    for name, v in views.items():
        exact = bool(torch.equal(numguard.tensor_stats(v), _torch_ops.tensor_stats(v)))
        t_stats = time_cuda(lambda: numguard.tensor_stats(v), iters, warmup=3)
        t_sum = time_cuda(lambda: torch.sum(v), iters, warmup=3)
        rows.append({"view": name, "mb": v.numel() * 4 / 1e6, "stats_ms": t_stats * 1e3, "sum_ms": t_sum * 1e3,
                     "stats_vs_sum": t_stats / t_sum, "matches_reference": exact})
    del x
    torch.cuda.empty_cache()
    return rows


def quant_rows(iters: int) -> list[dict]:
    """quant_stats per format against torch.sum of the same 256 MB bf16 tensor, timed through the
    dispatcher op so that only a native CUDA kernel is ever timed; a format without one is a row
    that says so (SKIPPED) with nothing timed."""
    from numguard import quant as quant_module
    from numguard.schema import QUANT_FORMATS
    have_kernel = (hasattr(torch.ops.numguard, "quant_stats") and
                   torch._C._dispatch_has_kernel_for_dispatch_key("numguard::quant_stats", "CUDA"))
    x = torch.randn(128 << 20, device="cuda").to(torch.bfloat16)
    rows = []
    for code, (name, spec) in enumerate(QUANT_FORMATS.items()):
        target = 1.5 if spec.scale == "tensor" else 2.0
        row = {"format": name, "target": target}
        if not have_kernel:
            row.update(status="SKIPPED", why="no CUDA quant_stats kernel in this build (numguard.quant_stats "
                                              "would run torch operations on CUDA; not timed as if native)")
            rows.append(row)
            continue
        op = torch.ops.numguard.quant_stats.default
        got = op(x, code, 1.0, False)
        want = quant_module._torch_quant_stats(x, spec, None)
        sq = numguard.QUANT_FIELDS.index("sq_error")
        same = [i for i in range(len(numguard.QUANT_FIELDS)) if i != sq]
        exact = bool(torch.equal(got[same], want[same])) and bool(
            torch.isclose(got[sq], want[sq], rtol=1e-9, atol=0.0))
        t_quant = time_cuda(lambda: op(x, code, 1.0, False), iters, warmup=3)
        t_sum = time_cuda(lambda: torch.sum(x), iters, warmup=3)
        row.update(status="timed", quant_ms=t_quant * 1e3, sum_ms=t_sum * 1e3, quant_vs_sum=t_quant / t_sum,
                   matches_torch_path=exact)
        rows.append(row)
    del x
    torch.cuda.empty_cache()
    return rows


def multi_tensor_row(count: int, nbytes: int, reps: int):
    device = torch.device("cuda")
    xs = [torch.randn(nbytes // 4, device=device) for _ in range(count)]
    multi = numguard.multi_tensor_stats(xs)
    singles = torch.stack([numguard.tensor_stats(x) for x in xs])
    exact = bool(torch.equal(multi, singles))
    t_multi = time_wall(lambda: numguard.multi_tensor_stats(xs), reps)
    t_loop = time_wall(lambda: [numguard.tensor_stats(x) for x in xs], reps)
    row = {"tensors": count, "tensor_bytes": nbytes, "multi_ms": t_multi * 1e3, "loop_ms": t_loop * 1e3,
           "speedup": t_loop / t_multi, "matches_separate_calls": exact}
    if ops.native_module() is not None:
        # The dispatcher ops alone, without the Python wrappers' argument checks.
        multi_op, single_op = torch.ops.numguard.multi_tensor_stats.default, torch.ops.numguard.tensor_stats.default
        t_multi_op = time_wall(lambda: multi_op(xs), reps)
        t_loop_op = time_wall(lambda: [single_op(x) for x in xs], reps)
        row.update(op_multi_ms=t_multi_op * 1e3, op_loop_ms=t_loop_op * 1e3, op_speedup=t_loop_op / t_multi_op)
    return row


def fingerprint_row(reps: int = 20) -> dict:
    """multi_tensor_fingerprint over a GPT-2-small-like parameter list, against a copy of its bytes."""
    xs = [torch.randn(n, device="cuda") for n in [50257 * 384, 384 * 1152] + [384 * 384] * 40 + [384] * 60]
    nbytes = sum(x.numel() * x.element_size() for x in xs)
    flat = torch.cat([x.reshape(-1) for x in xs])
    dst = torch.empty_like(flat)
    t_fp = time_wall(lambda: ops.multi_tensor_fingerprint(xs), reps)
    t_copy = time_wall(lambda: dst.copy_(flat), reps)
    return {"tensors": len(xs), "mb": nbytes / 1e6, "fingerprint_us": t_fp * 1e6, "copy_us": t_copy * 1e6,
            "fingerprint_vs_copy": t_fp / t_copy}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--json", default=os.path.join(RESULTS, "bench_cuda_bandwidth.json"))
    parser.add_argument("--figures", action="store_true", help="also print the figures for gpu_check.py")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_cuda_bandwidth: no CUDA device visible; nothing to measure")
        return 1
    native = ops.native_module()
    archs = native.cuda_architectures() if native is not None else []
    if not archs or numguard.backend() != "native":
        # Never time the pure-PyTorch fallback as if it were the kernels.
        print(f"bench_cuda_bandwidth: numguard's CUDA kernels are not in use (backend={numguard.backend()}, "
              f"archs={archs}, reason={ops.fallback_reason()}); nothing measured")
        return 1
    rows = bandwidth_rows(args.sizes_mb, args.iters)
    multi = multi_tensor_row(1000, 4096, reps=10)

    name = torch.cuda.get_device_name()
    print(f"\nnumguard CUDA kernels on {name} (torch {torch.__version__}, backend {numguard.backend()}, "
          f"archs {archs})")
    print(f"{'size':>7} {'dtype':>9} {'stats ms':>9} {'stats GB/s':>11} {'copy GB/s':>10} {'sum GB/s':>9} "
          f"{'stats/copy':>11} {'stats/sum':>10} {'exact':>6}")
    for r in rows:
        print(f"{r['size_mb']:>5}MB {r['dtype']:>9} {r['stats_ms']:>9.3f} {r['stats_gb_s']:>11.0f} "
              f"{r['copy_gb_s']:>10.0f} {r['sum_gb_s']:>9.0f} {r['stats_vs_copy']:>10.2f}x "
              f"{r['stats_vs_sum']:>9.2f}x {str(r['matches_reference']):>6}")
    print(f"multi_tensor_stats over {multi['tensors']} x {multi['tensor_bytes'] // 1024} KB fp32: "
          f"{multi['multi_ms']:.3f} ms vs {multi['loop_ms']:.3f} ms for separate tensor_stats calls: "
          f"{multi['speedup']:.1f}x faster (exact: {multi['matches_separate_calls']})")
    if "op_speedup" in multi:
        print(f"  the same through torch.ops.numguard directly (no Python argument checks): "
              f"{multi['op_multi_ms']:.3f} ms vs {multi['op_loop_ms']:.3f} ms: {multi['op_speedup']:.1f}x faster")
    min_ratio = min(r["stats_vs_copy"] for r in rows)
    print(f"targets: stats >= 0.80x copy bandwidth on >= 256 MB: min {min_ratio:.2f}x "
          f"({'met' if min_ratio >= 0.8 else 'NOT met'}); multi-tensor >= 20x: {multi['speedup']:.1f}x "
          f"({'met' if multi['speedup'] >= 20 else 'NOT met'})")

    views = view_rows(args.iters)
    print("views read in place (512 MB fp32 base), tensor_stats time / torch.sum time of the same view:")
    for r in views:
        print(f"  {r['view']:<34} {r['mb']:>7.0f} MB {r['stats_ms']:>8.3f} ms  {r['stats_vs_sum']:>5.2f}x sum  "
              f"exact: {r['matches_reference']}")
    quant = quant_rows(args.iters)
    print("quant_stats per format on a 256 MB bf16 tensor, time / torch.sum time of the same tensor:")
    for r in quant:
        if r["status"] != "timed":
            print(f"  {r['format']:<14} SKIPPED ({r['why']})")
            continue
        print(f"  {r['format']:<14} {r['quant_ms']:>8.3f} ms  {r['quant_vs_sum']:>5.2f}x sum (target <= "
              f"{r['target']}x: {'met' if r['quant_vs_sum'] <= r['target'] else 'NOT met'})  "
              f"matches the torch-operations path: {r['matches_torch_path']}")

    fingerprint = fingerprint_row()
    print(f"multi_tensor_fingerprint of {fingerprint['tensors']} tensors, {fingerprint['mb']:.1f} MB: "
          f"{fingerprint['fingerprint_us']:.1f} us, {fingerprint['fingerprint_vs_copy']:.2f}x the time of a copy "
          f"of the same bytes")
    if args.figures:
        from gpu_check import figure
        figure("tensor_stats / copy bandwidth, min over sizes and dtypes", min_ratio, ">= 0.80", min_ratio >= 0.8,
               "x")
        figure("multi_tensor_stats vs separate calls (1000 x 4 KB)", multi["speedup"], ">= 20",
               multi["speedup"] >= 20, "x")
        figure("multi_tensor_fingerprint time / copy time", fingerprint["fingerprint_vs_copy"], "<= 1.0",
               fingerprint["fingerprint_vs_copy"] <= 1.0, "x")
        worst_view = max(r["stats_vs_sum"] for r in views)
        figure("tensor_stats / torch.sum time on views read in place, max", worst_view, "<= 1.5",
               worst_view <= 1.5, "x")
        for r in quant:
            if r["status"] == "timed":
                figure(f"quant_stats {r['format']} / torch.sum time", r["quant_vs_sum"], f"<= {r['target']}",
                       r["quant_vs_sum"] <= r["target"], "x")

    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"device": name, "torch": torch.__version__, "backend": numguard.backend(), "archs": archs,
                   "bandwidth": rows, "multi_tensor": multi, "fingerprint": fingerprint, "views": views,
                   "quant": quant}, f, indent=2)
    print(f"wrote {args.json}")
    ok = (all(r["matches_reference"] for r in rows + views) and multi["matches_separate_calls"]
          and all(r.get("matches_torch_path", True) for r in quant))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
