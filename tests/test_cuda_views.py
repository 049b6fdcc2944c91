"""The CUDA stats kernel on views it reads in place (NOTE: [strided reads] in csrc/cuda) and its one
launch per frame (NOTE: [one launch per frame], [launch counters]): records equal to the CPU
kernels', exactly, on hostile values, every dtype and layout, for any launch geometry (one tensor
or hundreds per call, one block or a whole wave per tensor), on several streams at once and inside
CUDA graphs. They need a GPU: benchmarks/gpu_check.sh runs them in its kernel phase. The same
logic is emulated on the host by tests/test_cuda_build.py, which runs everywhere."""
import pytest
import torch

import numguard
from numguard import ops, schema
from conftest import no_host_sync, requires_cuda, requires_native
from test_kernels import ALL_DTYPES, FLOAT_DTYPES, layout_cases, planted

pytestmark = [requires_native, requires_cuda]


def same_layout(x, device):
    """x's view (sizes, strides, offset) rebuilt over a copy of its storage on `device`."""
    flat = torch.empty(0, dtype=x.dtype, device=x.device).set_(x.untyped_storage()).view(-1)
    return flat.to(device).as_strided(x.shape, x.stride(), x.storage_offset())


def cpu_records(xs):
    """The native CPU kernels' records of the same views."""
    return numguard.multi_tensor_stats([same_layout(x, "cpu") for x in xs])


def on_cuda(views):
    return {name: same_layout(x, "cuda") for name, x in views.items()}


def big_views(dtype, gen):
    """Views large enough to spread over many blocks, whose rows straddle the blocks' chunks: long
    unit-stride rows at every alignment, long rows of stride 3, short rows, one column, and more
    merged dims than the kernel walks (copied first)."""
    x = planted(dtype, 3001 * 1025, gen).reshape(3001, 1025)
    many = planted(dtype, 2 ** 16, gen)
    return {
        "long_rows": x[:, 1:1000],
        "long_rows_odd_start": x[7:, 3:1021],
        "long_rows_stride_3": x[:, ::3],
        "short_rows": x[:, 5:9],
        "column": x[:, 17],
        "transposed_sliced": x.t()[::2, 100:2900],
        "seven_merged_dims": many.as_strided([3] * 7, [3 ** (7 - d) + 1 for d in range(7)]),
    }


def assert_equal_records(got, want, what):
    got = got.cpu()
    bad = ~((got == want) | (got.isnan() & want.isnan()))
    rows = bad.reshape(-1, 8).any(-1)
    assert not rows.any(), (f"{what}: rows {rows.nonzero().flatten().tolist()[:5]} differ: "
                            f"{got.reshape(-1, 8)[rows][:2].tolist()} vs {want.reshape(-1, 8)[rows][:2].tolist()}")


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_views_match_the_cpu_kernels(dtype):
    gen = torch.Generator().manual_seed(11)
    views = {**layout_cases(dtype, gen), **big_views(dtype, gen)}
    cuda_views = on_cuda(views)
    want = cpu_records(list(views.values()))
    with no_host_sync("cuda"):
        singles = torch.stack([numguard.tensor_stats(x) for x in cuda_views.values()])
        together = numguard.multi_tensor_stats(list(cuda_views.values()))  # more strided views than one launch
    for i, name in enumerate(views):
        assert_equal_records(singles[i:i + 1], want[i:i + 1], f"{dtype} {name} alone")
    assert_equal_records(together, want, f"{dtype} all views in one call")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_recorded_views_match_the_cpu_kernels(dtype):
    """record_ and record_at_cursor_ of every view: the ring rows and the state of the CPU kernels."""
    gen = torch.Generator().manual_seed(12)
    views = {**layout_cases(dtype, gen), **big_views(dtype, gen)}
    xs, cpu_xs = list(on_cuda(views).values()), list(views.values())
    rows = len(xs) + 3
    got, want = {}, {}
    for device, views_here, out in (("cuda", xs, got), ("cpu", cpu_xs, want)):
        ring, state = ops.new_ring(rows, device)
        cursor_ring, cursor_state = ops.new_ring(rows, device)
        cursor, log = ops.new_graph_cursor(4, device)
        with no_host_sync(device):
            ops.record_(ring, state, views_here[:5], 2, 0.5, context=2)
            ops.record_at_cursor_(cursor_ring, cursor_state, cursor, log, views_here, 7, 0.5)
        out.update(ring=ring.cpu(), state=state.tolist(), cursor_ring=cursor_ring.cpu(),
                   cursor_state=cursor_state.tolist(), cursor=cursor.tolist(), log=log.tolist())
    assert_equal_records(got["ring"], want["ring"], f"{dtype} record_")
    assert_equal_records(got["cursor_ring"], want["cursor_ring"], f"{dtype} record_at_cursor_")
    for key in ("state", "cursor_state", "cursor", "log"):
        assert got[key] == want[key], key


