"""numguard.ops.multi_tensor_fingerprint (the replica sentinel's digest) against a plain-Python
reference of NOTE: [fingerprint], on both backends: every recordable dtype, hostile values,
non-contiguous, expanded, empty and 0-dim tensors, any thread count and chunk boundary."""
from __future__ import annotations

import struct

import pytest
import torch

from numguard import _torch_ops, ops, schema

MASK = (1 << 64) - 1
STEP = schema.FINGERPRINT_INDEX_STEP
MUL1, MUL2 = schema.FINGERPRINT_MIX_MULTIPLIERS

DTYPES = [getattr(torch, name) for name in schema.RECORDABLE_DTYPES if hasattr(torch, name)]
BACKENDS = ["torch"] + (["native"] if ops.backend() == "native" else [])


def mix64(z):
    z = ((z ^ (z >> 30)) * MUL1) & MASK
    z = ((z ^ (z >> 27)) * MUL2) & MASK
    return z ^ (z >> 31)


def element_bits(x: torch.Tensor) -> list:
    """Storage bits of every element, row-major, read through Python's struct (independent of
    the views the implementations use)."""
    flat = x.contiguous().reshape(-1)
    if x.dtype == torch.bool:
        return [1 if b else 0 for b in flat.view(torch.uint8).tolist()]
    size = x.element_size()
    raw = bytes(flat.view(torch.uint8).tolist())
    fmt = {1: "B", 2: "H", 4: "I", 8: "Q"}[size]
    return [struct.unpack_from("<" + fmt, raw, i * size)[0] for i in range(flat.numel())]


def reference(x: torch.Tensor) -> int:
    total = 0
    for i, bits in enumerate(element_bits(x)):
        total = (total + mix64(bits ^ ((i * STEP) & MASK))) & MASK
    return total - (1 << 64) if total >= 1 << 63 else total


def fingerprint(xs, backend):
    if backend == "torch":
        return _torch_ops.multi_tensor_fingerprint(list(xs))
    return ops.multi_tensor_fingerprint(xs)


