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
