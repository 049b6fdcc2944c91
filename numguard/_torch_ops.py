"""Pure-PyTorch implementation of numguard's ops: the fallback when the native extension cannot
load. It gives the same records as the native kernels and, like them, never synchronizes with the
host (every branch is on shapes and dtypes, never on values). It is slower and allocates
temporaries."""
from __future__ import annotations

from typing import Sequence

import torch

from . import schema

# Record and state layout (numguard.schema); the names stay importable from here.
from .schema import (ABS_MAX, ABS_MIN, FIRST_HEADROOM_POSITION, FIRST_TRIP_POSITION, HEADROOM_HIT,  # noqa: F401
                     MIN_NONZERO, NAN, NEG_INF, NUM_STATS, POS_INF, STATE_SIZE, SUBNORMAL, TRIPPED, ZERO)
from .schema import CURSOR_BATCH, CURSOR_CALLS, CURSOR_POSITION, GRAPH_LOG_WIDTH


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
    if x.dtype == torch.bool:
        # A bool is 0 or 1 whatever byte its storage holds (a uint8 viewed as bool may hold 2).
        x = x.view(torch.uint8) != 0
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
        tiny = torch.finfo(x.dtype).tiny  # equal to numguard.schema.DTYPES[...].tiny (tested)
        subnormal = (finite & (mag > 0) & (mag < tiny)).sum()
    else:
        subnormal = torch.zeros((), dtype=torch.int64, device=x.device)
    counts = torch.stack([nan, pos_inf, neg_inf, zero, subnormal]).to(torch.float64)
    return torch.cat([torch.stack([abs_min, abs_max, min_nonzero]), counts])


def multi_tensor_stats(xs: Sequence[torch.Tensor]) -> torch.Tensor:
    if not xs:
        return torch.empty((0, NUM_STATS), dtype=torch.float64)
    return torch.stack([tensor_stats(x) for x in xs])


def record_(ring: torch.Tensor, state: torch.Tensor, xs: Sequence[torch.Tensor], position: int,
            headroom: float, limits: Sequence[float] | None = None, context: int = 0) -> None:
    """limits: per tensor, the largest finite value of its dtype when its headroom is checked, else
    0 (numguard.ops.headroom_limits); needed only when headroom > 0. context: as numguard.ops.record_."""
    if not xs:
        return
    records = multi_tensor_stats(xs).to(ring.device)
    n = records.shape[0]
    # Built on the device from host ints: a torch.tensor(list) on CUDA would block on its copy.
    positions = torch.arange(position, position + n, device=ring.device, dtype=torch.int64)
    _record_rows(ring, state, records, positions, headroom, limits, context)


def _record_rows(ring, state, records, positions, headroom, limits, context=0):
    """record_'s step once the records and their positions (a device tensor) are known; returns
    whether the ring was frozen before (a 0-dim bool tensor)."""
    n = records.shape[0]
    end = positions[-1] + 1 if n else positions.new_zeros(())
    rows = positions % ring.shape[0]
    frozen = state[TRIPPED] != 0
    # Freeze on trip: a frame recorded after the trip leaves the ring as it was.
    ring.index_copy_(0, rows, torch.where(frozen, ring.index_select(0, rows), records))
    nonfinite = (records[:, NAN] + records[:, POS_INF] + records[:, NEG_INF]) > 0
    first_trip = torch.where(nonfinite, positions, end).amin() if n else end
    trips_now = nonfinite.any() & ~frozen
    if context > 0:  # NOTE: [context records]: inputs trip only with a later record
        trips_now = trips_now & nonfinite[context:].any()
    state[FIRST_TRIP_POSITION] = torch.where(trips_now, first_trip, state[FIRST_TRIP_POSITION])
    state[TRIPPED] = torch.where(trips_now, 1, state[TRIPPED])
    if headroom > 0 and n:
        limits = torch.cat([torch.full((1,), limit, dtype=torch.float64, device=ring.device)
                            for limit in limits])
        over = (limits > 0) & (records[:, ABS_MAX] > headroom * limits)
        first_over = torch.where(over, positions, end).amin()
        hits_now = over.any() & ~frozen & (state[HEADROOM_HIT] == 0)
        state[FIRST_HEADROOM_POSITION] = torch.where(hits_now, first_over, state[FIRST_HEADROOM_POSITION])
        state[HEADROOM_HIT] = torch.where(hits_now, 1, state[HEADROOM_HIT])
    return frozen


