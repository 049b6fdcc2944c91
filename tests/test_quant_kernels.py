"""The CPU quant_stats kernel's vector paths (csrc/cpu/quant_impl.inc: NOTE: [quant fast groups],
[quant lanes]) on inputs long enough to take them: values on every binade of each element grid,
on its rounding ties and one float32 step either side, near and beyond the format's max, zeros,
subnormals, NaN/Inf in some sub-blocks and not others, ragged ends. Exact against the element-by-
element reference of test_quant_stats, and bit-identical (sq_error included) for every
NUMGUARD_CPU_ISA level and thread count."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import numguard
from numguard import schema
from numguard.quant import _torch_quant_stats, quant_stats

from test_quant_stats import assert_matches, reference

pytestmark = pytest.mark.skipif(numguard.backend() != "native", reason="the native kernels are not loaded")

FORMATS = list(schema.QUANT_FORMATS)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUB_BLOCK = 256            # kQuantSubBlock
CHUNK = 1 << 16            # kQuantChunkElements


def _element_params(element):
    """(mantissa bits, smallest normal exponent, largest exponent) of the element format."""
    return {"float8_e4m3fn": (3, -6, 8), "float8_e5m2": (2, -14, 15), "float4_e2m1": (1, 0, 2)}[element]


def grid_values(element, vmax):
    """float32 magnitudes on, between and one float32 step around every grid point and tie of the
    element format, from below its smallest subnormal to its max and a little beyond."""
    m, min_exp, emax = _element_params(element)
    out = []
    for e in range(min_exp - m - 2, emax + 1):
        step = 2.0 ** (max(e, min_exp) - m)
        for k in range(0, 2 ** (m + 1) + 1):
            for v in (2.0 ** e + k * step / 2,):
                v32 = np.float32(v)
                out += [v32, np.nextafter(v32, np.float32(0)), np.nextafter(v32, np.float32(np.inf))]
    out += [np.float32(vmax), np.nextafter(np.float32(vmax), np.float32(np.inf)), np.float32(vmax * 1.03),
            np.float32(vmax * 1.99), np.float32(vmax * 2.0), np.float32(vmax * 2.5), np.float32(vmax * 1e6)]
    return np.array(out, dtype=np.float32)


def vector_input(fmt, seed=0, n=3 * SUB_BLOCK * 8 + 77):
    """A float32 tensor of n values whose sub-blocks take every path: clean normal values (the fast
    pass), grid values with ties and zeros (the counting pass), values beyond the max (saturation
    within and beyond twice the max), NaN/Inf (the reference), all signs."""
    spec = schema.QUANT_FORMATS[fmt]
    gen = np.random.default_rng(seed)
    x = gen.standard_normal(n).astype(np.float32) * np.float32(2.0 ** gen.integers(-3, 4))
    grid = grid_values(spec.element, spec.element_max)
    grid = np.concatenate([grid, -grid])
    start = SUB_BLOCK * 2
    x[start:start + len(grid)] = grid  # from the third sub-block on
    x[SUB_BLOCK * 6 + 5] = 0.0
    x[SUB_BLOCK * 6 + 9] = -0.0
    x[SUB_BLOCK * 7 + 3] = np.nan
    x[SUB_BLOCK * 7 + 100] = -np.inf
    x[-3] = np.float32(1e-40)   # a float32 subnormal in the ragged end
    return torch.from_numpy(x)


@pytest.mark.parametrize("fmt", FORMATS)
def test_vector_paths_match_the_element_by_element_reference(fmt):
    x = vector_input(fmt)
    assert_matches(quant_stats(x, fmt), reference(x.tolist(), fmt), fmt)


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("scale", [0.25, 64.0, 2.0 ** -40, 3.0])
def test_per_tensor_scales_power_of_two_and_not(fmt, scale):
    """A power-of-two scale takes the vector passes (errors exact after dividing back); 2^-40
    pushes small values below float32's normal range (they must go to the reference); 3 is
    not a power of two (the reference throughout)."""
    x = vector_input(fmt, seed=1) * (1.0 / scale)
    assert_matches(quant_stats(x, fmt, scale=scale), reference(x.tolist(), fmt, scale), (fmt, scale))


def test_mx_blocks_whose_amax_sets_each_exponent():
    """Each 32-block led by 2^emax * (1 + k/8): the shared exponent is 0, 1 or the block
    saturates (mantissa above 1.75), with grid values and ties behind it."""
    for fmt in ("mxfp8_e4m3", "mxfp8_e5m2"):
        spec = schema.QUANT_FORMATS[fmt]
        grid = grid_values(spec.element, spec.element_max)
        grid = grid[grid <= spec.element_max]
        lead = [np.float32(2.0 ** spec.element_emax * (1 + k / 8)) for k in range(8)]
        blocks = []
        for b in range(len(grid) // 31):
            blocks += [lead[b % 8]] + list(grid[31 * b:31 * b + 31])
        x = torch.tensor(np.array(blocks, dtype=np.float32) * np.float32(2.0 ** (b % 5 - 2)))
        assert_matches(quant_stats(x, fmt), reference(x.tolist(), fmt), fmt)


def test_nvfp4_blocks_on_every_e2m1_tie():
    """g = 1 and each 16-block led by 6.0: s = 1 and v = x, so every e2m1 tie and its float32
    neighbours are rounded by the vector pass; some blocks lead with 5.9 (s rounds, v != x)."""
    grid = grid_values("float4_e2m1", 6.0)
    blocks = []
    for b in range(len(grid) // 15 + 1):
        part = list(grid[15 * b:15 * b + 15])
        blocks += [np.float32(6.0 if b % 3 else 5.9)] + part + [np.float32(0.5)] * (15 - len(part))
    x = torch.tensor(np.array(blocks, dtype=np.float32))
    x = torch.cat([x, -x])
    assert_matches(quant_stats(x, "nvfp4", scale=1.0), reference(x.tolist(), "nvfp4", 1.0), "nvfp4 ties")
    assert_matches(quant_stats(x, "nvfp4"), reference(x.tolist(), "nvfp4"), "nvfp4 default g")


@pytest.mark.parametrize("fmt", FORMATS)
def test_exactly_representable_sums_are_exact(fmt):
    """Values with 10 significant bits in [1/4, 4): every squared error and every partial sum is
    exact in float64, so any order of summation gives fsum's value: the kernel's lanes must too."""
    gen = np.random.default_rng(7)
    n = 4 * SUB_BLOCK + 48
    x = (1.0 + gen.integers(0, 1024, n) / 1024.0) * 2.0 ** gen.integers(-2, 2, n)
    x = torch.tensor(x, dtype=torch.float32)
    got = dict(zip(schema.QUANT_FIELDS, quant_stats(x, fmt).tolist()))
    assert got["sq_error"] == reference(x.tolist(), fmt)["sq_error"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_long_inputs_against_the_torch_operations(fmt):
    """Several chunks and a ragged end: the torch-operations path (independent rounding: torch's
    own float8 casts) agrees on every field; sq_error to float64 rounding."""
    gen = torch.Generator().manual_seed(3)
    n = 2 * CHUNK + SUB_BLOCK + 19
    x = torch.randn(n, generator=gen) * torch.exp2(torch.randint(-14, 10, (n,), generator=gen)).float()
    x[::1013] = 0.0
    x[CHUNK + 7] = float("nan")
    want = _torch_quant_stats(x, schema.QUANT_FORMATS[fmt], None)
    got = quant_stats(x, fmt)
    keep = [i for i, name in enumerate(schema.QUANT_FIELDS) if name != "sq_error"]
    assert torch.equal(got[keep], want[keep]), (got, want)
    assert got[schema.Q_SQ_ERROR].item() == pytest.approx(want[schema.Q_SQ_ERROR].item(), rel=1e-12)


@pytest.mark.parametrize("n", [1, 15, 16, 17, 31, 32, 33, SUB_BLOCK - 1, SUB_BLOCK, SUB_BLOCK + 1,
                               CHUNK - 1, CHUNK + 1])
def test_ragged_lengths(n):
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=gen) * 3
    for fmt in FORMATS:
        if n <= 2 * SUB_BLOCK + 1:
            assert_matches(quant_stats(x, fmt), reference(x.tolist(), fmt), (fmt, n))
        else:
            want = _torch_quant_stats(x, schema.QUANT_FORMATS[fmt], None)
            got = quant_stats(x, fmt)
            assert torch.equal(got[:5], want[:5]) and torch.equal(got[6:], want[6:]), (fmt, n, got, want)


# ------------------------------------------------------------------------------------------------
# Inputs read as they are (NOTE: [quant inputs]) and the vector passes added for them.

def half_hostile(dtype, fmt, seed=0):
    """A bfloat16 / float16 tensor whose sub-blocks take every path: vector_input's values as the
    dtype holds them, then the dtype's own specials: its max, its subnormals (float16's are
    float32 normals of binades -24 to -15), +-Inf, NaN, -0.0, ties of the element grid that the
    dtype holds exactly."""
    x = vector_input(fmt, seed=seed).to(dtype)
    finfo = torch.finfo(dtype)
    special = [finfo.max, -finfo.max, finfo.tiny, finfo.tiny / 2, finfo.tiny / 1024, -finfo.tiny / 8,
               float("inf"), -float("inf"), float("nan"), -0.0, 0.0, 448.0, 464.0, 0.75, 2.0 ** -10, 2.0 ** -17]
    start = SUB_BLOCK * 5 + 3
    x[start:start + len(special)] = torch.tensor(special, dtype=torch.float64).to(dtype)
    return x


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_read_directly_equal_their_float32_copy_bit_for_bit(fmt, dtype):
    """The kernels widen bfloat16 / float16 in registers: the record (sq_error too: the same terms
    in the same lanes) is the one of the float32 copy, and right against the reference."""
    x = half_hostile(dtype, fmt)
    got = quant_stats(x, fmt)
    assert [v.hex() for v in got.tolist()] == [v.hex() for v in quant_stats(x.float(), fmt).tolist()], fmt
    assert_matches(got, reference(x.float().tolist(), fmt), (fmt, dtype))
    for scale in ([0.5, 3.0] if fmt.startswith("float8") else [3.0] if fmt == "nvfp4" else []):
        want = quant_stats(x.float(), fmt, scale=scale)
        assert [v.hex() for v in quant_stats(x, fmt, scale=scale).tolist()] == [v.hex() for v in want.tolist()]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_every_bit_pattern(dtype):
    """Every one of the 65536 bit patterns of the dtype, widened by the kernels, against torch's
    own conversion: amax and the counts say each value was read as torch reads it."""
    x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    for fmt in ("float8_e4m3fn", "mxfp8_e5m2"):
        got = quant_stats(x, fmt)
        want = quant_stats(x.float(), fmt)
        assert [v.hex() for v in got.tolist()] == [v.hex() for v in want.tolist()], (fmt, got, want)


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("scale", [3.0, 0.1, 1000.0 / 7.0, 2.0 ** 20 / 3.0])
def test_a_scale_not_a_power_of_two_one_element_at_a_time(fmt, scale):
    """The vector pass of a scale that is not a power of two (NOTE: [quant general scale]): one
    non-zero element per tensor of a full sub-block, so the record's sq_error is that element's
    squared error alone, which must equal the reference's bit for bit (q / scale in float64)."""
    spec = schema.QUANT_FORMATS[fmt]
    values = grid_values(spec.element, spec.element_max) / np.float32(scale)
    for i, v in enumerate(values[::3]):
        x = torch.zeros(SUB_BLOCK)
        x[(7 * i) % SUB_BLOCK] = float(v) if i % 2 else -float(v)
        got = dict(zip(schema.QUANT_FIELDS, quant_stats(x, fmt, scale=scale).tolist()))
        want = reference(x.tolist(), fmt, scale)
        assert got == want, (fmt, scale, float(v), got, want)


