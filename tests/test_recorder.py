"""The native frame recorder (csrc/recorder.cpp) against the pure-Python one it replaces on the
hot path: for the same calls, the same frames (positions, reuse, dtypes, shapes, records written)
and the same ring and state, bit for bit, on hostile inputs."""
import gc
import weakref

import numpy as np
import pytest
import torch

import numguard
from numguard.inspector import ring as ring_module
from numguard.inspector.frames import Owner, TENSOR

from conftest import requires_native

pytestmark = requires_native

LABELS2 = ("input[0]", "output")


def _calls():
    """A batch of frame calls that exercise every branch: reuse, in-place change (version bump),
    recordable and unrecordable dtypes, sparse, complex, non-contiguous, expanded, 0-dim, empty,
    meta, NaN/Inf, subnormal."""
    torch.manual_seed(0)
    a = torch.randn(3, 4)
    b = torch.randn(3, 4)
    c = torch.tensor([float("nan"), 1.0, float("-inf"), -0.0])
    h = torch.tensor([60000.0, 1e-7, 0.0], dtype=torch.float16)
    calls = [
        [a, b],                                   # two new
        [b, c],                                   # b reused, c new (non-finite)
        [torch.randn(4, 6).t(), torch.randn(2, 1).expand(2, 5)],  # strided, expanded
        [torch.tensor(3.0), torch.empty(0, 3)],   # 0-dim, empty
        [torch.arange(6, dtype=torch.int32), torch.tensor([True, False])],
        [h, torch.randn(3, dtype=torch.bfloat16)],
        [torch.randn(2, 2, dtype=torch.complex64)],              # sanitized: real view
        [torch.randn(3, 3).to_sparse()],                          # sanitized: values
        [torch.empty(2, 2, device="meta")],                       # sanitized: empty stand-in
        [a, b],                                   # both reused
    ]
    return calls, (a, b)


def _run(recorder_kind, monkeypatch, in_place_between=True):
    if recorder_kind == "python":
        monkeypatch.setattr(numguard.ops, "native_module", lambda: None)
    ring = ring_module.FrameRing(4, torch.device("cpu"))  # small: grows during the batch
    monkeypatch.undo()
    assert (type(ring._recorder) is ring_module._PythonRecorder) == (recorder_kind == "python")
    owner = Owner(0, "m", "M", headroom=0.5)
    calls, (a, _) = _calls()
    for i, xs in enumerate(calls):
        if in_place_between and i == 5:
            a.mul_(2.0)  # a changed in place: recorded again when used again
        labels = tuple(f"x{j}" for j in range(len(xs)))
        ring.record(owner, list(xs), labels, tuple([TENSOR] * len(xs)), "forward", True, False, 0)
    frames = [(f.start, f.n_records, list(f.positions), [str(d) for d in f.dtypes], [tuple(s) for s in f.shapes],
               f.lowest, f.batch_start) for f in ring.frames]
    return frames, ring.ring.numpy().copy(), ring.state_buf.tolist(), ring.pos, ring.window_lo, ring.hf_calls


def test_native_recorder_matches_python_recorder(monkeypatch):
    native = _run("native", monkeypatch)
    python = _run("python", monkeypatch)
    assert native[0] == python[0]
    np.testing.assert_array_equal(native[1], python[1])
    assert native[2:] == python[2:]
    # The meaningful parts: reuse and the trip at the NaN tensor's record.
    frames = native[0]
    assert frames[1][2][0] == frames[0][2][1]        # b reused: points at its first record
    assert frames[-1][1] == 1                         # a changed in place: recorded again; b reused
    assert frames[-1][2][1] == frames[0][2][1]
    tripped, first = native[2][0], native[2][1]
    assert tripped == 1 and first == frames[1][2][1]  # c's record is the first non-finite one


def test_in_place_change_is_recorded_again():
    ring = ring_module.FrameRing(64, torch.device("cpu"))
    owner = Owner(0, "m", "M")
    x = torch.ones(4)
    ring.record(owner, [x], ("x",), (TENSOR,), "forward", True, False, 0)
    ring.record(owner, [x], ("x",), (TENSOR,), "forward", True, False, 0)
    assert ring.frames[-1].n_records == 0           # unchanged: reused
    x[0] = float("inf")                             # bumps the version counter
    ring.record(owner, [x], ("x",), (TENSOR,), "forward", True, False, 0)
    assert ring.frames[-1].n_records == 1
    assert ring.state[0].item() == 1                # the Inf is seen


def test_a_dead_tensor_is_never_mistaken_for_a_new_one():
    ring = ring_module.FrameRing(64, torch.device("cpu"))
    owner = Owner(0, "m", "M")
    for _ in range(50):  # new tensors often land at a freed one's address
        x = torch.full((8,), 2.0)
        ring.record(owner, [x], ("x",), (TENSOR,), "forward", True, False, 0)
        assert ring.frames[-1].n_records == 1
        del x
        gc.collect()
    y = torch.full((8,), float("nan"))
    ring.record(owner, [y], ("y",), (TENSOR,), "forward", True, False, 0)
    assert ring.frames[-1].n_records == 1 and ring.state[0].item() == 1


def test_inference_tensors_are_recorded_every_time():
    ring = ring_module.FrameRing(64, torch.device("cpu"))
    owner = Owner(0, "m", "M")
    with torch.inference_mode():
        x = torch.ones(3)
    for _ in range(2):
        ring.record(owner, [x], ("x",), (TENSOR,), "forward", True, False, 0)
        assert ring.frames[-1].n_records == 1


