"""numguard's ops (tensor_stats, multi_tensor_stats, record_) against a plain-torch float64
reference, with exact equality, on every dtype, hostile values, boundary sizes and layouts; for
both the native kernels (torch.ops.numguard) and the pure-PyTorch fallback (numguard._torch_ops)."""
import contextlib
import math
import os
import re
import subprocess
import sys
import types
import warnings

import pytest
import torch

import numguard
from numguard import _torch_ops
from numguard.schema import ABS_MAX
from conftest import DEVICES, HAS_CUDA, NATIVE, no_host_sync, requires_native
from inspector_helpers import SyncCounter

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INF = float("inf")

FLOAT_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn,
                torch.float8_e5m2]
INT_DTYPES = [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16, torch.uint32,
              torch.uint64]
ALL_DTYPES = FLOAT_DTYPES + INT_DTYPES + [torch.bool]
LOW_PRECISION = (torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)


def _kernel_constants():
    """Block, chunk and buffer sizes of the CPU kernels, read from their header so that boundary
    tests follow the constants the kernels really use."""
    constants = {"kFastBlockBytes": 4096, "kNarrowSubBlock": 128, "kWideSubBlock": 4096,
                 "kChunkBytes": 256 * 1024, "kParallelMinBytes": 512 * 1024, "kDirectRunElements": 256,
                 "kGatherBytes": 16 * 1024}
    try:
        with open(os.path.join(REPO, "csrc", "cpu", "reduce_kernels.h")) as f:
            text = f.read()
    except OSError:
        return constants
    for name, expr in re.findall(r"constexpr int64_t (k\w+) = ([0-9 *]+);", text):
        constants[name] = math.prod(int(part) for part in expr.split("*"))
    return constants


K = _kernel_constants()


def boundary_sizes(itemsize):
    """Element counts on both sides of every internal block, sub-block, chunk and buffer boundary."""
    edges = {K["kFastBlockBytes"] // itemsize, K["kNarrowSubBlock"], K["kWideSubBlock"],
             K["kChunkBytes"] // itemsize, K["kParallelMinBytes"] // itemsize, K["kGatherBytes"] // itemsize,
             K["kDirectRunElements"], 64 // itemsize, 16}
    sizes = {1, 2, 3, 5, 17, 33, 63}
    for e in edges:
        sizes.update({e - 1, e, e + 1, 2 * e + 1})
    return sorted(s for s in sizes if s > 0)


# ---------------------------------------------------------------------------------------------
# Reference and inputs


def reference_stats(x):
    """The stats record (numguard.STAT_FIELDS) computed with plain torch ops in float64 (every supported dtype
    converts to float64 monotonically, floats exactly)."""
    if x.numel() == 0:
        return torch.tensor([INF, 0.0, INF, 0, 0, 0, 0, 0], dtype=torch.float64)
    v = x.detach().cpu().reshape(-1)
    if v.dtype == torch.bool:  # a bool is 0 or 1 whatever non-zero byte stores it
        v = v.view(torch.uint8) != 0
    v = v.to(torch.float64)
    finite = v[torch.isfinite(v)].abs()
    nonzero = finite[finite != 0]
    tiny = torch.finfo(x.dtype).tiny if x.is_floating_point() else 0.0
    record = [
        finite.min().item() if finite.numel() else INF,
        finite.max().item() if finite.numel() else 0.0,
        nonzero.min().item() if nonzero.numel() else INF,
        torch.isnan(v).sum().item(),
        (v == INF).sum().item(),
        (v == -INF).sum().item(),
        (v == 0).sum().item(),
        (nonzero < tiny).sum().item(),
    ]
    return torch.tensor(record, dtype=torch.float64)


def assert_records_equal(actual, expected, what=""):
    actual = actual.detach().cpu()
    assert actual.dtype == torch.float64 and actual.shape == expected.shape, (actual.dtype, actual.shape)
    same = (actual == expected) | (torch.isnan(actual) & torch.isnan(expected))
    if not bool(same.all()):
        rows = actual.reshape(-1, 8), expected.reshape(-1, 8)
        bad = (~same.reshape(-1, 8)).any(1).nonzero().flatten().tolist()
        detail = "; ".join(f"row {i}: got {rows[0][i].tolist()} want {rows[1][i].tolist()}" for i in bad[:3])
        pytest.fail(f"{what} records differ ({len(bad)} rows): {detail}")


# (view dtype for the raw bits, exponent bits, mantissa bits, has infinities)
FORMATS = {
    torch.float64: (torch.int64, 11, 52, True),
    torch.float32: (torch.int32, 8, 23, True),
    torch.float16: (torch.int16, 5, 10, True),
    torch.bfloat16: (torch.int16, 8, 7, True),
    torch.float8_e5m2: (torch.uint8, 5, 2, True),
    torch.float8_e4m3fn: (torch.uint8, 4, 3, False),
}


def from_bits(patterns, dtype):
    view, e, m, _ = FORMATS[dtype]
    bits = 1 + e + m
    signed = view.is_signed
    values = [p - (1 << bits) if signed and p >= (1 << (bits - 1)) else p for p in patterns]
    return torch.tensor(values, dtype=view).view(dtype)


def special_bits(dtype):
    """Raw bit patterns of every class of value: ±0, smallest/largest subnormal, smallest normal,
    1.0, ±finfo.max, ±Inf and NaNs (signed and quiet/signalling where the format has them)."""
    _, e, m, has_inf = FORMATS[dtype]
    sign = 1 << (e + m)
    all_ones_exp = ((1 << e) - 1) << m
    one = ((1 << (e - 1)) - 1) << m
    if has_inf:
        max_finite = all_ones_exp - 1
        nonfinite = [all_ones_exp, all_ones_exp + 1, all_ones_exp | ((1 << m) - 1)]
        if m > 1:
            nonfinite.append(all_ones_exp | (1 << (m - 1)))
    else:  # e4m3fn: only S.1111.111 is NaN
        max_finite = sign - 2
        nonfinite = [sign - 1]
    mags = [0, 1, (1 << m) - 1, 1 << m, (1 << m) + 1, one, one + 1, max_finite - 1, max_finite]
    mags = mags + nonfinite
    return mags + [sign | v for v in mags]


BITS_ONLY = (torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16, torch.uint32, torch.uint64)
SIGNED_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def on_bits(x, fn):
    """fn applied to x's raw bits (fp8 and uint16/32/64 lack many ops: flip, repeat, indexing...)."""
    if x.dtype in BITS_ONLY:
        return fn(x.view(SIGNED_OF_SIZE[x.element_size()])).view(x.dtype)
    return fn(x)


def hostile_values(dtype):
    if dtype.is_floating_point:
        return from_bits(special_bits(dtype), dtype)
    if dtype == torch.bool:
        return torch.tensor([True, False, True])
    info = torch.iinfo(dtype)
    values = [0, 1, -1, 2, -2, 100, -100, info.min, info.min + 1, info.max, info.max - 1]
    values = [v for v in values if info.min <= v <= info.max]
    if dtype == torch.uint64:  # beyond int64: build from the bit pattern
        return torch.tensor([v if v <= 2**63 - 1 else v - 2**64 for v in values],
                            dtype=torch.int64).view(torch.uint64)
    return torch.tensor(values, dtype=torch.int64).to(dtype)


def ordinary_values(dtype, n, gen, clean=False):
    """n typical values: random normals, or (clean) values that are all normal, finite, non-zero."""
    if dtype.is_floating_point:
        if clean:
            v = (torch.rand(n, generator=gen) + 1) * (torch.randint(0, 2, (n,), generator=gen) * 2 - 1)
        else:
            v = torch.randn(n, generator=gen) * 3
        return v.to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=gen).bool()
    low = -100 if dtype.is_signed else 1 if clean else 0
    return torch.randint(low, 101, (n,), generator=gen).to(dtype)