def test_nvfp4_blocks_whose_scale_rounds_to_zero_take_the_vector_pass():
    """All-zero blocks (ReLU, padding) and blocks far below the tensor's amax have s = 0: v = 0, the
    block underflows whole, and no scale exponent is noted; beside ordinary blocks."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(8 * SUB_BLOCK + 16, generator=gen)
    blocks = x.view(-1, 16)
    blocks[::3] = 0.0
    blocks[1::5] *= 1e-7
    blocks[2::7, 3] = -0.0
    for scale in (None, 1.0):
        want = reference(x.tolist(), "nvfp4", scale)
        assert_matches(quant_stats(x, "nvfp4", scale=scale), want, ("nvfp4 zero scales", scale))
        assert_matches(quant_stats(x.bfloat16(), "nvfp4", scale=scale),
                       reference(x.bfloat16().float().tolist(), "nvfp4", scale), ("bf16", scale))


def test_non_contiguous_half_inputs_are_copied_in_row_major_order():
    x = half_hostile(torch.float16, "mxfp8_e4m3")[:3 * SUB_BLOCK * 4].view(3 * SUB_BLOCK, 4)
    for fmt in FORMATS:
        assert torch.equal(quant_stats(x.t(), fmt), quant_stats(x.t().contiguous(), fmt)), fmt


# ------------------------------------------------------------------------------------------------
# Every instruction-set level and thread count: one process per level (the level is chosen once
# per process), records compared bit for bit.

_LEVEL_SCRIPT = r"""
import json, sys, torch
sys.path.insert(0, {root!r}); sys.path.insert(0, {tests!r})
import numguard
from test_quant_kernels import vector_input, half_hostile, CHUNK
out = {{"isa": numguard.ops.native_module().cpu_capabilities()}}
gen = torch.Generator().manual_seed(5)
n = 3 * CHUNK + 1000
big = torch.randn(n, generator=gen) * torch.exp2(torch.randint(-12, 12, (n,), generator=gen)).float()
big[::777] = 0.0
big[CHUNK + 3] = float("inf")
for threads in (1, 2, 3):
    torch.set_num_threads(threads)
    for fmt in {formats!r}:
        for name, x, scale in (("grid", vector_input(fmt), None), ("big", big, None),
                               ("big-strided", big.view(-1, 8)[:, ::2], None),
                               ("bf16", big.to(torch.bfloat16), None),
                               ("f16", big.to(torch.float16), None),
                               ("f16-hostile", half_hostile(torch.float16, fmt), None),
                               ("scaled", big, 0.5 if fmt.startswith("float8") or fmt == "nvfp4" else None),
                               ("general-scale", big, 3.0 if fmt.startswith("float8") or fmt == "nvfp4" else None),
                               ("general-f16", half_hostile(torch.float16, fmt),
                                1000.0 / 7.0 if fmt.startswith("float8") else None)):
            rec = numguard.quant_stats(x, fmt, scale=scale)
            out[f"{{threads}}/{{fmt}}/{{name}}"] = [v.hex() for v in rec.tolist()]
