"""Pure-PyTorch implementation of numguard's ops: the fallback when the native extension cannot
load. It gives the same records as the native kernels and, like them, never synchronizes with the
host (every branch is on shapes and dtypes, never on values). It is slower and allocates
temporaries."""
from __future__ import annotations

from typing import Sequence

import torch

NUM_STATS = 8
STATE_SIZE = 4
# Positions in a record and in the recording state (mirror csrc/include/numguard/stats_reduce.h).
ABS_MIN, ABS_MAX, MIN_NONZERO, NAN, POS_INF, NEG_INF, ZERO, SUBNORMAL = range(NUM_STATS)
TRIPPED, FIRST_TRIP_POSITION, HEADROOM_HIT, FIRST_HEADROOM_POSITION = range(STATE_SIZE)

# Low-precision dtypes whose headroom (abs max against finfo.max) record_ checks.
HEADROOM_DTYPES = (torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)


def check_tensor(x, what: str = "x") -> None:
    """Reject inputs that have no meaningful stats, naming the value and what to do."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"numguard: {what} must be a torch.Tensor, got {type(x).__name__}")
    if x.is_complex():
        raise TypeError(f"numguard: {what} has complex dtype {x.dtype}; stats are defined for real "
                        "tensors: pass torch.view_as_real(x) to check its real and imaginary parts")
    if x.layout != torch.strided:
        raise ValueError(f"numguard: {what} has layout {x.layout}; only dense (strided) tensors are "
                         "supported: pass x.to_dense()")
    if x.device.type == "meta":
        raise ValueError(f"numguard: {what} is a meta tensor (shape {tuple(x.shape)}), which has no "
                         "values to check: pass a tensor on a real device")


def check_same_device(xs: Sequence[torch.Tensor], what: str = "xs") -> None:
    for i, x in enumerate(xs):
        check_tensor(x, f"{what}[{i}]")
    if xs:
        device = xs[0].device
        for i, x in enumerate(xs):
            if x.device != device:
                raise ValueError(f"numguard: {what}[{i}] is on {x.device} but {what}[0] is on {device}; "
                                 "all tensors of one call must be on one device: split the call per device")


def empty_record(device) -> torch.Tensor:
    inf = float("inf")
    # Filled on the device: torch.tensor(list, device=cuda) copies from pageable host memory and
    # synchronizes.
    record = torch.zeros(NUM_STATS, dtype=torch.float64, device=device)
    record[ABS_MIN] = inf
    record[MIN_NONZERO] = inf
    return record


def tensor_stats(x: torch.Tensor) -> torch.Tensor:
    if x.numel() == 0:
        return empty_record(x.device)
    values = x.detach().to(torch.float64)  # every supported dtype embeds exactly (ints: monotonically)
    mag = values.abs()
    finite = torch.isfinite(values)
    inf = torch.full((), float("inf"), dtype=torch.float64, device=x.device)  # no host-to-device copy
    finite_mag = torch.where(finite, mag, inf)
    abs_min = finite_mag.amin()
    abs_max = torch.where(finite, mag, torch.zeros_like(mag)).amax()
    nonzero_mag = torch.where(mag == 0, inf, finite_mag)
    min_nonzero = nonzero_mag.amin()
    nan = torch.isnan(values).sum()
    pos_inf = (values == float("inf")).sum()
    neg_inf = (values == float("-inf")).sum()
    zero = (values == 0).sum()
    if x.is_floating_point():
        tiny = torch.finfo(x.dtype).tiny
        subnormal = (finite & (mag > 0) & (mag < tiny)).sum()
    else:
        subnormal = torch.zeros((), dtype=torch.int64, device=x.device)
    counts = torch.stack([nan, pos_inf, neg_inf, zero, subnormal]).to(torch.float64)
    return torch.cat([torch.stack([abs_min, abs_max, min_nonzero]), counts])


def multi_tensor_stats(xs: Sequence[torch.Tensor]) -> torch.Tensor:
    if not xs:
        return torch.empty((0, NUM_STATS), dtype=torch.float64)
    return torch.stack([tensor_stats(x) for x in xs])


def headroom_limits(xs: Sequence[torch.Tensor]) -> list[float]:
    return [torch.finfo(x.dtype).max if x.dtype in HEADROOM_DTYPES else 0.0 for x in xs]


def record_(ring: torch.Tensor, state: torch.Tensor, xs: Sequence[torch.Tensor], position: int,
            headroom: float) -> None:
    if not xs:
        return
    records = multi_tensor_stats(xs).to(ring.device)
    n = records.shape[0]
    # Built on the device from host ints: a torch.tensor(list) on CUDA would block on its copy.
    positions = torch.arange(position, position + n, device=ring.device, dtype=torch.int64)
    rows = positions % ring.shape[0]
    frozen = state[TRIPPED] != 0
    # Freeze on trip: a frame recorded after the trip leaves the ring as it was.
    ring.index_copy_(0, rows, torch.where(frozen, ring.index_select(0, rows), records))
    nonfinite = (records[:, NAN] + records[:, POS_INF] + records[:, NEG_INF]) > 0
    first_trip = torch.where(nonfinite, positions, positions.new_full((), position + n)).amin()
    trips_now = nonfinite.any() & ~frozen
    state[FIRST_TRIP_POSITION] = torch.where(trips_now, first_trip, state[FIRST_TRIP_POSITION])
    state[TRIPPED] = torch.where(trips_now, 1, state[TRIPPED])
    if headroom > 0:
        limits = torch.cat([torch.full((1,), limit, dtype=torch.float64, device=ring.device)
                            for limit in headroom_limits(xs)])
        over = (limits > 0) & (records[:, ABS_MAX] > headroom * limits)
        first_over = torch.where(over, positions, positions.new_full((), position + n)).amin()
        hits_now = over.any() & ~frozen & (state[HEADROOM_HIT] == 0)
        state[FIRST_HEADROOM_POSITION] = torch.where(hits_now, first_over, state[FIRST_HEADROOM_POSITION])
        state[HEADROOM_HIT] = torch.where(hits_now, 1, state[HEADROOM_HIT])
