"""What a low-precision format would do to a tensor: ``quant_stats(x, format, scale=None)``.

One float64 record (``numguard.QUANT_FIELDS``) on ``x.device``: how many elements would underflow to
zero, how many the cast would clamp at the format's max, the squared error of the round trip, and the
range of the block scales. Formats (``numguard.schema.QUANT_FORMATS``), rounding to nearest, ties to
even, every product and quotient in float32 (the input is taken as float32 first; its bf16, fp16 and
fp32 values are exact there, and a float64 value beyond float32's range is float32's max):

- ``float8_e4m3fn``, ``float8_e5m2``: ``q = cast(clamp(x * scale, +-max))``, dequantized ``q / scale``
  (``scale`` defaults to 1.0; Transformer Engine's convention). One block; the scale's exponent is
  both ends of the scale range.
- ``mxfp8_e4m3``, ``mxfp8_e5m2`` (OCP Microscaling v1.0): blocks of 32 consecutive elements in
  row-major order (the last block padded with zeros); shared exponent ``floor(log2(block amax)) -
  emax`` (8 for e4m3, 15 for e5m2) clamped to E8M0's [-127, 127] (-127 for an all-zero block);
  elements ``x / 2^shared`` cast with saturation, dequantized ``q * 2^shared``.
- ``nvfp4``: blocks of 16; global scale ``g = 448 * 6 / amax(x)`` (or ``scale``; 1 when amax is 0);
  block scale ``s = e4m3(block amax * g / 6)`` saturating at 448; elements ``e2m1(x * g / s)``
  saturating at 6 (a block whose ``s`` rounds to 0 underflows whole); dequantized ``q * s / g``.

Non-finite elements are counted in ``nonfinite`` and left out of everything else (a block's amax
included). No host sync: every step is a device op, and ``scale`` may be a 0-dim tensor on the
device. The native kernels do it on the CPU (csrc/cpu/quant_ops.cpp) and on CUDA
(csrc/cuda/quant_kernels.cu); torch operations do it elsewhere, for float64 inputs and for a scale
given as a CUDA tensor (any device, ``torch.compile``; several passes over the tensor).
"""
from __future__ import annotations

from typing import Sequence

import torch

from . import ops as _ops
from . import schema
from .schema import QUANT_FIELDS, QUANT_FORMATS

__all__ = ["QUANT_FIELDS", "QUANT_FORMATS", "multi_tensor_quant_stats", "quant_stats"]

_FLOATING = (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)


def _check(x, format, scale):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"numguard.quant_stats: x must be a tensor, got {type(x).__name__}")
    spec = QUANT_FORMATS.get(format) if isinstance(format, str) else None
    if spec is None:
        raise ValueError(f"numguard.quant_stats: unknown format {format!r}; use one of "
                         f"{', '.join(repr(n) for n in QUANT_FORMATS)}")
    if x.dtype not in _FLOATING:
        raise TypeError(f"numguard.quant_stats: x is {x.dtype}; only floating tensors have a low-precision "
                        f"what-if (cast integers to a float dtype first)")
    if scale is not None and spec.scale == "e8m0":
        raise ValueError(f"numguard.quant_stats: format {format!r} scales each block by its own power of two; "
                         "it takes no scale (pass scale=None)")
    if scale is not None:
        if isinstance(scale, torch.Tensor):
            if scale.numel() != 1 or not scale.dtype.is_floating_point:
                raise ValueError(f"numguard.quant_stats: scale must be one floating value, got a {scale.dtype} "
                                 f"tensor of shape {tuple(scale.shape)}")
        elif isinstance(scale, bool) or not isinstance(scale, (int, float)) or not float(scale) > 0 \
                or scale == float("inf"):
            raise ValueError(f"numguard.quant_stats: scale must be a positive finite number, got {scale!r}")
    return spec


_F32_MAX = torch.finfo(torch.float32).max


def _as_float32(x):
    flat = x.detach().reshape(-1)
    if hasattr(flat, "to_local"):  # a DTensor: this rank's shard
        flat = flat.to_local().reshape(-1)
    if flat.dtype == torch.float64:  # finite values beyond float32's range are its max: they saturate
        flat = flat.clamp(-_F32_MAX, _F32_MAX)
    return flat.to(torch.float32)


def _scale_tensor(scale, device, default=None):
    if scale is None:
        return default
    if isinstance(scale, torch.Tensor):
        return scale.detach().reshape(()).to(device=device, dtype=torch.float32)
    return torch.full((), float(scale), dtype=torch.float32, device=device)