def hostile(dtype, n=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    if dtype.is_floating_point:
        base = (torch.randn(n, generator=g, dtype=torch.float64) * 3).to(dtype)
        info = torch.finfo(dtype)
        special = [0.0, -0.0, info.max, -info.max, info.tiny, info.tiny / 4, -info.tiny / 2,
                   float("nan"), float("inf"), float("-inf")]
        vals = torch.tensor(special, dtype=torch.float64).to(dtype)
        base[: len(vals)] = vals
        return base
    info = torch.iinfo(dtype)
    lo, hi = max(info.min, -(2 ** 62)), min(info.max, 2 ** 62)
    base = torch.randint(lo, hi, (n,), generator=g, dtype=torch.int64).to(dtype) if dtype != torch.uint64 \
        else torch.randint(0, 2 ** 62, (n,), generator=g, dtype=torch.int64).to(dtype)
    if dtype != torch.uint64:
        base[0], base[1], base[2] = info.min, info.max, 0
    return base


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_python_reference_on_hostile_values(backend, dtype):
    x = hostile(dtype)
    cases = [x, x[::3], x.reshape(20, 15).t(), x[:1].reshape(()), x[:0], x[5:6].expand(4, 7),
             x.reshape(20, 15)[2:9, 1:12:2]]
    got = fingerprint(cases, backend).tolist()
    want = [reference(c) for c in cases]
    assert got == want


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_list_and_empty_tensor(backend):
    assert fingerprint([], backend).shape == (0,)
    assert fingerprint([torch.empty(0, 3)], backend).tolist() == [0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_layout_does_not_change_the_digest(backend):
    x = torch.randn(64, 48, dtype=torch.float32)
    t = x.t().contiguous().t()  # same values, column-major storage
    assert fingerprint([x], backend).tolist() == fingerprint([t], backend).tolist()


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_ulp_and_signed_zero_and_position_change_the_digest(backend):
    x = torch.randn(1000, dtype=torch.float32)
    y = x.clone()
    y[517] = torch.nextafter(y[517], torch.tensor(float("inf")))
    z = torch.zeros(4)
    nz = z.clone()
    nz[2] = -0.0
    swapped = x.clone()
    swapped[[3, 4]] = x[[4, 3]]
    got = fingerprint([x, y, z, nz, swapped], backend).tolist()
    assert len(set(got)) == 5


def test_native_is_independent_of_thread_count_and_chunking():
    if ops.backend() != "native":
        pytest.skip(f"native kernels not loaded ({ops.fallback_reason()})")
    big = torch.randn(3 * (1 << 15) + 12345, dtype=torch.float32)
    xs = [big, big.to(torch.bfloat16), big[::7], hostile(torch.int64, 5000)]
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results.append(ops.multi_tensor_fingerprint(xs).tolist())
    finally:
        torch.set_num_threads(before)
    assert results[0] == results[1] == results[2]
    assert results[0] == _torch_ops.multi_tensor_fingerprint(xs).tolist()
    assert results[0][0] == reference(big)  # crosses chunk boundaries


def test_digest_is_additive_over_pieces():
    """Chunking cannot matter: the digest is a wrapping sum of per-element terms (checked by
    recombining the reference over two pieces at an arbitrary cut)."""
    x = hostile(torch.float16, 777)
    whole = reference(x)
    cut = 301
    a = sum(mix64(b ^ ((i * STEP) & MASK)) for i, b in enumerate(element_bits(x)[:cut]))
    b = sum(mix64(v ^ (((i + cut) * STEP) & MASK)) for i, v in enumerate(element_bits(x)[cut:]))
    total = (a + b) & MASK
    assert (total - (1 << 64) if total >= 1 << 63 else total) == whole
    assert ops.multi_tensor_fingerprint([x]).tolist() == [whole]


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_host_sync(backend):
    from numguard.testing import SyncCounter
    xs = [hostile(torch.float16, 1000), hostile(torch.int32, 10)[::2], torch.zeros(0)]
    counter = SyncCounter()
    with counter():
        fingerprint(xs, backend)
    assert counter.total == 0, counter.where


def test_bad_input_is_named():
    with pytest.raises(TypeError, match=r"xs\[1\].*complex"):
        ops.multi_tensor_fingerprint([torch.zeros(2), torch.zeros(2, dtype=torch.complex64)])


def test_layout_check_against_extension():
    assert ops.fingerprint_mismatch(schema.FINGERPRINT_LAYOUT) is None
    assert "fingerprint" in ops.fingerprint_mismatch((2,) + schema.FINGERPRINT_LAYOUT[1:])
    assert "rebuild" in ops.fingerprint_mismatch(None)
    native = ops.native_module()
    if native is not None:
        assert ops.fingerprint_mismatch(native.fingerprint_layout()) is None


def test_meta_tensor_gives_a_shape_only():
    if ops.backend() != "native":
        pytest.skip("the fake kernel is registered with the native extension")
    out = torch.ops.numguard.multi_tensor_fingerprint.default([torch.empty(5, device="meta")] * 3)
    assert out.shape == (3,) and out.dtype == torch.int64


# ---------------------------------------------------------------------------------------------
# CUDA (run by benchmarks/gpu_check.sh on a GPU machine; skipped without one)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or ops.backend() != "native",
                                reason="needs a CUDA device and the native kernels")


@needs_cuda
def test_cuda_equals_cpu_on_every_dtype_and_layout_without_host_sync():
    views = [lambda x: x, lambda x: x[::3], lambda x: x.reshape(50, 100).t(),
             lambda x: x[:1].reshape(()), lambda x: x[:0], lambda x: x[5:6].expand(4, 7)]
    cpu, gpu = [], []
    for dtype in DTYPES:
        x = hostile(dtype, 5000)
        xg = x.cuda()
        cpu += [v(x) for v in views]
        gpu += [v(xg) for v in views]
    big = torch.randn(3_000_001)  # several blocks per tensor
    cpu.append(big)
    gpu.append(big.cuda())
    want = ops.multi_tensor_fingerprint(cpu).tolist()  # more than one launch (48 tensors each)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = ops.multi_tensor_fingerprint(gpu)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert got.device.type == "cuda" and got.tolist() == want


@needs_cuda
def test_cuda_result_is_the_same_every_run():
    x = torch.randn(10_000_000, device="cuda")
    runs = {tuple(ops.multi_tensor_fingerprint([x, x.half(), x[::5]]).tolist()) for _ in range(5)}
    assert len(runs) == 1
