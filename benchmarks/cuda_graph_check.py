"""GPU check of numguard's CUDA kernels: records against the pure-PyTorch reference on hostile values,
every dtype and layout, more tensors than one launch holds; then tensor_stats, multi_tensor_stats and
record_ captured in one CUDA graph and replayed (twice, with new input values in between), each
replay checked against eager calls; record_at_cursor_ captured and replayed (each replay records at
the device cursor); a watched torch.compile'd model's call captured in a CUDA graph, its module
frames recorded inside the graph and a NaN planted between replays reported. Exits non-zero on any
mismatch.

    python benchmarks/cuda_graph_check.py [--compiled] [--device cpu]
      --compiled    only the compiled-model capture
      --device cpu  only the records against the reference, on the CPU kernels (no GPU needed)
"""
from __future__ import annotations

import os
import sys
import time

import torch

# Run from a checkout: the repository root (numguard built in place) comes first.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import numguard  # noqa: E402
from numguard import _torch_ops, ops

FLOAT_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn,
                torch.float8_e5m2]
INT_DTYPES = [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool]
failures: list[str] = []


def check(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    got, want = got.cpu(), want.cpu()
    if got.shape != want.shape or not torch.equal(got, want):
        rows = (got != want).reshape(-1, 8).any(dim=1).nonzero().flatten().tolist() if got.shape == want.shape else []
        detail = f"rows {rows[:5]}: got {got.reshape(-1, 8)[rows[:1]].tolist()} want {want.reshape(-1, 8)[rows[:1]].tolist()}" if rows else f"shapes {tuple(got.shape)} vs {tuple(want.shape)}"
        failures.append(f"{name}: {detail}")
        print(f"  FAIL {name}: {detail}")


def reference(xs):
    return torch.stack([_torch_ops.tensor_stats(x.cpu()) for x in xs]) if xs else torch.empty(0, 8, dtype=torch.float64)


def hostile(dtype: torch.dtype, n: int, gen: torch.Generator) -> torch.Tensor:
    """n values on the CPU: mostly normal, with zeros, -0.0, subnormals, extremes, NaN and +-Inf."""
    if dtype in INT_DTYPES:
        if dtype == torch.bool:
            return torch.randint(0, 2, (n,), generator=gen).bool()
        info = torch.iinfo(dtype)
        x = torch.randint(max(info.min, -1000), min(info.max, 1000), (n,), generator=gen, dtype=torch.int64)
        x = x.to(dtype)
        if n > 3:
            x[0], x[1], x[2] = info.min, info.max, 0
        return x
    info = torch.finfo(dtype)
    x = (torch.randn(n, generator=gen, dtype=torch.float64) * 3).to(dtype)
    specials = [0.0, -0.0, info.tiny / 4, -info.tiny / 2, info.max, -info.max, info.tiny, float("nan"),
                float("inf"), float("-inf")]
    for i, v in enumerate(specials):
        if n > 10 * (i + 1):
            x[(i * 7919 + 13) % n] = torch.tensor(v, dtype=torch.float64).to(dtype)
    return x


def correctness(device) -> None:
    gen = torch.Generator().manual_seed(0)
    sizes = [0, 1, 7, 15, 16, 17, 255, 256, 257, 4095, 4096, 4097, 8191, 65536 + 3, 1 << 20, (1 << 22) + 5]
    for dtype in FLOAT_DTYPES + INT_DTYPES:
        xs = [hostile(dtype, n, gen) for n in sizes]
        want = reference(xs)
        dev = [x.to(device) for x in xs]
        check(f"multi_tensor_stats {dtype} sizes", numguard.multi_tensor_stats(dev), want)
        for x, w in zip(dev, want):
            check(f"tensor_stats {dtype} n={x.numel()}", numguard.tensor_stats(x), w)
        # Misaligned starts (scalar heads) and layouts.
        big = dev[-1]
        views = {"offset1": big[1:], "offset3_short": big[3:1000], "2d_t": big[: 1024 * 1023].reshape(1024, 1023).t(),
                 "sliced": big[: 1024 * 1024].reshape(1024, 1024)[:, 5:900], "step2": big[::2],
                 "expanded": big[:300].reshape(300, 1).expand(300, 17), "scalar_expand": big[5].expand(4, 9),
                 "channels_last": big[: 2 * 3 * 32 * 33].reshape(2, 3, 32, 33).contiguous(
                     memory_format=torch.channels_last) if dtype not in (torch.bool,) else big[:10]}
        for name, v in views.items():
            check(f"{dtype} {name}", numguard.tensor_stats(v), reference([v])[0])
        check(f"{dtype} views in one call", numguard.multi_tensor_stats(list(views.values())),
              reference(list(views.values())))
    # More tensors than one launch holds, mixed dtypes and sizes.
    many = [hostile(FLOAT_DTYPES[i % 6] if i % 3 else INT_DTYPES[i % 6], (i * 37) % 3000, gen) for i in range(500)]
    check("500 mixed tensors", numguard.multi_tensor_stats([x.to(device) for x in many]), reference(many))
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def graph_capture(device) -> None:
    gen = torch.Generator().manual_seed(1)
    # Finite values well inside fp16 range, so that nothing trips until a replay plants it.
    xs = [torch.randn(5000, generator=gen).to(device, torch.float16),
          torch.randn((1 << 20) + 3, generator=gen).to(device),
          torch.randn(999, generator=gen).to(device, torch.bfloat16)[1:],
          torch.ones(3, 4, device=device).t()]
    xs += [torch.randn(97 + i, device=device) for i in range(200)]  # several launches
    ring, state = ops.new_ring(8, device)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside capture, as CUDA graphs require
        numguard.tensor_stats(xs[1])
        numguard.multi_tensor_stats(xs)
        numguard.record_(ring, state, xs[:4], 5, 0.5)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        single = numguard.tensor_stats(xs[1])
        many = numguard.multi_tensor_stats(xs)
        numguard.record_(ring, state, xs[:4], 5, 0.5)

    for replay in range(3):
        ring.zero_()
        ops.reset_state(state)
        if replay == 1:  # new values in place, then a NaN: the graph must see them
            xs[1].normal_()
            xs[0][17] = float("nan")
        if replay == 2:
            xs[0][17] = 0.0
            xs[0][5] = 40000.0  # fp16 above 0.5 * finfo.max: headroom flag at position 5
        graph.replay()
        torch.cuda.synchronize()
        eager = numguard.multi_tensor_stats(xs)
        check(f"graph replay {replay}: tensor_stats", single, eager[1])
        check(f"graph replay {replay}: multi_tensor_stats", many, eager)
        rows = [(5 + i) % 8 for i in range(4)]
        check(f"graph replay {replay}: record_ rows", ring[rows], eager[:4])
        want_state = {0: [0, -1, 0, -1], 1: [1, 5, 0, -1], 2: [0, -1, 1, 5]}[replay]
        got_state = state.cpu().tolist()
        if got_state != want_state:
            failures.append(f"graph replay {replay}: state {got_state} != {want_state}")
            print(f"  FAIL graph replay {replay}: state {got_state} != {want_state}")
    # Freeze on trip across replays: trip, then change the data; the ring must not change.
    ring.zero_()
    ops.reset_state(state)
    xs[0][17] = float("inf")
    graph.replay()
    frozen = ring.clone()
    xs[0][17] = 1.0
    xs[1].fill_(3.0)
    graph.replay()
    torch.cuda.synchronize()
    check("frozen ring across replays", ring, frozen)
    if state.cpu().tolist()[:2] != [1, 5]:
        failures.append(f"frozen state {state.cpu().tolist()}")


def no_sync(device) -> None:
    xs = [torch.randn(n, device=device) for n in (0, 3, 4097, 1 << 20)]
    ring, state = ops.new_ring(4, device)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        numguard.tensor_stats(xs[2])
        numguard.multi_tensor_stats(xs)
        numguard.record_(ring, state, xs, 0, 0.5)
    except RuntimeError as exc:
        failures.append(f"host sync inside an op: {exc}")
    finally:
        torch.cuda.set_sync_debug_mode("default")


# -- recording inside compiled graphs (record_at_cursor_) ---------------------------------------

def graph_cursor_capture(device) -> None:
    """record_at_cursor_ captured once and replayed: each replay writes at the position the
    device cursor holds then (no host counter baked into the graph), logs its calls, advances."""
    from numguard import schema

    base = schema.GRAPH_POSITION_BASE
    gen = torch.Generator().manual_seed(2)
    xs = [torch.randn(4097, generator=gen).to(device), torch.randn(300, generator=gen).to(device, torch.float16),
          torch.ones(3, 4, device=device).t()]
    ring, state = ops.new_ring(16, device)
    cursor, log = ops.new_graph_cursor(8, device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ops.record_at_cursor_(ring, state, cursor, log, xs[:1], 0, 0.5)  # warm-up, then start over
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    ring.zero_()
    cursor.copy_(ops.new_graph_cursor(8, device)[0])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.record_at_cursor_(ring, state, cursor, log, xs[:2], 3, 0.5)
        ops.record_at_cursor_(ring, state, cursor, log, xs[2:], 4, 0.5)
    eager = numguard.multi_tensor_stats(xs)
    for replay in range(3):
        cursor[schema.CURSOR_BATCH].fill_(replay)
        graph.replay()
        torch.cuda.synchronize()
        start = base + 3 * replay
        rows = [(start + i) % 16 for i in range(3)]
        check(f"cursor replay {replay}: rows", ring[rows], eager)
        want_log = [[3, start, replay], [4, start + 2, replay]]
        got_log = log[[2 * replay, 2 * replay + 1]].cpu().tolist()
        if got_log != want_log:
            failures.append(f"cursor replay {replay}: log {got_log} != {want_log}")
    if cursor.cpu().tolist() != [base + 9, 6, 2] or state.cpu().tolist() != [0, -1, 0, -1]:
        failures.append(f"cursor after replays {cursor.cpu().tolist()}, state {state.cpu().tolist()}")
    xs[1][7] = float("nan")  # the 4th replay trips at its 2nd record and freezes cursor and log
    graph.replay()
    frozen = [t.clone() for t in (ring, cursor, log)]
    graph.replay()
    torch.cuda.synchronize()
    # The 4th replay's first call (records at base+9, base+10) trips and is logged; its second is not.
    if state.cpu().tolist()[:2] != [1, base + 10] or cursor.cpu().tolist()[:2] != [base + 11, 7]:
        failures.append(f"trip in a replay: state {state.cpu().tolist()}, cursor {cursor.cpu().tolist()}")
    for name, before, now in zip(("ring", "cursor", "log"), frozen, (ring, cursor, log)):
        if not torch.equal(before, now):
            failures.append(f"frozen {name} changed in a replay after the trip")


def compiled_step_capture(device) -> None:
    """A watched torch.compile'd model's call captured in a CUDA graph: its submodules' frames are
    recorded inside the compiled graph at the device cursor, each replay's frames land after the
    previous ones, and a NaN planted between replays is reported naming its submodule."""
    import torch._dynamo
    from torch import nn

    from numguard import schema

    class Scaled(nn.Module):
        """Multiplies by a device scalar (set to NaN to plant one without retracing)."""

        def __init__(self):
            super().__init__()
            self.register_buffer("scale", torch.ones(()))

        def forward(self, x):
            return x * self.scale

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), Scaled(), nn.Linear(128, 8)).to(device)
    compiled = torch.compile(model)
    # No batch-end read inside the captured call (a read cannot be captured): the check runs after
    # the replays (check_now).
    inspector = numguard.watch(compiled, report_to=None, check_every=1 << 30)
    x = torch.randn(32, 64, device=device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(3):
            compiled(x)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    recorder = inspector._graph
    if recorder is None or not recorder.used:
        failures.append("compiled capture: no frame was recorded inside the compiled graph")
        inspector.close(check=False)
        return
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph), torch.no_grad():
            compiled(x)
    except Exception as exc:  # noqa: BLE001 - reported as a failure of this check
        failures.append(f"compiled capture: {type(exc).__name__}: {exc}")
        inspector.close(check=False)
        return
    calls = recorder.cursor[schema.CURSOR_CALLS].item()
    per_call = 5  # the model's own frame and its four submodules'
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    got = recorder.cursor[schema.CURSOR_CALLS].item() - calls
    if got != 3 * per_call:
        failures.append(f"compiled capture: 3 replays logged {got} module calls, want {3 * per_call}")
    frames, _, _ = recorder.logged_frames(0)
    names = [f.owner.name for f in frames[-per_call:]]
    if names != ["0", "1", "2", "3", ""]:
        failures.append(f"compiled capture: last replay's frames {names}")
    starts = [f.start for f in frames]
    if starts != sorted(starts) or len(set(starts)) != len(starts):
        failures.append("compiled capture: replays wrote over each other's frames")
    model[2].scale.fill_(float("nan"))
    graph.replay()
    try:
        inspector.check_now("after the CUDA graph replays")
        failures.append("compiled capture: the NaN planted between replays was not reported")
    except numguard.NonFiniteError as exc:
        if exc.module != "2" or exc.labels != ["output"]:
            failures.append(f"compiled capture: report names {exc.module!r} {exc.labels}, want '2' ['output']")
    finally:
        inspector.close(check=False)
        torch._dynamo.reset()