def _cast(v, element, element_max):
    """v (float32) clamped to +-element_max and rounded to the element format (as float32)."""
    v = v.clamp(-element_max, element_max)
    if element == "float4_e2m1":
        return _round_e2m1(v)
    return v.to(getattr(torch, element)).to(torch.float32)


def _round_e2m1(v):
    """NOTE: [quant rounding] (csrc/include/numguard/stats_reduce.h) for e2m1: the grid step at
    |v| is 2^(max(floor(log2 |v|), 0) - 1), and torch.round rounds halves to even. Device ops only
    (no constant copied from the host: that copy would wait for the device)."""
    a = v.abs()
    e = (torch.frexp(a)[1] - 1).clamp(min=0)  # frexp(0) gives 0: e = 0, and 0 rounds to 0
    step = torch.ldexp(torch.ones_like(a), (e - 1).to(a.dtype))
    return torch.copysign(torch.round(a / step) * step, v)


def _exponent(v):
    """floor(log2(v)) for v > 0 (exact: frexp's exponent), as float64."""
    return (torch.frexp(v)[1] - 1).to(torch.float64)


def _blocks(v, size):
    pad = (-v.numel()) % size
    if pad:
        v = torch.cat([v, v.new_zeros(pad)])
    return v.view(-1, size)


FORMAT_CODES = {name: code for code, name in enumerate(QUANT_FORMATS)}  # csrc QuantFormatCode, same order
NATIVE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)


def native_serves(name, device):
    """Whether the native op ``numguard::name`` has a kernel for `device` (the CPU, or CUDA when
    the extension was built with its CUDA kernels)."""
    if _ops.native_module() is None or not hasattr(torch.ops.numguard, name):
        return False
    if device.type == "cpu":
        return True
    return device.type == "cuda" and torch._C._dispatch_has_kernel_for_dispatch_key(f"numguard::{name}", "CUDA")


if _ops.native_module() is not None and hasattr(torch.ops.numguard, "quant_stats"):
    @torch.library.register_fake("numguard::quant_stats")
    def _quant_stats_fake(x, format, scale, has_scale):
        return x.new_empty((len(QUANT_FIELDS),), dtype=torch.float64)

if _ops.native_module() is not None and hasattr(torch.ops.numguard, "quant_watch_"):
    @torch.library.register_fake("numguard::quant_watch_")
    def _quant_watch_fake(sums, row, xs, format):
        return sums.new_empty((len(xs), len(QUANT_FIELDS)))


def quant_stats(x: torch.Tensor, format: str, scale=None) -> torch.Tensor:
    """float64[len(QUANT_FIELDS)] on x.device: what casting `x` to `format` would do (module
    docstring). Raises ValueError / TypeError naming a bad format, dtype or scale."""
    spec = _check(x, format, scale)
    if (x.dtype in NATIVE_DTYPES and type(x) is torch.Tensor and native_serves("quant_stats", x.device)
            and (scale is None or not isinstance(scale, torch.Tensor) or scale.device.type == "cpu")):
        # The native kernels: the same arithmetic (a scale on the host is read here, no sync).
        value = 1.0 if scale is None else float(scale)
        return torch.ops.numguard.quant_stats.default(x, FORMAT_CODES[format], value, scale is not None)
    return _torch_quant_stats(x, spec, scale)


