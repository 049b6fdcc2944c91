"""Real float8 tensors: what fp8 training hands around, read through their data and scale.

A real float8 tensor is either a tensor of a float8 dtype (``torch.float8_e4m3fn``,
``torch.float8_e5m2``: ``torch._scaled_mm``'s inputs, a cast the model made) or a wrapper subclass
carrying float8 data and a scale among its inner tensors (``__tensor_flatten__``): torchao's
float8 training tensor keeps ``_data`` (float8) and ``_scale`` (float32, one per tensor or one
per row), and stands for ``_data / _scale`` in its original dtype.

- :func:`float8_parts` finds the data, the scale and the format;
- :func:`float8_values` is what the NaN/Inf watch records of a wrapper: ``data / scale`` in
  float32 (the values the model computes with), with a NaN for every element when the scale is
  not finite (``x / inf`` would be a quiet 0);
- :func:`real_quant_stats` is the record ``numguard.QUANT_FIELDS`` of the cast that was really
  made, read from the data's bits (NOTE: [real float8 casts]).

Device ops only: no host sync.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .schema import (NUM_QUANT_FIELDS, Q_AMAX, Q_BLOCKS, Q_NONFINITE, Q_NONZERO, Q_SATURATED, Q_SATURATED_BLOCKS,
                     Q_SCALE_EXP_MAX, Q_SCALE_EXP_MIN, Q_SQ_ERROR, Q_UNDERFLOW)

__all__ = ["FLOAT8_FORMATS", "Float8Parts", "float8_parts", "float8_values", "real_quant_stats"]

#: float8 dtype -> (format name, the magnitude bits of its largest finite value).
FLOAT8_FORMATS = {torch.float8_e4m3fn: ("float8_e4m3fn", 0x7E), torch.float8_e5m2: ("float8_e5m2", 0x7B)}
_SCALE_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


class Float8Parts(NamedTuple):
    """A real float8 tensor's parts: the values it stands for are ``data / scale``."""
    data: torch.Tensor           # a plain tensor of a float8 dtype
    scale: torch.Tensor | None   # a plain floating tensor that broadcasts to data; None: 1
    format: str                  # "float8_e4m3fn" or "float8_e5m2"


def _local(t):
    """A DTensor's local shard (FSDP2 / tensor parallelism: what this rank holds)."""
    return t.to_local() if hasattr(t, "to_local") and not isinstance(t, torch.nn.Parameter) else t


def float8_parts(tensor) -> Float8Parts | None:
    """The parts of a real float8 tensor (module docstring), or None for any other tensor. A
    wrapper qualifies when its inner tensors hold exactly one float8 tensor and one floating
    scale that broadcasts to it; a block scale (MX's e8m0 scales) does not, and such a wrapper is
    read as any other (numguard.inspector.frames.plain_values)."""
    if not isinstance(tensor, torch.Tensor):
        return None
    if tensor.dtype in FLOAT8_FORMATS and type(tensor) in (torch.Tensor, torch.nn.Parameter):
        return Float8Parts(tensor, None, FLOAT8_FORMATS[tensor.dtype][0])
    flatten = getattr(type(tensor), "__tensor_flatten__", None)
    if flatten is None:
        return None
    try:
        names, _ = flatten(tensor)
        inner = [_local(getattr(tensor, name)) for name in names]
    except Exception:  # noqa: BLE001 - the subclass's own failure: not read as float8
        return None
    data = [t for t in inner if isinstance(t, torch.Tensor) and t.dtype in FLOAT8_FORMATS]
    scales = [t for t in inner if isinstance(t, torch.Tensor) and t.dtype in _SCALE_DTYPES]
    if len(data) != 1 or len(scales) != 1 or type(data[0]) is not torch.Tensor \
            or type(scales[0]) is not torch.Tensor:
        return None
    data, scale = data[0], scales[0]
    try:
        torch.broadcast_shapes(scale.shape, data.shape)
    except RuntimeError:
        return None
    if scale.device != data.device:
        return None
    return Float8Parts(data, scale, FLOAT8_FORMATS[data.dtype][0])