print("RESULT" + json.dumps(out))
"""


def _records_under(level):
    env = dict(os.environ, NUMGUARD_CPU_ISA=level, NUMGUARD_BACKEND="native")
    script = _LEVEL_SCRIPT.format(root=ROOT, tests=os.path.join(ROOT, "tests"), formats=FORMATS)
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    line = [ln for ln in run.stdout.splitlines() if ln.startswith("RESULT")][0]
    return json.loads(line[len("RESULT"):])


def test_every_level_and_thread_count_gives_the_same_bits():
    levels = ("baseline", "avx2", "avx512")  # a level this CPU lacks runs the best it has
    results = {lv: _records_under(lv) for lv in levels}
    assert results["baseline"]["isa"][1] == "active=baseline"
    first = results[levels[0]]
    keys = [k for k in first if k != "isa"]
    for lv in levels:
        for key in keys:
            fmt_case = key.split("/", 1)[1]
            assert results[lv][key] == first[key], (lv, key)               # across levels
            assert results[lv][key] == results[lv][f"1/{fmt_case}"], (lv, key)  # across thread counts
    for key in keys:  # and the records are right: every field but sq_error against the torch path
        threads, fmt, name = key.split("/")
        if name != "grid" or threads != "1":
            continue
        got = [float.fromhex(v) for v in first[key]]
        want = reference(vector_input(fmt).tolist(), fmt)
        assert_matches(torch.tensor(got, dtype=torch.float64), want, key)
    assert math.isfinite(float.fromhex(first["1/nvfp4/big"][schema.Q_SQ_ERROR]))
