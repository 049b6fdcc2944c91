"""numguard's CUDA kernels: registered for every op when the extension was built with them, and, on
a machine with a GPU, record_ captured in a CUDA graph keeps freeze-on-trip across replays.

Set NUMGUARD_EXPECT_CUDA_KERNELS=1 to turn "built without CUDA kernels" from a skip into a failure
(scripts/check_cuda_build.sh does, so the CUDA build check can never pass by skipping).
"""
import os

import pytest
import torch

import numguard
from numguard import ops

OPS = ("tensor_stats", "multi_tensor_stats", "record_")
EXPECT_CUDA_KERNELS = os.environ.get("NUMGUARD_EXPECT_CUDA_KERNELS", "0") == "1"


def _cuda_architectures():
    """The CUDA architectures compiled into the extension, or a reason why there are none."""
    native = ops.native_module()
    if native is None:
        return [], f"the native extension is not loaded ({ops.fallback_reason()})"
    archs = list(native.cuda_architectures())
    if not archs:
        return [], (f"the extension was built without CUDA kernels (torch {torch.__version__}, "
                    f"torch.version.cuda={torch.version.cuda!r}); build with NUMGUARD_BUILD_CUDA=1 "
                    "against a CUDA build of torch to include them")
    return archs, None


def _require_cuda_kernels():
    archs, reason = _cuda_architectures()
    if reason is not None:
        if EXPECT_CUDA_KERNELS:
            pytest.fail(f"NUMGUARD_EXPECT_CUDA_KERNELS=1 but {reason}")
        pytest.skip(reason)
    return archs


def _require_gpu():
    _require_cuda_kernels()
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device visible: the CUDA kernels are built but cannot run here")


def test_cuda_architectures_are_named_like_sm_xy():
    archs = _require_cuda_kernels()
    assert archs == sorted(set(archs), key=archs.index)  # no duplicates
    for arch in archs:
        assert arch.startswith("sm_") and arch[3:].isdigit(), archs


@pytest.mark.parametrize("op", OPS)
def test_every_op_has_cuda_and_cpu_kernels(op):
    _require_cuda_kernels()
    name = f"numguard::{op}"
    assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "CUDA"), f"{name} has no CUDA kernel"
    assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "CPU"), f"{name} has no CPU kernel"


def test_native_backend_serves_the_ops():
    _require_cuda_kernels()
    assert numguard.backend() == "native"


# ------------------------------------------------------------------------------------------------
# On a GPU.

def _state_list(state):
    return [int(v) for v in state.cpu()]


def test_record_in_cuda_graph_freezes_on_trip_across_replays():
    _require_gpu()
    device = torch.device("cuda")
    ring, state = ops.new_ring(4, device)
    x = torch.ones(1000, device=device, dtype=torch.float16)
    y = torch.zeros(4099, device=device, dtype=torch.float32)

    # Warm up on a side stream (allocator pools, lazy init), as CUDA graph capture requires.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        numguard.record_(ring, state, [x, y], 0, 0.5)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        numguard.record_(ring, state, [x, y], 0, 0.5)

    ring.zero_()
    ops.reset_state(state)
    graph.replay()
    torch.cuda.synchronize()
    eager = numguard.multi_tensor_stats([x, y])
    assert torch.equal(ring[:2], eager)
    assert _state_list(state) == [0, -1, 0, -1]

    y[4098] = float("nan")  # the tripping frame itself is written
    graph.replay()
    torch.cuda.synchronize()
    assert _state_list(state) == [1, 1, 0, -1]
    assert ring[1, 3].item() == 1.0  # nan count of y
    frozen = ring.clone()

    # Later replays leave the ring and the state as they were, whatever the data.
    y[4098] = 0.0
    y[0] = float("-inf")
    x[0] = 40000.0  # above 0.5 * finfo(float16).max: no headroom flag once frozen
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(ring, frozen)
    assert _state_list(state) == [1, 1, 0, -1]

    # Untripped again, the same graph records the new values and flags the headroom.
    ops.reset_state(state)
    graph.replay()
    torch.cuda.synchronize()
    assert _state_list(state) == [1, 1, 1, 0]
    assert torch.equal(ring[:2], numguard.multi_tensor_stats([x, y]))


def test_ops_do_not_synchronize_with_the_host():
    _require_gpu()
    device = torch.device("cuda")
    xs = [torch.randn(n, device=device) for n in (0, 1, 4097, 1 << 20)]
    ring, state = ops.new_ring(8, device)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        single = numguard.tensor_stats(xs[2])
        many = numguard.multi_tensor_stats(xs)
        numguard.record_(ring, state, xs, 3, 0.5)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.equal(many[2], single)
    assert torch.equal(ring[3:7], many)