def float8_values(parts: Float8Parts) -> torch.Tensor:
    """What the NaN/Inf watch records of a real float8 tensor: the data itself when there is no
    scale; else ``data / scale`` in float32 (the scale broadcast), NaN everywhere when the scale
    is not finite, ±Inf or NaN where it is 0 (one float32 temporary, no host sync)."""
    data = parts.data.detach()
    if parts.scale is None:
        return data
    scale = parts.scale.detach().to(torch.float32)
    return data.to(torch.float32) / scale + (scale - scale)  # inf - inf = NaN: a bad scale is seen


# NOTE: [real float8 casts]
# A float8 tensor alone cannot tell a zero it was given from one the cast made, nor a value that
# was exactly the format's max from one the cast clamped there. Its record counts them as
# torchao's and Transformer Engine's fp8_tensor_statistics do: "underflow" is the elements whose
# data is ±0 and "saturated" those at ±max, both upper bounds of what the cast did, as fractions
# of the finite elements ("nonzero" holds every finite element here). The squared error is not
# known (the source is gone): its field is NaN and quant_table() shows mse None. amax is of the
# values the tensor stands for (|data| / scale); the scale exponents are those of the scale.
def real_quant_stats(parts: Float8Parts) -> torch.Tensor:
    """float64[len(QUANT_FIELDS)] on the data's device: the real cast's record (NOTE: [real float8
    casts]). Device ops only."""
    data = parts.data.detach()
    device = data.device
    max_bits = FLOAT8_FORMATS[data.dtype][1]
    bits = data.view(torch.uint8).reshape(-1) & 0x7F   # the magnitude: sign bit dropped
    finite = bits <= max_bits
    n = float(data.numel())
    f64 = torch.float64
    nonfinite = (~finite).sum().to(f64)
    finite_count = n - nonfinite
    record = torch.zeros(NUM_QUANT_FIELDS, dtype=f64, device=device)
    magnitude = torch.where(finite.view(data.shape), data.to(torch.float32).abs(),
                            torch.zeros((), dtype=torch.float32, device=device))
    if parts.scale is None:
        amax = magnitude.amax() if data.numel() else torch.zeros((), dtype=torch.float32, device=device)
        exp = torch.zeros((), dtype=f64, device=device)
        exp_min = exp_max = exp
        bad_scale = torch.zeros((), dtype=torch.bool, device=device)
    else:
        scale = parts.scale.detach().to(torch.float32)
        values = magnitude / scale.abs()
        amax = values.amax() if values.numel() else torch.zeros((), dtype=torch.float32, device=device)
        exp = (torch.frexp(scale.abs().reshape(-1))[1] - 1).to(f64)
        exp_min, exp_max = exp.amin(), exp.amax()
        bad_scale = ~(torch.isfinite(scale) & (scale != 0)).all()
    # A scale that is not finite (or 0) makes every element non-finite.
    record[Q_NONFINITE] = torch.where(bad_scale, torch.full((), n, dtype=f64, device=device), nonfinite)
    record[Q_NONZERO] = torch.where(bad_scale, torch.zeros((), dtype=f64, device=device), finite_count)
    record[Q_UNDERFLOW] = torch.where(bad_scale, 0.0, (bits == 0).sum().to(f64))
    saturated = (bits == max_bits).sum().to(f64)
    record[Q_SATURATED] = torch.where(bad_scale, 0.0, saturated)
    record[Q_AMAX] = torch.where(bad_scale, 0.0, amax.to(f64))
    record[Q_SQ_ERROR] = float("nan")
    record[Q_BLOCKS] = 1.0 if data.numel() else 0.0
    record[Q_SATURATED_BLOCKS] = (record[Q_SATURATED] > 0).to(f64)
    record[Q_SCALE_EXP_MIN] = exp_min
    record[Q_SCALE_EXP_MAX] = exp_max
    return record