def main() -> int:
    if "--device" in sys.argv[1:] and sys.argv[sys.argv.index("--device") + 1:][:1] == ["cpu"]:
        return run_checks(torch.device("cpu"), (("correctness vs reference (CPU kernels)", correctness),))
    if not torch.cuda.is_available():
        print("cuda_graph_check: no CUDA device visible")
        return 1
    native = ops.native_module()
    if native is None or not native.cuda_architectures():
        print(f"cuda_graph_check: numguard has no CUDA kernels (backend={numguard.backend()}, "
              f"reason={ops.fallback_reason()})")
        return 1
    device = torch.device("cuda")
    print(f"cuda_graph_check: {torch.cuda.get_device_name()} archs={native.cuda_architectures()}")
    checks = (("correctness vs reference", correctness), ("CUDA graph capture/replay", graph_capture),
              ("no host sync", no_sync), ("record_at_cursor_ in a CUDA graph", graph_cursor_capture))
    if "--compiled" in sys.argv[1:]:  # its own gpu_check phase: torch.compile takes a while
        checks = (("watched compiled call in a CUDA graph", compiled_step_capture),)
    return run_checks(device, checks)


def run_checks(device, checks) -> int:
    if numguard.backend() != "native":
        print(f"cuda_graph_check: numguard's native kernels are not in use ({ops.fallback_reason()})")
        return 1
    for name, fn in checks:
        start = time.perf_counter()
        before = len(failures)
        fn(device)
        print(f"  {name}: {'ok' if len(failures) == before else 'FAILED'} ({time.perf_counter() - start:.1f}s)")
    if failures:
        print(f"cuda_graph_check: {len(failures)} failure(s)")
        return 1
    print("cuda_graph_check: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
