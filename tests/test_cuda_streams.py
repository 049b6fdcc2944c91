"""Misaligned tensors, rings written from several CUDA streams, and the async check of a ring on
a device that is not the current one (NOTE: [element alignment], [concurrent recording] and
[rings on side streams] in csrc). The CPU cases run everywhere; the CUDA cases are what
benchmarks/gpu_check.sh runs in its kernel phase (`-k cuda`)."""
import pytest
import torch

import numguard
from numguard import _torch_ops, ops, schema
from conftest import DEVICES, HAS_CUDA, no_host_sync, requires_native

requires_two_gpus = pytest.mark.skipif(not HAS_CUDA or torch.cuda.device_count() < 2, reason="needs two GPUs")

MISALIGNED_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64]


class _CudaArray:
    """A CUDA buffer seen through __cuda_array_interface__, for a tensor at any byte address."""

    def __init__(self, keep, ptr, n, dtype):
        self.keep = keep
        typestr = {torch.float64: "<f8", torch.float32: "<f4", torch.float16: "<f2", torch.int32: "<i4",
                   torch.int64: "<i8"}[dtype]
        self.__cuda_array_interface__ = {"data": (ptr, False), "shape": (n,), "typestr": typestr, "version": 2}


def hostile(dtype, n=1000):
    """Values of `dtype` with NaN, +-Inf, -0.0, subnormals and +-max among ordinary ones."""
    gen = torch.Generator().manual_seed(7)
    if not dtype.is_floating_point:
        info = torch.iinfo(dtype)
        x = torch.randint(-1000, 1000, (n,), generator=gen).to(dtype)
        x[:3] = torch.tensor([info.min, info.max, 0]).to(dtype)
        return x
    info = torch.finfo(dtype)
    x = torch.randn(n, generator=gen, dtype=torch.float64).to(dtype)
    specials = [float("nan"), float("inf"), float("-inf"), -0.0, 0.0, info.tiny / 4, -info.tiny / 2,
                info.max, -info.max]
    x[: len(specials)] = torch.tensor(specials, dtype=torch.float64).to(dtype)
    return x


def misaligned(values: torch.Tensor, device: str) -> torch.Tensor:
    """A tensor with `values` whose data pointer is one byte past an element boundary."""
    raw = values.contiguous().view(torch.uint8)
    if device == "cpu":
        buffer = bytearray(raw.numel() + 16)
        torch.frombuffer(buffer, dtype=torch.uint8, offset=1, count=raw.numel()).copy_(raw)
        return torch.frombuffer(buffer, dtype=values.dtype, offset=1, count=values.numel())
    if values.dtype == torch.bfloat16:  # no typestr for bfloat16: carry its bits as int16
        return misaligned(values.view(torch.int16), device).view(torch.bfloat16)
    buf = torch.zeros(raw.numel() + 16, dtype=torch.uint8, device=device)
    buf[1:1 + raw.numel()] = raw.to(device)
    return torch.as_tensor(_CudaArray(buf, buf.data_ptr() + 1, values.numel(), values.dtype), device=device)


@requires_native
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", MISALIGNED_DTYPES, ids=str)
def test_misaligned_start_is_read_exactly(dtype, device):
    values = hostile(dtype)
    x = misaligned(values, device)
    assert x.data_ptr() % x.element_size() != 0
    want = _torch_ops.tensor_stats(values)
    strided_want = _torch_ops.tensor_stats(values[::3])
    with no_host_sync(device):
        got = numguard.tensor_stats(x)
        many = numguard.multi_tensor_stats([x, x[::3], x[5:]])
        fingerprints = ops.multi_tensor_fingerprint([x, x[::3]])
        ring, state = ops.new_ring(4, device)
        ops.record_(ring, state, [x], 0)
    assert torch.equal(got.cpu(), want)
    assert torch.equal(many[0].cpu(), want)
    assert torch.equal(many[1].cpu(), strided_want)
    assert torch.equal(many[2].cpu(), _torch_ops.tensor_stats(values[5:]))
    assert torch.equal(ring[0].cpu(), want)
    aligned = values.to(device)
    assert fingerprints.tolist() == ops.multi_tensor_fingerprint([aligned, aligned[::3]]).tolist()
    tripped = dtype.is_floating_point
    assert int(state[schema.TRIPPED]) == int(tripped)


def _frames(n, device, bad_at=None):
    frames = []
    for i in range(n):
        x = torch.full((257 + i,), float(i + 1), device=device)
        if i == bad_at:
            x[3] = float("nan")
        frames.append(x)
    return frames