def test_the_recorder_does_not_keep_its_ring_alive():
    ring = ring_module.FrameRing(64, torch.device("cpu"))
    owner = Owner(0, "m", "M")
    ring.record(owner, [torch.ones(2)], ("x",), (TENSOR,), "forward", True, False, 0)
    ref = weakref.ref(ring)
    del ring
    gc.collect()
    assert ref() is None


def test_a_non_tensor_is_a_clear_error():
    ring = ring_module.FrameRing(64, torch.device("cpu"))
    with pytest.raises(TypeError, match=r"xs\[1\] is not a tensor"):
        ring.record(Owner(0, "m", "M"), [torch.ones(2), 3.0], LABELS2, (TENSOR, TENSOR), "forward", True, False, 0)


# -- the module hook's native fast path (FrameRecorder.module_call) ----------------------------

class _Net(torch.nn.Module):
    """Calls of every kind: one tensor in and out (the fast path), a keyword argument, a tuple
    output, a non-tensor input, and a submodule called outside the root's forward."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 4)
        self.split = _Split()

    def forward(self, x):
        h = self.b(self.a(x))
        left, right = self.split(h, scale=2.0)
        return left + right


class _Split(torch.nn.Module):
    def forward(self, x, scale=1.0):
        return x * scale, x - 1


def _frames_of(backend_fast, monkeypatch):
    """(owner, labels, positions, dtypes, shapes, n_records) of every frame of three batches, with
    the fast path on or off."""
    model = _Net()
    with numguard.watch(model, max_frames_to_save=100) as insp:
        if not backend_fast:
            monkeypatch.setattr(insp._ring, "module_call", lambda *args: False)
        calls = []
        real = insp._ring.module_call


        def counted(*args):
            handled = real(*args)
            calls.append((args[0].name, handled))
            return handled

        monkeypatch.setattr(insp._ring, "module_call", counted)
        for _ in range(3):
            model(torch.randn(2, 4))
        model.a(torch.randn(2, 4))   # outside the root's forward: the Python path
        frames = [(f.owner.name, f.labels, f.positions, tuple(map(str, f.dtypes)), f.shapes, f.n_records,
                   f.batch, f.hf, f.with_weights) for f in insp._ring.frames]
        report = insp.last_report
    return frames, calls, report


def test_the_fast_path_records_what_the_python_path_records(monkeypatch):
    fast, calls, _ = _frames_of(True, monkeypatch)
    with monkeypatch.context() as m:
        slow, _, _ = _frames_of(False, m)
    assert fast == slow
    # The fast path took the one-in-one-out calls inside the forward, and left the rest.
    assert {("a", True), ("b", True), ("split", False), ("a", False)} == set(calls)


def test_the_fast_path_trips_at_the_first_bad_module_like_the_python_path():
    model = _Net()
    with numguard.watch(model, abort_after_batch_num=None) as insp:
        model(torch.randn(2, 4))
        with torch.no_grad():
            model.b.weight[0, 0] = float("nan")
        with pytest.raises(numguard.NonFiniteError) as info:
            model(torch.randn(2, 4))
    assert info.value.module == "b"


# -- the weight table's native parameter walk (csrc/weights.cpp) --------------------------------

def test_the_native_parameter_walk_follows_every_change_of_the_parameters():
    from numguard.inspector import weights as weights_module
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
    with numguard.watch(model) as insp:
        table = insp._weights
        python_batches = []
        real = table._record_stats
        table._record_stats = lambda *args: python_batches.append(insp.batches_finished) or real(*args)
        x = torch.randn(2, 3)
        for _ in range(3):
            model(x)
        assert python_batches == [0]                 # the layout is built once, then walked natively
        steady = table.tables[max(table.tables)][0].clone()
        model[1].weight = torch.nn.Parameter(torch.full((2, 3), 5.0))   # a new parameter object
        model(x)
        assert python_batches == [0, 3]
        assert table.tables[max(table.tables)][0][2, numguard.schema.ABS_MAX].item() == 5.0
        model(x)
        assert python_batches == [0, 3]
        model.double()                               # same objects, another dtype
        model(x.double())
        assert python_batches == [0, 3, 5]
        with torch.no_grad():
            model[0].bias.data[1] = float("inf")     # a write the version counter does not see
        with pytest.raises(numguard.NonFiniteError) as info:
            model(x.double())
        assert info.value.module == "0"
    assert steady.shape[0] == 4 and weights_module.WeightTable is type(table)


@pytest.mark.skipif(numguard.backend() != "native", reason="the native recorder is not loaded")
def test_native_recorder_checks_the_frame_fields_it_builds_when_it_is_made():
    """The C++ recorder builds Frame tuples by position: a Frame whose fields differ from what it
    builds is refused when the recorder is made, naming both field lists."""
    import collections

    from numguard import ops
    from numguard.inspector.frames import Frame
    native = ops.native_module()
    ring, state = ops.new_ring(4, "cpu")
    native.FrameRecorder(ring, state, [], [], Frame, lambda xs, where=None: xs, lambda n: None, 10)
    Renamed = collections.namedtuple("Renamed", [f if f != "lowest" else "oldest" for f in Frame._fields])
    with pytest.raises(RuntimeError, match=r"builds Frame\(owner, batch, .*lowest\) but .* has \(.*oldest\)"):
        native.FrameRecorder(ring, state, [], [], Renamed, lambda xs, where=None: xs, lambda n: None, 10)