def planted(dtype, n, gen, clean=False):
    """Typical values with the hostile ones planted at both ends, at internal boundaries and at
    random places."""
    x = ordinary_values(dtype, n, gen, clean)
    bad = hostile_values(dtype)
    spots = {0, n - 1, n // 2}
    for edge in (K["kFastBlockBytes"] // x.element_size(), K["kNarrowSubBlock"], K["kWideSubBlock"],
                 K["kChunkBytes"] // x.element_size()):
        spots.update({edge - 1, edge, 3 * edge + 1})
    spots.update(torch.randint(0, n, (4,), generator=gen).tolist())
    spots = sorted(s for s in spots if 0 <= s < n)
    xb, badb = x, bad
    if x.dtype in BITS_ONLY:
        xb, badb = x.view(SIGNED_OF_SIZE[x.element_size()]), bad.view(SIGNED_OF_SIZE[x.element_size()])
    for i, s in enumerate(spots):
        xb[s] = badb[(i * 7 + n) % bad.numel()]
    return x


# ---------------------------------------------------------------------------------------------
# Backends

def _native_has_kernel(device):
    key = "CUDA" if torch.device(device).type == "cuda" else "CPU"
    return NATIVE and torch._C._dispatch_has_kernel_for_dispatch_key("numguard::tensor_stats", key)


def ops_for(backend, device="cpu"):
    if backend == "native":
        if not _native_has_kernel(device):
            pytest.skip(f"the native extension has no {device} kernels in this build")
        return types.SimpleNamespace(tensor_stats=torch.ops.numguard.tensor_stats.default,
                                     multi_tensor_stats=torch.ops.numguard.multi_tensor_stats.default,
                                     record_=torch.ops.numguard.record_.default)
    def record_(ring, state, xs, position, headroom, context=0):
        _torch_ops.record_(ring, state, xs, position, headroom, numguard.ops.headroom_limits(xs), context)

    return types.SimpleNamespace(tensor_stats=_torch_ops.tensor_stats,
                                 multi_tensor_stats=_torch_ops.multi_tensor_stats, record_=record_)


BACKENDS = [pytest.param("native", marks=requires_native), "torch"]


def dtype_id(dtype):
    return str(dtype).replace("torch.", "")


@contextlib.contextmanager
def num_threads(n):
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


# ---------------------------------------------------------------------------------------------
# tensor_stats / multi_tensor_stats against the reference

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("backend", BACKENDS)
def test_hostile_values(backend, dtype, device):
    ops = ops_for(backend, device)
    base = hostile_values(dtype)
    cases = {"hostile": base, "flipped": on_bits(base, lambda b: b.flip(0)),
             "repeated": on_bits(base, lambda b: b.repeat(700)),
             "single": base[-1:], "all-zero": torch.zeros(300, dtype=dtype)}
    if dtype.is_floating_point:
        nan = from_bits([special_bits(dtype)[-1]], dtype)
        cases["all-nan"] = on_bits(nan, lambda b: b.repeat(1000))
        cases["all-subnormal"] = on_bits(from_bits([1, 3, (1 << FORMATS[dtype][2]) - 1], dtype),
                                         lambda b: b.repeat(500))
        cases["max"] = from_bits([special_bits(dtype)[len(special_bits(dtype)) // 2 - 1]], dtype)
    for name, x in cases.items():
        x = x.to(device)
        with no_host_sync(device):
            got = ops.tensor_stats(x)
        assert got.device == x.device
        assert_records_equal(got, reference_stats(x), f"{dtype} {name}")
    xs = [x.to(device) for x in cases.values()]
    with no_host_sync(device):
        got = ops.multi_tensor_stats(xs)
    assert got.shape == (len(xs), 8)
    assert_records_equal(got, torch.stack([reference_stats(x) for x in xs]), f"{dtype} multi")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("backend", BACKENDS)
def test_boundary_sizes(backend, dtype, device):
    ops = ops_for(backend, device)
    gen = torch.Generator().manual_seed(1)
    sizes = boundary_sizes(torch.empty((), dtype=dtype).element_size())
    xs = []
    for n in sizes:
        xs.append(planted(dtype, n, gen).to(device))
        xs.append(ordinary_values(dtype, n, gen, clean=True).to(device))
    with no_host_sync(device):
        singles = [ops.tensor_stats(x) for x in xs]
        multi = ops.multi_tensor_stats(xs)
    expected = torch.stack([reference_stats(x) for x in xs])
    assert_records_equal(torch.stack(singles), expected, f"{dtype} tensor_stats sizes {sizes}")
    assert_records_equal(multi, expected, f"{dtype} multi_tensor_stats sizes {sizes}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("backend", BACKENDS)
def test_special_shapes(backend, dtype, device):
    ops = ops_for(backend, device)
    bad = hostile_values(dtype)
    cases = [bad[i].clone() for i in range(bad.numel())]  # 0-dim, every class of value
    cases += [torch.empty(0, dtype=dtype), torch.empty(3, 0, 5, dtype=dtype), torch.empty(0, dtype=dtype).expand(4, 0),
              bad[:1], bad[:1].reshape(1, 1, 1), bad[0].expand(3, 5)]
    for x in cases:
        x = x.to(device)
        with no_host_sync(device):
            got = ops.tensor_stats(x)
        assert got.shape == (8,)
        assert_records_equal(got, reference_stats(x), f"{dtype} shape {tuple(x.shape)}")
    xs = [x.to(device) for x in cases]
    with no_host_sync(device):
        got = ops.multi_tensor_stats(xs)
    assert_records_equal(got, torch.stack([reference_stats(x) for x in xs]), f"{dtype} multi special shapes")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("backend", BACKENDS)
def test_block_patterns(backend, dtype, device):
    """Sequences of blocks of different kinds (clean, ReLU-like with zeros, all-zero, with a
    subnormal, with a NaN or Inf), in several orders, so that every switch between the kernels'
    scan paths happens at a block boundary and inside a block."""
    ops = ops_for(backend, device)
    gen = torch.Generator().manual_seed(12)
    block = K["kFastBlockBytes"] // torch.empty((), dtype=dtype).element_size()
    bits = special_bits(dtype)
    sub, nan_or_inf = from_bits([bits[2]], dtype), from_bits([bits[-4]], dtype)

    def kind(name):
        x = ordinary_values(dtype, block, gen, clean=True)
        raw = x.view(SIGNED_OF_SIZE[x.element_size()])
        if name == "relu":
            raw[torch.randperm(block, generator=gen)[: block // 2]] = 0
        elif name == "zero":
            raw.zero_()
        elif name == "last-zero":
            raw[-1] = 0
        elif name == "sub":
            raw[block // 3] = sub.view(raw.dtype)[0]
        elif name == "nonfinite":
            raw[block - 2] = nan_or_inf.view(raw.dtype)[0]
        return x

    orders = [["clean", "relu", "clean", "zero", "sub", "relu", "nonfinite", "clean"],
              ["relu", "relu", "clean", "clean", "last-zero", "clean"],
              ["zero", "clean", "sub", "zero", "relu"]]
    xs = []
    for order in orders:
        parts = [kind(name) for name in order]
        whole = torch.cat([p.view(SIGNED_OF_SIZE[p.element_size()]) for p in parts]).view(dtype)
        xs += [whole, whole[: len(whole) - block // 2], whole[block // 2 + 1:]]
    with no_host_sync(device):
        got = ops.multi_tensor_stats([x.to(device) for x in xs])
    assert_records_equal(got, torch.stack([reference_stats(x) for x in xs]), f"{dtype} block patterns")


def layout_cases(dtype, gen):
    """Views that are not contiguous: transposed, permuted, channels_last, sliced (unit and
    non-unit inner stride, short and long runs), expanded (stride 0), overlapping."""
    x4 = planted(dtype, 2 * 3 * 37 * 41, gen).reshape(2, 3, 37, 41)
    x2 = planted(dtype, 40 * 700, gen).reshape(40, 700)
    v = planted(dtype, 5000, gen)
    return {
        "transposed": x2.t(),
        "permuted": x4.permute(3, 1, 0, 2),
        "channels_last": x4.contiguous(memory_format=torch.channels_last),
        "channels_last_sliced": x4.contiguous(memory_format=torch.channels_last)[:, 1:, ::2],
        "inner_stride_2": x2[:, 1::2],
        "short_runs": x4[:, :, 2:-3, 5:9],
        "long_runs": x2[3:37, 100:650],
        "rows_strided": x2[::3],
        "transposed_sliced": x2.t()[10:500:7, 1:],
        "expanded_middle": x2[:5, None, :].expand(5, 9, 700),
        "expanded_leading": x4[:1].expand(6, 3, 37, 41),
        "expanded_scalar": v[7].expand(300, 400),
        "expanded_then_sliced": x2[:, None, ::3].expand(40, 2, 234)[1:, :, 5:],
        "overlapping": v.as_strided((1000, 10), (3, 1)),
        "reversed_dims_noncontig": x4.transpose(0, 3)[::2],
        # 18 dims that no two of which merge (outer stride 2 * inner stride + 1), more than the
        # kernel's inline index buffer holds
        "many_dims": planted(dtype, 2**19, gen).as_strided([2] * 18, [2 ** (18 - d) - 1 for d in range(18)]),
    }


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("backend", BACKENDS)
def test_layouts(backend, dtype, device):
    ops = ops_for(backend, device)
    cases = layout_cases(dtype, torch.Generator().manual_seed(2))
    cases = {name: x.to(device) if device == "cpu" else _same_layout_on(x, device) for name, x in cases.items()}
    for name, x in cases.items():
        with no_host_sync(device):
            got = ops.tensor_stats(x)
        assert_records_equal(got, reference_stats(x), f"{dtype} {name} {tuple(x.shape)} {x.stride()}")
    xs = list(cases.values())
    with no_host_sync(device):
        got = ops.multi_tensor_stats(xs)
    assert_records_equal(got, torch.stack([reference_stats(x) for x in xs]), f"{dtype} multi layouts")


def _same_layout_on(x, device):
    """x's view (sizes, strides, offset) rebuilt over a copy of its storage on `device`."""
    storage = torch.empty(0, dtype=x.dtype).set_(x.untyped_storage()).view(-1)
    moved = storage.to(device)
    return moved.as_strided(x.shape, x.stride(), x.storage_offset())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_many_tensors(backend, device):
    """More tensors than one launch or one chunk list holds, of mixed dtypes, sizes and layouts."""
    ops = ops_for(backend, device)
    gen = torch.Generator().manual_seed(3)
    xs = []
    for i in range(1000):
        dtype = ALL_DTYPES[i % len(ALL_DTYPES)]
        n = [0, 1, 7, 1024, 1025, 3000][i % 6]
        x = planted(dtype, n, gen) if n > 0 and i % 3 == 0 else ordinary_values(dtype, n, gen)
        if i % 5 == 0 and n > 1:
            x = x[::2]
        if i % 11 == 0:
            x = x[:1].reshape(()) if x.numel() else x
        xs.append(x.to(device))
    with no_host_sync(device):
        got = ops.multi_tensor_stats(xs)
    assert_records_equal(got, torch.stack([reference_stats(x) for x in xs]), "1000 tensors")


@pytest.mark.parametrize("backend", BACKENDS)
def test_thread_count_does_not_change_records(backend):
    ops = ops_for(backend)
    gen = torch.Generator().manual_seed(4)
    chunk = K["kChunkBytes"]
    xs = [planted(torch.float32, 5 * chunk // 4 + 3, gen), planted(torch.bfloat16, 3 * chunk // 2 + 1, gen),
          planted(torch.float8_e5m2, 4 * chunk + 5, gen), planted(torch.int64, chunk + 1, gen),
          ordinary_values(torch.float32, 3 * chunk // 4, gen, clean=True),
          planted(torch.float16, 4 * chunk, gen).reshape(-1, 512).t()]
    results = []
    for threads in (1, 2, 3):
        with num_threads(threads):
            results.append((torch.stack([ops.tensor_stats(x) for x in xs]), ops.multi_tensor_stats(xs)))
    for single, multi in results[1:]:
        assert torch.equal(single, results[0][0])
        assert torch.equal(multi, results[0][1])
    assert_records_equal(results[0][1], torch.stack([reference_stats(x) for x in xs]), "threads")


# ---------------------------------------------------------------------------------------------
# Native-specific: instruction-set levels, build facts, opcheck, torch.compile

ISA_SCRIPT = r"""
import sys, torch, numguard
from numguard.ops import native_module
torch.manual_seed(5)
xs = []
for dtype in [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn,
              torch.float8_e5m2, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool]:
    v = torch.randn(70005) * 1e3
    v[::97] = float('nan'); v[::101] = float('inf'); v[::103] = 0.0; v[::107] = 1e-42; v[::109] = -float('inf')
    if dtype.is_floating_point or dtype == torch.bool:
        xs.append(v.to(dtype))
    else:
        xs.append(v.nan_to_num(0, 0, 0).clamp(-1e4, 1e4).to(dtype))
    xs.append(xs[-1][5:].reshape(-1, 7).t())
rec = numguard.multi_tensor_stats(xs)
print(native_module().cpu_capabilities()[1])
print(rec.view(torch.int64).tolist())
"""


@requires_native
def test_isa_levels_give_identical_records():
    outputs = {}
    for isa in ("baseline", "avx2", "avx512"):
        env = {k: v for k, v in os.environ.items() if not k.startswith("NUMGUARD")}
        env["NUMGUARD_CPU_ISA"] = isa
        out = subprocess.run([sys.executable, "-c", ISA_SCRIPT], capture_output=True, text=True, env=env,
                             cwd=REPO, timeout=300)
        assert out.returncode == 0, out.stderr
        active, records = out.stdout.splitlines()
        outputs[isa] = records
        built = numguard.ops.native_module().cpu_capabilities()[0].split("=")[1].split(",")
        assert active.startswith("active="), active
        assert active.split("=")[1] in built
        if isa == "baseline":
            assert active == "active=baseline"
    assert outputs["baseline"] == outputs["avx2"] == outputs["avx512"]


@requires_native
def test_cpu_capabilities_and_cuda_architectures():
    caps = numguard.ops.native_module().cpu_capabilities()
    assert caps[0].startswith("built=") and caps[1].startswith("active=")
    built = caps[0].split("=")[1].split(",")
    assert "baseline" in built
    assert caps[1].split("=")[1] in built
    if "avx512" in built and os.environ.get("NUMGUARD_CPU_ISA") is None:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
        if all(flag in flags.split() for flag in ("avx512f", "avx512bw", "avx512vl", "avx512dq")):
            assert caps[1] == "active=avx512"
    archs = numguard.ops.native_module().cuda_architectures()
    assert isinstance(archs, list)
    if not torch._C._dispatch_has_kernel_for_dispatch_key("numguard::tensor_stats", "CUDA"):
        assert archs == []


def sample_inputs(device):
    gen = torch.Generator().manual_seed(6)
    xs = [planted(torch.float32, 1000, gen), planted(torch.bfloat16, 77, gen).reshape(7, 11).t(),
          hostile_values(torch.float16), torch.empty(0, dtype=torch.float16), hostile_values(torch.int32),
          torch.tensor(3.0)]
    return [x.to(device) for x in xs]


@requires_native
@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    ops_for("native", device)
    xs = sample_inputs(device)
    for x in xs:
        torch.library.opcheck(torch.ops.numguard.tensor_stats.default, (x,))
    torch.library.opcheck(torch.ops.numguard.multi_tensor_stats.default, (xs,))
    ring, state = numguard.ops.new_ring(4, device)
    torch.library.opcheck(torch.ops.numguard.record_.default, (ring, state, xs[:3], 2, 0.5))
    ring, state = numguard.ops.new_ring(4, device)
    torch.library.opcheck(torch.ops.numguard.record_.default, (ring, state, [xs[0][:10].abs() + 1], 0, 0.0))


@requires_native
def test_torch_compile_fullgraph():
    import torch._dynamo

    torch._dynamo.reset()

    def step(x, w, ring, state):
        y = torch.relu(x @ w)
        single = numguard.tensor_stats(y)
        both = numguard.multi_tensor_stats([x, y])
        numguard.record_(ring, state, [x, y], 3, 0.5)
        return single, both

    gen = torch.Generator().manual_seed(7)
    x = torch.randn(8, 16, generator=gen)
    x[1, 2] = float("nan")
    w = torch.randn(16, 4, generator=gen)
    ring_c, state_c = numguard.ops.new_ring(4)
    ring_e, state_e = numguard.ops.new_ring(4)
    compiled = torch.compile(step, fullgraph=True, backend="inductor")
    got = compiled(x, w, ring_c, state_c)
    want = step(x, w, ring_e, state_e)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(ring_c, ring_e) and torch.equal(state_c, state_e)
    assert state_c.tolist() == [1, 3, 0, -1]


# ---------------------------------------------------------------------------------------------
# record_

def _frames(device):
    gen = torch.Generator().manual_seed(8)
    clean = [ordinary_values(torch.float32, 50, gen, clean=True), ordinary_values(torch.bfloat16, 9, gen, clean=True)]
    nan = ordinary_values(torch.float16, 30, gen, clean=True)
    nan[4] = float("nan")
    inf = ordinary_values(torch.float32, 30, gen, clean=True)
    inf[0] = -INF
    return [x.to(device) for x in clean], nan.to(device), inf.to(device)


def _record(ops, ring, state, xs, position, headroom=0.0, context=0):
    with no_host_sync(ring.device):
        ops.record_(ring, state, xs, position, headroom, context)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_record_writes_rows_and_wraps_around(backend, device):
    ops = ops_for(backend, device)
    (a, b), _, _ = _frames(device)
    ring, state = numguard.ops.new_ring(4, device)
    _record(ops, ring, state, [a, b], 0)
    _record(ops, ring, state, [b, a, b], 2)  # positions 2, 3, 4 -> rows 2, 3, 0
    ra, rb = reference_stats(a), reference_stats(b)
    assert_records_equal(ring, torch.stack([rb, rb, rb, ra]), "wrap-around")
    assert state.tolist() == [0, -1, 0, -1]
    _record(ops, ring, state, [], 5)  # nothing to record: nothing changes
    assert state.tolist() == [0, -1, 0, -1]
    _record(ops, ring, state, [a], 9)  # 9 % 4 == 1
    assert_records_equal(ring[1], ra, "row 1")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_record_freezes_on_trip_and_keeps_first_offender(backend, device):
    ops = ops_for(backend, device)
    (a, b), nan, inf = _frames(device)
    ring, state = numguard.ops.new_ring(8, device)
    _record(ops, ring, state, [a, b], 10)
    assert state.tolist() == [0, -1, 0, -1]
    # The tripping frame is written whole, records after the offender included.
    _record(ops, ring, state, [a, nan, inf, b], 12)
    assert state.tolist() == [1, 13, 0, -1]
    expected = ring.clone()
    for i, x in enumerate([a, nan, inf, b]):
        expected[(12 + i) % 8] = reference_stats(x)
    assert_records_equal(ring, expected, "tripping frame")
    frozen = ring.clone()
    # Later frames are not written, and a later trip does not move the first offender.
    _record(ops, ring, state, [inf, a, nan], 16, headroom=1e-9)
    _record(ops, ring, state, [b], 19)
    assert torch.equal(ring, frozen)
    assert state.tolist() == [1, 13, 0, -1]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_record_context_records_trip_only_with_a_later_one(backend, device):
    """NOTE: [context records]: the first `context` records (a call's inputs) trip only when a
    later record of the frame holds NaN/Inf too; the trip then points at the first bad record."""
    ops = ops_for(backend, device)
    (a, b), nan, inf = _frames(device)
    ring, state = numguard.ops.new_ring(8, device)
    _record(ops, ring, state, [nan, inf, a], 0, context=2)  # bad inputs, finite output: context
    assert state.tolist() == [0, -1, 0, -1]
    assert_records_equal(ring[:3], torch.stack([reference_stats(x) for x in (nan, inf, a)]), "context rows")
    _record(ops, ring, state, [nan, a, b], 3, context=3)  # only inputs: nothing to pass a NaN on
    assert state.tolist() == [0, -1, 0, -1]
    _record(ops, ring, state, [a, nan, b, inf], 10, context=2)  # a bad output: trips at the first bad
    assert state.tolist() == [1, 11, 0, -1]
    ring, state = numguard.ops.new_ring(8, device)
    _record(ops, ring, state, [nan, a], 0, context=0)  # context 0: Transformers' rule
    assert state.tolist() == [1, 0, 0, -1]
    ring, state = numguard.ops.new_ring(8, device)
    low = torch.tensor([60000.0], dtype=torch.float16, device=device)
    _record(ops, ring, state, [low, a], 0, headroom=0.9, context=1)  # headroom counts for inputs too
    assert state.tolist() == [0, -1, 1, 0]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_record_first_offender_within_one_frame(backend, device):
    ops = ops_for(backend, device)
    (a, b), nan, inf = _frames(device)
    ring, state = numguard.ops.new_ring(3, device)
    _record(ops, ring, state, [a, b, inf, nan, a], 100)  # more records than ring rows
    assert state.tolist() == [1, 102, 0, -1]
    if torch.device(device).type == "cpu":
        # positions 100..104 -> rows 1, 2, 0, 1, 2: on the CPU the later positions own the rows (a
        # device may write rows of one frame in any order when the frame outgrows the ring)
        assert_records_equal(ring, torch.stack([reference_stats(x) for x in (inf, nan, a)]), "overlapping rows")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_record_headroom_flag(backend, device):
    ops = ops_for(backend, device)
    big32 = torch.tensor([1e38, -3e38], device=device)  # fp32 is never checked for headroom
    low = torch.tensor([1.0, -60000.0], dtype=torch.float16, device=device)  # 60000 > 0.9 * 65504
    fp8 = torch.tensor([440.0], dtype=torch.float8_e4m3fn, device=device)  # 440 > 0.9 * 448
    ok16 = torch.tensor([50000.0], dtype=torch.float16, device=device)
    ring, state = numguard.ops.new_ring(4, device)
    _record(ops, ring, state, [big32, ok16], 0, headroom=0.9)
    assert state.tolist() == [0, -1, 0, -1]
    _record(ops, ring, state, [low], 5, headroom=0.0)  # 0 disables the check
    assert state.tolist() == [0, -1, 0, -1]
    _record(ops, ring, state, [big32, ok16, low, fp8], 6, headroom=0.9)
    assert state.tolist() == [0, -1, 1, 8]
    _record(ops, ring, state, [fp8], 10, headroom=0.9)  # only the first one counts
    assert state.tolist() == [0, -1, 1, 8]
    ring, state = numguard.ops.new_ring(4, device)
    _record(ops, ring, state, [fp8], 0, headroom=0.5)
    bf = torch.tensor([3e38], dtype=torch.bfloat16, device=device)  # bf16 max ~3.39e38
    _record(ops, ring, state, [bf], 1, headroom=0.5)
    assert state.tolist() == [0, -1, 1, 0]
    # A frame that trips and crosses the headroom sets both, at their own positions.
    ring, state = numguard.ops.new_ring(4, device)
    nan16 = torch.tensor([float("nan"), 1.0], dtype=torch.float16, device=device)
    _record(ops, ring, state, [nan16, low], 20, headroom=0.9)
    assert state.tolist() == [1, 20, 1, 21]


@requires_native
@pytest.mark.parametrize("device", DEVICES)
def test_record_parity_native_vs_fallback(device):
    native, fallback = ops_for("native", device), ops_for("torch", device)
    gen = torch.Generator().manual_seed(9)
    frames = []
    for step in range(12):
        dtype = [torch.float16, torch.bfloat16, torch.float8_e5m2, torch.float32][step % 4]
        xs = [(ordinary_values(torch.float32, 40 + step, gen, clean=True) * 100).to(dtype), hostile_values(dtype)[:5]]
        if step == 9:
            xs.append(hostile_values(dtype))  # finally a non-finite value
        frames.append([x.to(device) for x in xs])
    rings = {}
    for name, ops in (("native", native), ("torch", fallback)):
        ring, state = numguard.ops.new_ring(5, device)
        position = 0
        for xs in frames:
            _record(ops, ring, state, xs, position, headroom=0.5)
            position += len(xs)
        rings[name] = (ring, state)
    assert torch.equal(rings["native"][0], rings["torch"][0])
    assert torch.equal(rings["native"][1], rings["torch"][1])
    assert rings["native"][1][0].item() == 1


@requires_native
def test_fallback_parity_on_hostile_inputs():
    gen = torch.Generator().manual_seed(10)
    xs = []
    for dtype in ALL_DTYPES:
        xs += [hostile_values(dtype), planted(dtype, 9000, gen)]
        xs += list(layout_cases(dtype, gen).values())[:6]
    native = torch.ops.numguard.multi_tensor_stats.default(xs)
    fallback = _torch_ops.multi_tensor_stats(xs)
    assert torch.equal(native, fallback)


# ---------------------------------------------------------------------------------------------
# Bad input and host syncs

def test_bad_inputs_give_clear_errors():
    x = torch.randn(4)
    with pytest.raises(TypeError, match="complex"):
        numguard.tensor_stats(torch.randn(3, dtype=torch.complex64))
    with pytest.raises(TypeError, match=r"xs\[1\].*complex"):
        numguard.multi_tensor_stats([x, torch.randn(3, dtype=torch.complex128)])
    with pytest.raises(ValueError, match="layout"):
        numguard.tensor_stats(x.to_sparse())
    with pytest.raises(ValueError, match="meta"):
        numguard.tensor_stats(torch.empty(3, device="meta"))
    with pytest.raises(ValueError, match=r"xs\[1\].*meta"):
        numguard.multi_tensor_stats([x, torch.empty(3, device="meta")])
    with pytest.raises(TypeError, match="complex"):
        ring, state = numguard.ops.new_ring(2)
        numguard.record_(ring, state, [torch.randn(2, dtype=torch.complex64)], 0)
    with pytest.raises(TypeError, match="Tensor"):
        numguard.tensor_stats([1.0, 2.0])


@requires_native
def test_native_bad_inputs_give_clear_errors():
    with pytest.raises(TypeError, match=r"complex dtype.*view_as_real"):
        torch.ops.numguard.tensor_stats.default(torch.randn(3, dtype=torch.complex64))
    with pytest.raises(TypeError, match=r"xs\[1\] has complex"):
        torch.ops.numguard.multi_tensor_stats.default([torch.randn(2), torch.randn(3, dtype=torch.complex64)])
    with pytest.raises(TypeError, match="does not support"):
        torch.ops.numguard.tensor_stats.default(torch.zeros(3, dtype=torch.float8_e4m3fnuz))
    ring, state = numguard.ops.new_ring(2)
    with pytest.raises(RuntimeError, match=r"ring must be float64\[R, 8\]"):
        torch.ops.numguard.record_.default(ring[:, :4], state, [torch.randn(3)], 0, 0.0)
    with pytest.raises(RuntimeError, match=r"state must be int64\[4\]"):
        torch.ops.numguard.record_.default(ring, state[:3], [torch.randn(3)], 0, 0.0)
    assert torch.ops.numguard.multi_tensor_stats.default([torch.randn(2)]).shape == (1, 8)
    assert numguard.multi_tensor_stats([]).shape == (0, 8)


@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
def test_mixed_devices_give_clear_errors():
    with pytest.raises(ValueError, match=r"xs\[1\] is on cuda"):
        numguard.multi_tensor_stats([torch.randn(2), torch.randn(2, device="cuda")])


@pytest.mark.parametrize("backend", BACKENDS)
def test_ops_never_read_values_back_to_the_host(backend):
    """Sync-freedom on the host side: no op reads a tensor value into Python (.item(), bool(),
    int()), which on CUDA would block; counted on the CPU with a dispatch mode."""
    ops = ops_for(backend)
    gen = torch.Generator().manual_seed(11)
    xs = [hostile_values(dtype) for dtype in ALL_DTYPES] + [planted(torch.float16, 5000, gen),
                                                           torch.empty(0), torch.tensor(2.0), odd_bools(300)]
    ring, state = numguard.ops.new_ring(4)
    with SyncCounter()() as mode:
        for x in xs:
            ops.tensor_stats(x)
        ops.multi_tensor_stats(xs)
        ops.record_(ring, state, xs[:3], 0, 0.9)
        ops.record_(ring, state, xs, 3, 0.9)
        ops.record_(ring, state, xs[:2], 30, 0.9)
    assert mode.total == 0, mode.where
    assert state[0].item() == 1


# ---------------------------------------------------------------------------------------------
# Hostile inputs: one rule for both backends and every entry point. Layouts, quantized and nested
# tensors, complex, meta and the float8/float4 formats the kernels do not decode get numguard's
# own error (the argument, what it is, what is accepted), the same on the native kernels, the
# pure-PyTorch fallback and the raw dispatcher op; bools holding bytes other than 0/1 are exact.

def odd_bools(n, offset=0):
    """n bools whose storage holds bytes 0, 1, 2, 0x80 and 0xFF (any non-zero byte is true)."""
    raw = torch.tensor([0, 1, 2, 0x80, 0xFF, 0, 7], dtype=torch.uint8).repeat(n // 7 + 2)
    return raw[offset:offset + n].view(torch.bool)


def _base(device):
    return torch.tensor([[1.5, -INF, 0.0], [float("nan"), 3.0, -2.0]], device=device)


def _fp8_bytes(dtype):
    return lambda device: torch.tensor([0, 1, 0x80, 0x7F, 0xFF, 0x3C], dtype=torch.uint8, device=device).view(dtype)


# name -> (factory(device), exception type, the words that say what it is, CPU only)
HOSTILE = {
    "sparse_coo": (lambda d: _base(d).to_sparse(), ValueError, "layout torch.sparse_coo", False),
    "sparse_csr": (lambda d: _base(d).to_sparse_csr(), ValueError, "layout torch.sparse_csr", False),
    "sparse_csc": (lambda d: _base(d).to_sparse_csc(), ValueError, "layout torch.sparse_csc", False),
    "sparse_bsr": (lambda d: _base(d).to_sparse_bsr((1, 1)), ValueError, "layout torch.sparse_bsr", False),
    "mkldnn": (lambda d: _base(d).to_mkldnn(), ValueError, "layout torch._mkldnn", True),
    "quantized": (lambda d: torch.quantize_per_tensor(_base(d).nan_to_num(0, 0, 0), 0.1, 0, torch.qint8),
                  TypeError, "quantized tensor (torch.qint8)", True),
    "nested": (lambda d: torch.nested.nested_tensor([torch.ones(2, device=d), torch.ones(3, device=d)]),
               ValueError, "nested tensor (layout torch.strided)", False),
    "nested_jagged": (lambda d: torch.nested.nested_tensor([torch.ones(2, device=d), torch.ones(3, device=d)],
                                                           layout=torch.jagged),
                      ValueError, "nested tensor (layout torch.jagged)", False),
    "complex64": (lambda d: torch.tensor([1 + 2j], device=d), TypeError, "complex dtype torch.complex64", False),
    "complex32": (lambda d: torch.tensor([1 + 2j], device=d).to(torch.complex32), TypeError,
                  "complex dtype torch.complex32", False),
    "meta": (lambda d: torch.empty(3, device="meta"), ValueError, "meta tensor", False),
    **{name: (_fp8_bytes(getattr(torch, name)), TypeError, f"dtype torch.{name}, which numguard does not support",
              False)
       for name in ("float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2")
       if hasattr(torch, name)},
}
# What each error says is accepted instead.
ACCEPTED = {ValueError: ("only dense (strided) tensors are supported", "pass a tensor on a real device"),
            TypeError: ("supported dtypes: " + ", ".join(numguard.schema.RECORDABLE_DTYPES),
                        "only unquantized tensors are supported", "stats are defined for real tensors")}
ENTRY_POINTS = ("tensor_stats", "multi_tensor_stats", "record_")


def _call_entry(entry, x, via):
    """Call `entry` with x (as xs[1] behind a healthy tensor for the list ops) through numguard's
    wrappers (via="wrapper") or the raw dispatcher op (via="dispatcher")."""
    ok = torch.ones(2, device=x.device if x.device.type != "meta" else "cpu")
    ring, state = numguard.ops.new_ring(2, ok.device)
    if via == "dispatcher":
        ops = torch.ops.numguard
        calls = {"tensor_stats": lambda: ops.tensor_stats.default(x),
                 "multi_tensor_stats": lambda: ops.multi_tensor_stats.default([ok, x]),
                 "record_": lambda: ops.record_.default(ring, state, [ok, x], 0, 0.0)}
    else:
        calls = {"tensor_stats": lambda: numguard.tensor_stats(x),
                 "multi_tensor_stats": lambda: numguard.multi_tensor_stats([ok, x]),
                 "record_": lambda: numguard.record_(ring, state, [ok, x], 0)}
    return calls[entry]()


def _hostile(case, device):
    make, kind, what, cpu_only = HOSTILE[case]
    if cpu_only and device != "cpu":
        pytest.skip(f"{case} tensors exist only on the CPU")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # prototype/beta warnings of sparse, nested and quantized tensors
        return make(device), kind, what


def _hostile_error(case, entry, device, via="wrapper"):
    x, kind, what = _hostile(case, device)
    with pytest.raises(Exception) as caught:
        _call_entry(entry, x, via)
    return caught.value, kind, what


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_inputs_get_numguard_errors(backend, case, entry, device):
    err, kind, what = _hostile_error(case, entry, device)
    name = "x" if entry == "tensor_stats" else "xs[1]"
    message = str(err)
    assert type(err) is kind, f"{type(err).__name__}: {message}"
    assert message.startswith(f"numguard: {name} "), message
    assert what in message and any(hint in message for hint in ACCEPTED[kind]), message
    assert "Could not run" not in message


@requires_native
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("case", sorted(set(HOSTILE) - {"meta"}))  # a meta tensor goes to the fake kernel
def test_hostile_errors_are_the_same_on_every_path(case, entry, device, monkeypatch):
    """The dispatcher op, the wrappers on the native kernels and on the fallback: one message."""
    ops_for("native", device)
    errors = [_hostile_error(case, entry, device, via="dispatcher")[0], _hostile_error(case, entry, device)[0]]
    monkeypatch.setattr(numguard.ops, "_native", None)
    errors.append(_hostile_error(case, entry, device)[0])
    assert len({(type(e), str(e)) for e in errors}) == 1, [f"{type(e).__name__}: {e}" for e in errors]


@requires_native
@pytest.mark.parametrize("case", ["nested", "nested_jagged"])
def test_nested_rejected_under_inference_mode(case):
    """Without autograd keys a nested tensor reaches other dispatch keys (NestedTensorCPU, or the
    jagged subclass's own dispatch): still numguard's error."""
    with torch.inference_mode():
        for entry in ENTRY_POINTS:
            err, kind, what = _hostile_error(case, entry, "cpu")
            assert type(err) is kind and what in str(err), f"{type(err).__name__}: {err}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_bools_count_any_nonzero_byte_as_true(backend, device):
    ops = ops_for(backend, device)
    n = 3 * K["kChunkBytes"] + 5  # several chunks, so threads and sub-blocks split it
    big = odd_bools(n, offset=3)
    cases = {"short": odd_bools(7), "one_byte_2": torch.tensor([2], dtype=torch.uint8).view(torch.bool),
             "all_true_bytes": torch.tensor([2, 0x80, 0xFF], dtype=torch.uint8).view(torch.bool),
             "all_zero": torch.zeros(9, dtype=torch.uint8).view(torch.bool), "big": big,
             "strided": big[::3], "transposed": big[: 700 * 300].reshape(700, 300).t(),
             "expanded": odd_bools(7)[2:3].expand(40, 5)}
    xs = [x.to(device) for x in cases.values()]
    for name, x in zip(cases, xs):
        with no_host_sync(device):
            got = ops.tensor_stats(x)
        assert_records_equal(got, reference_stats(x), f"bools {name}")
        assert got[ABS_MAX].item() <= 1.0
    with no_host_sync(device):
        got = ops.multi_tensor_stats(xs)
    assert_records_equal(got, torch.stack([reference_stats(x) for x in xs]), "bools multi")
    ring, state = numguard.ops.new_ring(len(xs), device)
    _record(ops, ring, state, xs, 0, headroom=0.5)
    assert_records_equal(ring, torch.stack([reference_stats(x) for x in xs]), "bools record_")
    assert state.tolist() == list(numguard.schema.STATE_INITIAL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_lazy_negative_views_are_exact(backend):
    """Views whose values are negated lazily (neg bit; the imaginary part of a conjugate): the
    signs, and so +Inf/-Inf, must come out as the values are, not as stored."""
    ops = ops_for(backend)
    z = torch.tensor([complex(1, INF), complex(2, -3), complex(0, float("nan")), complex(1, -0.0)])
    xs = [torch._neg_view(torch.tensor([INF, -1.0, 2.0, -INF, 0.0])), z.conj().imag]
    assert all(x.is_neg() for x in xs)
    for x in xs:
        assert_records_equal(ops.tensor_stats(x), reference_stats(x.resolve_neg()), "neg view")
    assert_records_equal(ops.multi_tensor_stats(xs), torch.stack([reference_stats(x.resolve_neg()) for x in xs]),
                         "neg views multi")