def test_launch_geometry_does_not_change_records():
    """A tensor's record alone, among hundreds (several launches), over one block or a wave."""
    gen = torch.Generator().manual_seed(13)
    big = planted(torch.float32, (1 << 22) + 5, gen).cuda()
    sliced = big[: 2048 * 2048].reshape(2048, 2048)[:, 3:2000]
    small = [planted(torch.float16, 97 + i, gen).cuda() for i in range(300)]
    want_big = numguard.tensor_stats(big.cpu())[None]
    want_sliced = numguard.tensor_stats(same_layout(sliced, "cpu"))[None]
    for xs in ([big], [sliced], [big, sliced], small[:150] + [big] + small[150:] + [sliced], [sliced] * 20 + [big]):
        got = numguard.multi_tensor_stats(xs)
        for i, x in enumerate(xs):
            if x is big or x is sliced:
                want = want_big if x is big else want_sliced
                assert_equal_records(got[i][None], want, f"tensor {i} of {len(xs)}")


def test_views_are_read_in_place():
    """No copy of a sliced view: the call allocates its record and a small workspace, never the
    view's size. A view with more merged dims than the kernel walks is still copied (the one
    fallback of NOTE: [strided reads])."""
    x = torch.randn(8192, 4096, device="cuda")[:, : 4096 - 7]  # 128 MB, rows with gaps
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    record = numguard.tensor_stats(x)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    assert extra < (1 << 20), f"tensor_stats of a {x.numel() * 4 >> 20} MB view allocated {extra} bytes"
    assert torch.equal(record.cpu(), numguard.tensor_stats(x.cpu()))
    deep = torch.randn(300000, device="cuda").as_strided([4] * 8, [4 ** (8 - d) + 1 for d in range(8)])
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    numguard.tensor_stats(deep)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before >= deep.numel() * 4


def _kernels_launched(fn):
    """Names of the CUDA kernels and memsets fn launched, from the profiler."""
    fn()  # warm-up: allocator, per-stream counters
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def test_a_recorded_frame_is_one_launch():
    xs = [torch.randn(1 << 20, device="cuda"), torch.randn(300, 500, device="cuda")[:, 7:400],
          torch.randn(7, device="cuda", dtype=torch.float16)]
    ring, state = ops.new_ring(8, "cuda")
    launched = _kernels_launched(lambda: ops.record_(ring, state, xs, 0, 0.5))
    assert len(launched) == 1 and "stats_kernel" in launched[0], launched
    launched = _kernels_launched(lambda: numguard.tensor_stats(xs[1]))
    assert len(launched) == 1 and "stats_kernel" in launched[0], launched


def test_frames_on_two_streams_at_once_are_each_right():
    """Launch counters are per stream (NOTE: [launch counters]): frames recorded on two streams
    at the same time, each into its own ring, all come out right."""
    gen = torch.Generator().manual_seed(14)
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    # Finite values (a trip would freeze a ring), expanded then sliced: strided views.
    data = [[torch.randn(50000 + 7 * i, generator=gen).cuda()[:, None].expand(-1, 3)[::2] for i in range(40)]
            for _ in streams]
    rings = [ops.new_ring(64, "cuda") for _ in streams]
    torch.cuda.synchronize()
    for _ in range(5):
        for s, xs, (ring, state) in zip(streams, data, rings):
            with torch.cuda.stream(s):
                for i in range(0, 40, 4):
                    ops.record_(ring, state, xs[i:i + 4], i, 0.0)
    torch.cuda.synchronize()
    for xs, (ring, _) in zip(data, rings):
        want = numguard.multi_tensor_stats([same_layout(x, "cpu") for x in xs])
        assert_equal_records(ring[:40], want, "two streams")


def test_views_recorded_inside_a_cuda_graph():
    """Under capture the counters live in the call's scratch, zeroed by a memset node; replays on
    another stream record the new values."""
    gen = torch.Generator().manual_seed(15)
    xs = [planted(torch.bfloat16, 4096 * 300, gen).cuda().reshape(300, 4096)[:, 1:4000],
          torch.randn(1000, 64, device="cuda").t()[::2]]
    ring, state = ops.new_ring(4, "cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ops.record_(ring, state, xs, 0, 0.5)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.record_(ring, state, xs, 0, 0.5)
    for replay in range(3):
        ops.reset_state(state)
        xs[1].add_(1.0)
        other = torch.cuda.Stream()
        other.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(other):
            graph.replay()
        torch.cuda.current_stream().wait_stream(other)
        torch.cuda.synchronize()
        want = numguard.multi_tensor_stats([same_layout(x, "cpu") for x in xs])
        assert_equal_records(ring[:2], want, f"replay {replay}")
        assert int(state[schema.TRIPPED]) == 1  # planted values hold NaN/Inf