@requires_native
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
def test_cuda_two_streams_record_into_one_ring():
    """record_ from two streams at once: every row written holds the frame its position names,
    and the trip flag and first position are the tripping frame's (NOTE: [concurrent recording]:
    a frame that starts after the trip on the other stream is not written)."""
    device = "cuda"
    frames = _frames(64, device, bad_at=40)
    ring, state = ops.new_ring(64, device)
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    with no_host_sync(device):
        for i, x in enumerate(frames):
            with torch.cuda.stream(streams[i % 2]):
                ops.record_(ring, state, [x], i)
    torch.cuda.synchronize()
    assert int(state[schema.TRIPPED]) == 1 and int(state[schema.FIRST_TRIP_POSITION]) == 40
    assert int(ring[40, schema.NAN]) == 1  # the offender's row is written
    written = 0
    for i in range(64):  # a row is its own frame's, or untouched (zeros), never another frame's
        abs_max = float(ring[i, schema.ABS_MAX])
        assert abs_max in (0.0, float(i + 1)), (i, abs_max)
        written += abs_max != 0.0
    assert written >= 2


def _cursor_ring(rows, log_rows, device):
    """A ring, its state, a graph cursor at its base position and a call log (record_at_cursor_)."""
    ring, state = ops.new_ring(rows, device)
    cursor = torch.tensor([schema.GRAPH_POSITION_BASE, 0, 0], dtype=torch.int64, device=device)
    log = torch.zeros(log_rows, schema.GRAPH_LOG_WIDTH, dtype=torch.int64, device=device)
    return ring, state, cursor, log


@requires_native
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
def test_cuda_two_streams_record_at_cursor_take_distinct_positions():
    device = "cuda"
    ring, state, cursor, log = _cursor_ring(512, 256, device)
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    frames = _frames(100, device)
    with no_host_sync(device):
        for i, x in enumerate(frames):
            with torch.cuda.stream(streams[i % 2]):
                torch.ops.numguard.record_at_cursor_(ring, state, cursor, log, [x, x], i, 0.0)
    torch.cuda.synchronize()
    assert cursor[0].item() == schema.GRAPH_POSITION_BASE + 200 and cursor[1].item() == 100
    starts = sorted(log[:100, 1].tolist())
    assert starts == [schema.GRAPH_POSITION_BASE + 2 * i for i in range(100)]  # no two calls share one
    slots_by_start = {int(r[1]): int(r[0]) for r in log[:100].tolist()}
    for start, slot in slots_by_start.items():
        row = (start % 512)
        assert float(ring[row, schema.ABS_MAX]) == float(slot + 1)


@requires_native
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
def test_cuda_graph_replayed_on_a_side_stream_beside_eager_records():
    device = "cuda"
    ring, state, cursor, log = _cursor_ring(256, 128, device)
    x = torch.ones(1000, device=device)
    y = torch.full((1000,), 2.0, device=device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        torch.ops.numguard.record_at_cursor_(ring, state, cursor, log, [x], 1, 0.0)  # warm-up
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        torch.ops.numguard.record_at_cursor_(ring, state, cursor, log, [x], 1, 0.0)
    replay = torch.cuda.Stream()
    replay.wait_stream(torch.cuda.current_stream())
    for _ in range(20):
        with torch.cuda.stream(replay):
            graph.replay()
        torch.ops.numguard.record_at_cursor_(ring, state, cursor, log, [y], 2, 0.0)
    torch.cuda.synchronize()
    calls = int(cursor[1])
    assert calls == 1 + 20 + 20  # the warm-up, the replays and the eager calls (a capture runs nothing)
    starts = log[:calls, 1].tolist()
    assert sorted(starts) == [schema.GRAPH_POSITION_BASE + i for i in range(calls)]


@requires_two_gpus
def test_cuda_async_check_of_a_ring_on_a_non_current_gpu():
    """check="async" with the model on cuda:1 while cuda:0 is current: a NaN is reported at the
    next check, never missed because the event waited on the wrong device's stream."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)).to("cuda:1")
    insp = numguard.watch(model, check="async", report_to=None)
    x = torch.randn(8, 64, device="cuda:1")
    with torch.cuda.device(0), torch.no_grad():
        model(x)
        model[1].bias[0] = float("nan")
        model(x)
        with pytest.raises(numguard.NonFiniteError) as err:
            for _ in range(3):
                model(x)
    assert err.value.module in ("1", "")
    insp.close(check=False)


def test_async_copy_event_waits_on_the_ring_devices_stream(monkeypatch):
    """The event of the async check is recorded on the stream of the ring's device (the copy's
    stream), not on the current device's."""
    from numguard.inspector import checks

    asked = []

    class FakeEvent:
        def record(self, stream=None):
            asked.append(stream)

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: ("stream of", torch.device(device)))
    ring = type("Ring", (), {"device": torch.device("cuda", 1), "frames": []})()
    reader = checks.FlagReader(ring, "sync", set())
    reader._host = torch.empty(4, dtype=torch.int64)
    reader._event = FakeEvent()
    reader._source = lambda batch: (torch.zeros(4, dtype=torch.int64), False, 0)
    reader.issue_async_copy(3)
    assert asked == [("stream of", torch.device("cuda", 1))]