def _torch_quant_stats(x, spec, scale):
    """quant_stats from torch operations (any device; several passes)."""
    device = x.device
    exact = x.detach().reshape(-1).to(torch.float64)
    finite = torch.isfinite(exact)
    flat = _as_float32(x)
    xf = torch.where(finite, flat, torch.zeros((), dtype=torch.float32, device=device))
    exact = torch.where(finite, exact, torch.zeros((), dtype=torch.float64, device=device))
    nonzero = xf != 0
    amax = xf.abs().amax() if xf.numel() else torch.zeros((), dtype=torch.float32, device=device)
    inf = torch.full((), float("inf"), dtype=torch.float64, device=device)
    emax_e = spec.element_max
    if spec.scale == "tensor":
        s = _scale_tensor(scale, device, torch.ones((), dtype=torch.float32, device=device))
        v = xf * s
        q = _cast(v, spec.element, emax_e)
        deq = q.to(torch.float64) / s.to(torch.float64)
        saturated = v.abs() > emax_e
        n_blocks = torch.full((), 1.0 if x.numel() else 0.0, dtype=torch.float64, device=device)
        sat_blocks = saturated.any().to(torch.float64) if x.numel() else n_blocks * 0
        exp = _exponent(s)
        exp_min = exp_max = exp if x.numel() else None
    elif spec.scale == "e8m0":
        blocks = _blocks(xf, spec.block)
        bamax = blocks.abs().amax(dim=1)
        lo, hi = schema.E8M0_EXP_RANGE
        shared = torch.where(bamax > 0, (torch.frexp(bamax)[1] - 1 - spec.element_emax).clamp(lo, hi),
                             torch.full_like(bamax, lo, dtype=torch.int32))
        v = torch.ldexp(blocks, (-shared).to(torch.float32).unsqueeze(1))
        q = _cast(v, spec.element, emax_e)
        deq = torch.ldexp(q.to(torch.float64), shared.to(torch.float64).unsqueeze(1)).reshape(-1)[:xf.numel()]
        saturated_b = v.abs() > emax_e
        saturated = saturated_b.reshape(-1)[:xf.numel()]
        q = q.reshape(-1)[:xf.numel()]
        n_blocks = torch.full((), float(blocks.shape[0]), dtype=torch.float64, device=device)
        sat_blocks = saturated_b.any(dim=1).sum().to(torch.float64)
        exp = shared.to(torch.float64)
        exp_min, exp_max = (exp.amin(), exp.amax()) if blocks.shape[0] else (None, None)
    else:  # nvfp4
        one = torch.ones((), dtype=torch.float32, device=device)
        g = _scale_tensor(scale, device)
        if g is None:
            # A tensor numerator: `number / tensor` is computed as number * (1 / tensor), two roundings.
            top = torch.full((), schema.NVFP4_BLOCK_SCALE_MAX * emax_e, dtype=torch.float32, device=device)
            g = torch.where(amax > 0, top / torch.where(amax > 0, amax, one), one)
        blocks = _blocks(xf, spec.block)
        bamax = blocks.abs().amax(dim=1)
        s = (bamax * g / emax_e).clamp(max=schema.NVFP4_BLOCK_SCALE_MAX).to(torch.float8_e4m3fn).to(torch.float32)
        live = s > 0
        v = torch.where(live.unsqueeze(1), blocks * g / torch.where(live, s, one).unsqueeze(1),
                        torch.zeros((), dtype=torch.float32, device=device))
        q = _cast(v, spec.element, emax_e)
        deq = (q.to(torch.float64) * s.to(torch.float64).unsqueeze(1) / g.to(torch.float64)).reshape(-1)[:xf.numel()]
        saturated_b = v.abs() > emax_e
        saturated = saturated_b.reshape(-1)[:xf.numel()]
        q = q.reshape(-1)[:xf.numel()]
        n_blocks = torch.full((), float(blocks.shape[0]), dtype=torch.float64, device=device)
        sat_blocks = saturated_b.any(dim=1).sum().to(torch.float64)
        exp = torch.where(live, _exponent(torch.where(live, s, one)), inf)
        exp_min = exp.amin() if blocks.shape[0] else None
        exp_max = torch.where(live, exp, -inf).amax() if blocks.shape[0] else None
    underflow = nonzero & (q == 0)
    err = (deq - exact).square()
    fields = [
        (~finite).sum().to(torch.float64),
        nonzero.sum().to(torch.float64),
        underflow.sum().to(torch.float64),
        (saturated & finite).sum().to(torch.float64),
        exact.abs().amax() if exact.numel() else torch.zeros((), dtype=torch.float64, device=device),
        torch.where(finite, err, torch.zeros((), dtype=torch.float64, device=device)).sum(),
        n_blocks,
        sat_blocks,
        inf if exp_min is None else exp_min.to(torch.float64),
        -inf if exp_max is None else exp_max.to(torch.float64),
    ]
    return torch.stack([f.reshape(()) for f in fields])


def multi_tensor_quant_stats(xs: Sequence[torch.Tensor], format: str, scales=None) -> torch.Tensor:
    """float64[len(xs), len(QUANT_FIELDS)]: quant_stats of each tensor (on the first one's device);
    `scales`: one per tensor, or None."""
    xs = list(xs)
    if scales is not None and len(scales) != len(xs):
        raise ValueError(f"numguard.multi_tensor_quant_stats: {len(scales)} scales for {len(xs)} tensors")
    if not xs:
        return torch.empty((0, len(QUANT_FIELDS)), dtype=torch.float64)
    device = xs[0].device
    rows = [quant_stats(x, format, None if scales is None else scales[i]).to(device) for i, x in enumerate(xs)]
    return torch.stack(rows)