def record_at_cursor_(ring: torch.Tensor, state: torch.Tensor, cursor: torch.Tensor, log: torch.Tensor,
                      xs: Sequence[torch.Tensor], slot: int, headroom: float,
                      limits: Sequence[float] | None = None, context: int = 0) -> None:
    """numguard.ops.record_at_cursor_: record_ at cursor[0], then (unless frozen) log the call at
    row cursor[1] % len(log) and advance the cursor; all on the device."""
    if xs:
        records = multi_tensor_stats(xs).to(ring.device)
    else:
        records = torch.empty((0, NUM_STATS), dtype=torch.float64, device=ring.device)
    n = records.shape[0]
    start = cursor[CURSOR_POSITION]
    positions = start + torch.arange(n, device=ring.device, dtype=torch.int64)
    frozen = _record_rows(ring, state, records, positions, headroom, limits, context)
    row = (cursor[CURSOR_CALLS] % log.shape[0]).view(1)
    entry = torch.stack([torch.full((), slot, dtype=torch.int64, device=log.device), start,
                         cursor[CURSOR_BATCH]]).view(1, GRAPH_LOG_WIDTH)
    log.index_copy_(0, row, torch.where(frozen, log.index_select(0, row), entry))
    advance = torch.stack([torch.full((), n, dtype=torch.int64, device=cursor.device),
                           torch.ones((), dtype=torch.int64, device=cursor.device),
                           torch.zeros((), dtype=torch.int64, device=cursor.device)])
    cursor.add_(torch.where(frozen, torch.zeros_like(advance), advance))


# ---------------------------------------------------------------------------------------------
# Replica fingerprints (NOTE: [fingerprint] in csrc/include/numguard/fingerprint.h), in int64
# arithmetic, which wraps mod 2^64 like the kernels' uint64; right shifts are made logical by
# masking the sign extension away.

def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


_FP_STEP = _signed(schema.FINGERPRINT_INDEX_STEP)
_FP_MUL1, _FP_MUL2 = (_signed(m) for m in schema.FINGERPRINT_MIX_MULTIPLIERS)
_UNSIGNED_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _shift_right(z: torch.Tensor, k: int) -> torch.Tensor:
    return (z >> k) & ((1 << (64 - k)) - 1)


def _mix64(z: torch.Tensor) -> torch.Tensor:
    z = (z ^ _shift_right(z, 30)) * _FP_MUL1
    z = (z ^ _shift_right(z, 27)) * _FP_MUL2
    return z ^ _shift_right(z, 31)


def _storage_bits(x: torch.Tensor) -> torch.Tensor:
    """Each element's storage bits zero-extended to int64, in row-major order (bools as 0/1)."""
    x = x.reshape(-1)
    if x.dtype == torch.bool:
        return (x.view(torch.uint8) != 0).to(torch.int64)
    size = x.element_size()
    bits = x.contiguous().view(_UNSIGNED_VIEW[size]).to(torch.int64)
    return bits if size in (1, 8) else bits & ((1 << (8 * size)) - 1)


def tensor_fingerprint(x: torch.Tensor) -> torch.Tensor:
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=x.device)
    index = torch.arange(x.numel(), dtype=torch.int64, device=x.device)
    return _mix64(_storage_bits(x) ^ (index * _FP_STEP)).sum()


def multi_tensor_fingerprint(xs: Sequence[torch.Tensor]) -> torch.Tensor:
    if not xs:
        return torch.empty((0,), dtype=torch.int64)
    return torch.stack([tensor_fingerprint(x) for x in xs])
