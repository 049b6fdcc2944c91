"""numguard's tensor ops: typed wrappers over torch.ops.numguard, fake implementations for
torch.compile, and the choice of backend.

The native extension (`numguard._C`) registers the ops with the PyTorch dispatcher. When it cannot
be loaded (not built, ABI mismatch, or NUMGUARD_BACKEND=torch), the same functions run on a
pure-PyTorch implementation that gives identical records and stays sync-free; a warning says so once.
"""
from __future__ import annotations

import os
import warnings
from typing import Sequence

import torch

from . import _torch_ops
from ._torch_ops import NUM_STATS, STATE_SIZE, check_same_device, check_tensor

STAT_FIELDS = ("abs_min", "abs_max", "min_nonzero", "nan", "pos_inf", "neg_inf", "zero", "subnormal")
assert len(STAT_FIELDS) == NUM_STATS

_BACKEND_CHOICES = ("auto", "native", "torch")


def _load_native():
    """Import the extension; return (module, None) or (None, reason)."""
    choice = os.environ.get("NUMGUARD_BACKEND", "auto").strip().lower() or "auto"
    if choice not in _BACKEND_CHOICES:
        raise ValueError(f"NUMGUARD_BACKEND={choice!r} is not valid: use one of {', '.join(_BACKEND_CHOICES)}")
    if choice == "torch":
        return None, "NUMGUARD_BACKEND=torch"
    try:
        from . import _C  # noqa: F401  (importing runs the op registrations)
    except Exception as exc:  # any failure to load leaves numguard usable on the fallback
        if choice == "native":
            raise ImportError(f"NUMGUARD_BACKEND=native but numguard's extension failed to load: {exc}") from exc
        return None, f"{type(exc).__name__}: {exc}"
    return _C, None


_native, _fallback_reason = _load_native()
if _native is None and _fallback_reason != "NUMGUARD_BACKEND=torch":
    warnings.warn(f"numguard: native kernels unavailable ({_fallback_reason}); using the pure-PyTorch "
                  "implementation (same results, slower). Rebuild with "
                  "`pip install --no-build-isolation -e .` to get the kernels.", RuntimeWarning, stacklevel=2)


def backend() -> str:
    """'native' when the compiled kernels serve the ops, 'torch' on the pure-PyTorch fallback."""
    return "native" if _native is not None else "torch"


def fallback_reason() -> str | None:
    """Why the native kernels are not in use, or None when they are."""
    return _fallback_reason


def native_module():
    """The loaded extension module, or None."""
    return _native


if _native is not None:
    @torch.library.register_fake("numguard::tensor_stats")
    def _tensor_stats_fake(x):
        return x.new_empty((NUM_STATS,), dtype=torch.float64)

    @torch.library.register_fake("numguard::multi_tensor_stats")
    def _multi_tensor_stats_fake(xs):
        if not xs:
            return torch.empty((0, NUM_STATS), dtype=torch.float64)
        return xs[0].new_empty((len(xs), NUM_STATS), dtype=torch.float64)

    @torch.library.register_fake("numguard::record_")
    def _record_fake(ring, state, xs, position, headroom):
        return None


def _check_for_native(xs: list, what: str = "xs") -> None:
    """The native kernels check dtype, layout and devices themselves with the same messages; what
    they never see is a meta or non-tensor argument (meta goes to the fake kernel), so only those
    are screened here: a per-call cost of a few attribute reads, not a full Python validation."""
    for x in xs:
        if not isinstance(x, torch.Tensor) or x.is_meta:
            check_same_device(xs, what)


def tensor_stats(x: torch.Tensor) -> torch.Tensor:
    """float64[8] stats record of `x` on x.device (fields: STAT_FIELDS). No host sync."""
    check_tensor(x)
    if _native is None:
        return _torch_ops.tensor_stats(x)
    return torch.ops.numguard.tensor_stats.default(x)


def multi_tensor_stats(xs: Sequence[torch.Tensor]) -> torch.Tensor:
    """float64[len(xs), 8]: the record of each tensor, all on one device. No host sync."""
    xs = list(xs)
    if _native is None:
        check_same_device(xs)
        return _torch_ops.multi_tensor_stats(xs)
    _check_for_native(xs)
    if not xs:  # no tensor argument: the dispatcher could not pick a device
        return torch.empty((0, NUM_STATS), dtype=torch.float64)
    return torch.ops.numguard.multi_tensor_stats.default(xs)


def new_ring(num_records: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """A (ring, state) pair for record_: ring float64[num_records, 8], state int64[4] untripped."""
    if not isinstance(num_records, int) or num_records < 1:
        raise ValueError(f"numguard: a ring needs at least one record, got num_records={num_records!r}")
    ring = torch.zeros((num_records, NUM_STATS), dtype=torch.float64, device=device)
    state = torch.empty(STATE_SIZE, dtype=torch.int64, device=device)
    reset_state(state)
    return ring, state


def reset_state(state: torch.Tensor) -> None:
    """Untrip a recording state in place (device-side writes, no host sync)."""
    state[0::2].fill_(0)  # TRIPPED, HEADROOM_HIT
    state[1::2].fill_(-1)  # FIRST_TRIP_POSITION, FIRST_HEADROOM_POSITION


def record_(ring: torch.Tensor, state: torch.Tensor, xs: Sequence[torch.Tensor], position: int,
            headroom: float = 0.0) -> None:
    """Record xs into ring[(position + i) % len(ring)] unless the ring is frozen by an earlier trip;
    trip `state` on NaN/Inf (first offending position kept), flag headroom. No host sync."""
    xs = list(xs)
    if _native is None:
        check_same_device(xs)
        _torch_ops.record_(ring, state, xs, position, headroom)
        return
    _check_for_native(xs)
    torch.ops.numguard.record_.default(ring, state, xs, position, headroom)
