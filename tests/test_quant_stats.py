"""numguard.quant_stats against a reference written element by element in plain Python (numpy's
float32 for the float32 steps), on hostile values, every input dtype, layouts and each format."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import numguard
from numguard import schema
from numguard.quant import quant_stats

from conftest import no_host_sync

F32 = np.float32
FORMATS = list(schema.QUANT_FORMATS)


def _element_values(element):
    """[(value, code)] of every finite non-negative value of the element format, by code."""
    if element == "float4_e2m1":
        return [(v, c) for c, v in enumerate((0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0))]
    dtype = getattr(torch, element)
    codes = torch.arange(128, dtype=torch.uint8)
    values = codes.view(dtype).float().tolist()
    return [(v, c) for c, v in enumerate(values) if math.isfinite(v)]


_TABLES = {}


def _round(v, element, vmax):
    """Round-to-nearest-even of float32 `v` (clamped to +-vmax) onto the element format, by search."""
    table = _TABLES.setdefault(element, _element_values(element))
    a = min(abs(float(v)), vmax)
    best = None
    for value, code in table:
        d = abs(value - a)
        if best is None or d < best[0] or (d == best[0] and code % 2 == 0 and best[2] % 2 == 1):
            best = (d, value, code)
    return math.copysign(best[1], float(v))


def _floor_log2(v):
    return math.frexp(v)[1] - 1


def reference(values, fmt, scale=None):
    spec = schema.QUANT_FORMATS[fmt]
    xs = [float(v) for v in values]
    finite = [math.isfinite(v) for v in xs]
    f32max = float(np.finfo(np.float32).max)
    x32 = [F32(max(-f32max, min(f32max, v))) if f else F32(0) for v, f in zip(xs, finite)]
    exact = [v if f else 0.0 for v, f in zip(xs, finite)]
    out = dict.fromkeys(schema.QUANT_FIELDS, 0.0)
    out["nonfinite"] = float(sum(not f for f in finite))
    out["nonzero"] = float(sum(v != 0 for v in x32))
    out["amax"] = max([abs(v) for v in exact], default=0.0)
    n = len(xs)
    q, deq, sat = [0.0] * n, [0.0] * n, [False] * n
    exps = []
    if spec.scale == "tensor":
        s = F32(1.0 if scale is None else scale)
        for i in range(n):
            v = x32[i] * s
            sat[i] = abs(float(v)) > spec.element_max
            q[i] = _round(v, spec.element, spec.element_max)
            deq[i] = q[i] / float(s)
        blocks = [list(range(n))] if n else []
        exps = [_floor_log2(float(s))] if n else []
    else:
        size = spec.block
        blocks = [list(range(b, min(b + size, n))) for b in range(0, n, size)]
        if spec.scale == "e8m0":
            for idx in blocks:
                bamax = max(abs(float(x32[i])) for i in idx)
                shared = max(-127, min(127, _floor_log2(bamax) - spec.element_emax)) if bamax > 0 else -127
                exps.append(shared)
                for i in idx:
                    v = F32(float(x32[i]) * 2.0 ** -shared)
                    sat[i] = abs(float(v)) > spec.element_max
                    q[i] = _round(v, spec.element, spec.element_max)
                    deq[i] = q[i] * 2.0 ** shared
        else:  # nvfp4
            amax32 = max([abs(float(v)) for v in x32], default=0.0)
            g = F32(scale) if scale is not None else (F32(448.0 * 6.0) / F32(amax32) if amax32 > 0 else F32(1.0))
            for idx in blocks:
                bamax = F32(max(abs(float(x32[i])) for i in idx))
                s = F32(_round(min(float(bamax * g / F32(6.0)), 448.0), "float8_e4m3fn", 448.0))
                if s > 0:
                    exps.append(_floor_log2(float(s)))
                for i in idx:
                    v = (x32[i] * g / s) if s > 0 else F32(0.0)
                    sat[i] = abs(float(v)) > 6.0
                    q[i] = _round(v, "float4_e2m1", 6.0)
                    deq[i] = q[i] * float(s) / float(g)
    out["underflow"] = float(sum(x32[i] != 0 and q[i] == 0 for i in range(n)))
    out["saturated"] = float(sum(sat))
    # each square rounded once, as d * d (a float64 value near its max: the square is inf)
    errors = [float(deq[i] - exact[i]) for i in range(n) if finite[i]]
    out["sq_error"] = math.fsum(d * d for d in errors)
    out["blocks"] = float(len(blocks))
    out["saturated_blocks"] = float(sum(any(sat[i] for i in idx) for idx in blocks))
    out["scale_exp_min"] = float(min(exps)) if exps else math.inf
    out["scale_exp_max"] = float(max(exps)) if exps else -math.inf
    return out


def hostile(dtype, n=150, seed=0):
    gen = torch.Generator().manual_seed(seed)
    finfo = torch.finfo(dtype)
    base = torch.randn(n, generator=gen, dtype=torch.float64) * torch.exp2(torch.randint(-20, 20, (n,), generator=gen))
    special = [0.0, -0.0, float("nan"), float("inf"), -float("inf"), finfo.max, -finfo.max, finfo.tiny,
               finfo.tiny / 4 if dtype != torch.bfloat16 else finfo.tiny, 448.0, 464.0, 500.0, 6.0, 5.0, 0.25,
               0.75, 1.0625, 2.0 ** -10, 1e-30, 57344.0, 61440.0]
    k = min(n, len(special))
    base[:k] = torch.tensor(special[:k], dtype=torch.float64)
    base[40:72] = 0.0  # an all-zero block of every block size
    return base.to(dtype)


def assert_matches(got, want, where):
    got = dict(zip(schema.QUANT_FIELDS, got.tolist()))
    for name in schema.QUANT_FIELDS:
        g, w = got[name], want[name]
        if name == "sq_error":  # a float64 sum: order of summation differs from math.fsum
            assert g == pytest.approx(w, rel=1e-12, abs=0.0) or (math.isinf(g) and g == w), (where, name, g, w)
        else:
            assert g == w, (where, name, g, w)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_matches_the_reference_on_hostile_values(fmt, dtype):
    x = hostile(dtype)
    assert_matches(quant_stats(x, fmt), reference(x.tolist(), fmt), (fmt, dtype))


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2", "nvfp4"])
def test_a_given_scale(fmt):
    x = hostile(torch.float32, seed=3)
    for scale in (0.5, 3.0, 2.0 ** -20):
        assert_matches(quant_stats(x, fmt, scale=scale), reference(x.tolist(), fmt, scale), (fmt, scale))
        as_tensor = torch.tensor(scale, dtype=torch.float32)
        assert torch.equal(quant_stats(x, fmt, scale=as_tensor), quant_stats(x, fmt, scale=scale))


@pytest.mark.parametrize("fmt", FORMATS)
def test_layouts_read_in_row_major_order(fmt):
    x = hostile(torch.float32, n=200, seed=5).view(10, 20)
    want = quant_stats(x.contiguous(), fmt)
    assert torch.equal(quant_stats(x, fmt), want)
    t = x.t()  # a transposed view: its row-major order is the transpose's
    assert torch.equal(quant_stats(t, fmt), quant_stats(t.contiguous(), fmt))
    e = torch.tensor([3.0, -7.0]).expand(5, 2)
    assert_matches(quant_stats(e, fmt), reference(e.reshape(-1).tolist(), fmt), (fmt, "expanded"))


@pytest.mark.parametrize("fmt", FORMATS)
def test_empty_zero_dim_and_fp8_inputs(fmt):
    assert_matches(quant_stats(torch.empty(0), fmt), reference([], fmt), (fmt, "empty"))
    assert_matches(quant_stats(torch.tensor(-3.5), fmt), reference([-3.5], fmt), (fmt, "0-dim"))
    f8 = torch.tensor([1.0, -448.0, 0.0, 2.0 ** -9]).to(torch.float8_e4m3fn)
    assert_matches(quant_stats(f8, fmt), reference(f8.float().tolist(), fmt), (fmt, "fp8 input"))


def test_counting_minus_zero_is_neither_underflow_nor_nonzero():
    """Transformer Engine once reported negative underflow percentages for not counting -0."""
    x = torch.tensor([-0.0, 0.0, -0.0, 1.0])
    got = dict(zip(schema.QUANT_FIELDS, quant_stats(x, "float8_e4m3fn").tolist()))
    assert got["nonzero"] == 1 and got["underflow"] == 0


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown format 'fp8'.*'float8_e4m3fn'"):
        quant_stats(torch.ones(2), "fp8")
    with pytest.raises(TypeError, match="torch.int64"):
        quant_stats(torch.ones(2, dtype=torch.int64), "nvfp4")
    with pytest.raises(ValueError, match="takes no scale"):
        quant_stats(torch.ones(2), "mxfp8_e4m3", scale=2.0)
    with pytest.raises(ValueError, match="positive finite number, got -1"):
        quant_stats(torch.ones(2), "float8_e4m3fn", scale=-1)


def test_multi_tensor_and_no_host_sync():
    xs = [hostile(torch.float32, n=n, seed=n) for n in (1, 33, 70)]
    rows = numguard.multi_tensor_quant_stats(xs, "mxfp8_e4m3")
    assert rows.shape == (3, len(schema.QUANT_FIELDS)) and rows.dtype == torch.float64
    for row, x in zip(rows, xs):
        assert torch.equal(row, quant_stats(x, "mxfp8_e4m3"))
    with pytest.raises(ValueError, match="2 scales for 3 tensors"):
        numguard.multi_tensor_quant_stats(xs, "nvfp4", scales=[1.0, 2.0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("fmt", FORMATS)
def test_cuda_matches_cpu_without_host_sync(fmt):
    x = hostile(torch.float32, n=300, seed=9)
    want = quant_stats(x, fmt)
    xc = x.cuda()
    torch.cuda.synchronize()
    with no_host_sync(xc.device):
        got = quant_stats(xc, fmt).cpu()
    keep = [i for i, name in enumerate(schema.QUANT_FIELDS) if name != "sq_error"]
    assert torch.equal(got[keep], want[keep]), (got, want)  # the sum of squares: another order
    assert got[schema.Q_SQ_ERROR].item() == pytest.approx(want[schema.Q_SQ_ERROR].item(), rel=1e-9)


def test_nvfp4_ties_round_to_the_even_mantissa():
    # g = 1 and a block amax of 6 give s = 1: the elements are their own e2m1 inputs
    x = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -5.0, 0.2, 5.5, 0.0, 0.0, 0.0, 0.0])
    got = dict(zip(schema.QUANT_FIELDS, quant_stats(x, "nvfp4", scale=1.0).tolist()))
    # 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4, 0.2 -> 0, 5.5 -> 6
    rounded = [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0, -4.0, 0.0, 6.0]
    assert got["underflow"] == 3 and got["saturated"] == 0
    assert got["sq_error"] == math.fsum((a - b) ** 2 for a, b in zip(rounded, x.tolist()))
    assert_matches(quant_stats(x, "nvfp4", scale=1.0), reference(x.tolist(), "nvfp4", 1.0), "ties")


@pytest.mark.skipif(numguard.backend() != "native", reason="the native kernels are not loaded")
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_cpu_kernel_agrees_with_the_torch_operations(fmt, dtype):
    """The native CPU kernel and the torch-operations path (any other device) give the same record,
    across chunk boundaries and thread counts (sq_error to float64 rounding: a different order)."""
    from numguard.quant import _torch_quant_stats
    spec = schema.QUANT_FORMATS[fmt]
    gen = torch.Generator().manual_seed(11)
    x = (torch.randn(200_003, generator=gen) * torch.exp2(torch.randint(-12, 12, (200_003,), generator=gen)))
    x[::97] = 0.0
    x[5] = float("nan")
    x = x.to(dtype)
    want = _torch_quant_stats(x, spec, None)
    threads = torch.get_num_threads()
    try:
        for n_threads in (1, 2):
            torch.set_num_threads(n_threads)
            got = quant_stats(x, fmt)
            keep = [i for i, name in enumerate(schema.QUANT_FIELDS) if name != "sq_error"]
            assert torch.equal(got[keep], want[keep]), (got, want)
            assert got[schema.Q_SQ_ERROR].item() == pytest.approx(want[schema.Q_SQ_ERROR].item(), rel=1e-9)
    finally:
        torch.set_num_threads(threads)
