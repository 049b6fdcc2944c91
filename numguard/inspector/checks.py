"""Reading the trip flag: synchronously (one tiny device->host copy of the state), or
asynchronously (a copy to pinned memory, read at the next check), and sharing it across ranks.

A check returns a CheckStatus; what to do with it (report, warn about headroom, confirm the
frames) is the inspector's business."""
from __future__ import annotations

import struct
import sys
import time
import warnings
from typing import NamedTuple

import torch

from .. import process as _process
from .. import schema
from ..errors import InspectorWarning
from .frames import is_parameter_gradients
from .ring import host_to_device, outside_inference_mode


class CheckStatus(NamedTuple):
    """What one check read."""
    values: list          # the state words of this rank
    others: list          # every rank's trip flag (empty outside a cross-rank exchange)
    boundary: int         # frames recorded when the state was read
    found_at: int         # the batch being run when it was read

    @property
    def tripped(self) -> bool:
        return self.values[0] != 0

    @property
    def first_trip(self) -> int:
        return self.values[1]

    @property
    def any_trip(self) -> bool:
        return self.tripped or any(v != 0 for v in self.others)

    @property
    def headroom_hit(self) -> bool:
        return self.values[2] != 0 or self.values[4] != 0


#: The end of a check made when a submodule called outside the root's forward returned.
OUTSIDE_ROOT = "returned outside the root's forward"


def _own_wait() -> float:
    """Seconds waited in numguard's own collectives (0 before numguard.distributed is used)."""
    module = sys.modules.get("numguard.distributed.collectives")
    return module.waited_s() if module is not None else 0.0


def trip_exchange(warned: set):
    """numguard.distributed.trip_exchange, or None (with a warning naming it, once) when this
    installation cannot import it: the other ranks then learn nothing of this rank's trips."""
    try:
        from ..distributed import trip_exchange as module
    except ImportError as exc:
        if "trip exchange" not in warned:
            warned.add("trip exchange")
            warnings.warn(f"numguard: torch.distributed is initialized but numguard.distributed cannot "
                          f"be imported ({type(exc).__name__}: {exc}); trips are NOT shared across "
                          "ranks, so other ranks may train on or hang when this one stops. Reinstall "
                          "numguard (the wheel must contain numguard/distributed/).", InspectorWarning,
                          stacklevel=5)
        return None
    return module


class FlagReader:
    """Reads a FrameRing's state the way `mode` ("sync" or "async") says."""

    def __init__(self, ring, mode, warned):
        self.ring = ring
        self.mode = mode
        self.warned = warned
        self.where = "batch end"      # what the current check is for (shown in reports)
        self._host = None
        self._host_np = None
        self._event = None
        self.pending = None           # (frames held, batch) when the async copy was issued
        self.numbers = None           # this rank's cross-rank numbers read by the last shared check
        self.skipped_steps = None     # callable: GradScaler-skipped steps so far (set by the inspector)
        # quant= with amax_group: (the group's key, callable -> float64[1] on the device: the digest
        # of the amax of every watched tensor since the last check); numguard.distributed.amax
        self.amax = None
        self.request = None           # callable: this rank's rerun request word (watch(rerun=True))
        self._tail = 0                # words of numbers at the end of the pending async copy
        # Step time (NOTE: [step time]): (host time, own wait) at the last exchange or root forward
        # end, at this forward's start and at its first child's start; busy seconds and root
        # forwards since the last exchange; whether rank-local work (evaluation) ran since.
        self._mark = None
        self._forward_start = None
        self._inner_start = None
        self._busy = 0.0
        self._forwards = 0
        self._local_work = False
        self.local_batches = 0        # root forwards run under no_grad (rank-local, not exchanged)
        if mode == "async":
            self._make_host_buffer(8)

    def forget_pending(self):
        self.pending = None

    def frames_dropped(self, cut):
        if self.pending is not None:
            n, batch = self.pending
            self.pending = (max(0, n - cut), batch)

    def _source(self, batch):
        """The words to read: this rank's state, then every rank's trip flag when the check is
        shared across ranks."""
        # NOTE: [which checks are shared across ranks] Only checks of training batches (grad
        # enabled) and checks before an optimizer step join the cross-rank exchange: every rank
        # runs those, while evaluation under no_grad often runs on some ranks only (rank 0's
        # eval), where a collective would pair with an unrelated one on the other ranks.
        # Evaluation trips are reported by their own rank.
        # The end of a forward under no_grad, also of a submodule called outside the root's
        # forward (model.module(x) on rank 0 for evaluation), is rank-local.
        self.ring.merge_devices()  # NOTE: [one ring per device]
        state = self.ring.state_buf
        forward_end = self.where == "batch end" or self.where.endswith(OUTSIDE_ROOT)
        if _process.is_distributed() and (torch.is_grad_enabled() or not forward_end):
            module = trip_exchange(self.warned)
            if module is not None:
                # The batch number lets ranks that pair different batches (different check_every,
                # an extra batch on one rank) be told so, naming both; the rank-local batches
                # (evaluation) each rank ran are not counted in that comparison.
                flags = module.exchange_trip(state[0], batch_number=batch,
                                             numbers=self._numbers_to_send(),
                                             local_batches=self.local_batches,
                                             request=self.request() if self.request is not None else 0)
                self._mark = (time.perf_counter(), _own_wait())
                self._busy = 0.0
                self._forwards = 0
                self._local_work = False
                parts = [state, flags.to(state.device)]
                numbers = self._device_numbers()
                if numbers is not None:
                    parts.append(numbers.view(torch.int64))
                return torch.cat(parts), True, 0 if numbers is None else numbers.numel()
        if _process.is_distributed():
            self._local_work = True  # this interval's step time is not comparable across ranks
        return state, False, 0

    # -- cross-rank numbers (numguard.distributed.numerics; NOTE: [cross-rank numbers]) ----------
    # NOTE: [step time]
    # A rank's step time is the host time it spent on its own work since the last exchange:
    # before each root forward (optimizer step, data loading) and in the forward, leaving out
    # the time it waited for the other ranks, which is theirs:
    # - the backward is left out (DDP's gradient all_reduce makes fast ranks wait for slow ones);
    # - the forward is timed from its first child's start: a wrapper's collectives before it
    #   (DDP's buffer broadcast, BatchNorm running stats) are left out;
    # - numguard's own collectives (the replica check at the forward's start, shape checks) are
    #   left out (NOTE: [own wait time] in numguard.distributed.collectives);
    # - an interval in which this rank ran rank-local work (a forward under no_grad, a check
    #   only this rank made: rank 0's evaluation) gives no step time (NaN: not compared).
    # Collectives inside the model's layers (SyncBatchNorm, tensor parallelism, FSDP's
    # all-gathers) are not seen: a rank waiting in them shows that wait (README).
    def forward_started(self):
        """A root forward starts (the inspector's root pre-hook)."""
        self._forward_start = (time.perf_counter(), _own_wait())
        self._inner_start = None

    def inner_forward_started(self):
        """The root forward's first child starts (a wrapper's own work before it is not timed)."""
        if self._inner_start is None and self._forward_start is not None:
            self._inner_start = (time.perf_counter(), _own_wait())

    def forward_ended(self):
        """The root forward returned (the inspector calls this at every batch end)."""
        now = (time.perf_counter(), _own_wait())
        start, inner = self._forward_start, self._inner_start
        self._forward_start = self._inner_start = None
        if not torch.is_grad_enabled():
            self.local_batches += 1
            self._local_work = True
            return
        if self._mark is not None and start is not None:
            inner = inner or start
            before = (start[0] - self._mark[0]) - (start[1] - self._mark[1])
            during = (now[0] - inner[0]) - (now[1] - inner[1])
            self._busy += max(0.0, before) + max(0.0, during)
            self._forwards += 1
        self._mark = now

    def _numbers_to_send(self):
        """numerics.FIELDS: the device numbers the previous shared check read (NaN before the
        first), the skipped-step count, and the host step time (NOTE: [step time]; NaN until
        known)."""
        nan = float("nan")
        device = list(self.numbers) if self.numbers is not None else [nan] * 4
        numbers = device[:4]
        # numguard.distributed.amax.FIELDS: every rank sends them, NaN when it checks no amax
        amax = [self.amax[0], device[4]] if self.amax is not None and len(device) > 4 else [nan, nan]
        skipped = 0
        if self.skipped_steps is not None:
            try:
                skipped = int(self.skipped_steps())
            except Exception:
                skipped = 0
        step = float("nan")
        if self._forwards and not self._local_work:
            step = self._busy / self._forwards
        return numbers + [float(skipped), step] + amax

    def _device_numbers(self):
        """float64[4] on the ring's device (and the amax digest with amax_group), read with the
        state (no extra host read), or None once it failed (warned once)."""
        if "numbers" in self.warned:
            return None
        try:
            numbers = batch_numbers(self.ring)
            if self.amax is not None:
                numbers = torch.cat([numbers, self.amax[1]().to(numbers.device)])
            return numbers
        except Exception as exc:  # numguard's own failure: the check itself goes on
            self.warned.add("numbers")
            warnings.warn(f"numguard: the cross-rank numbers failed ({type(exc).__name__}: {exc}); "
                          "outlier ranks are not named from now on", InspectorWarning, stacklevel=5)
            return None

    def _take_numbers(self, values, tail):
        """Strip the numbers off the end of a read state, keeping them for the next exchange."""
        if not tail:
            return values
        words = [int(v) for v in values[-tail:]]
        self.numbers = list(struct.unpack(f"<{tail}d", struct.pack(f"<{tail}q", *words)))
        return values[:-tail]

    def read_now(self, where, batch) -> CheckStatus:
        """One device->host read of the state (and the cross-rank exchange)."""
        self.where = where
        src, shared, tail = self._source(batch)
        values = self._take_numbers(src.tolist(), tail)  # the one device->host read of a checked batch
        return CheckStatus(values[:8], values[8:] if shared else [], len(self.ring.frames), batch)

    def read_local(self, where, batch) -> CheckStatus:
        """One device->host read of this rank's state only (outside the ranks' common checks)."""
        self.where = where
        self.ring.merge_devices()
        values = self.ring.state_buf.tolist()
        return CheckStatus(values[:8], [], len(self.ring.frames), batch)

    def read_async(self, where, batch):
        """The status copied at the previous check (None if none is pending); issues a new copy."""
        self.where = where
        status = None
        if self.pending is not None:
            if self._event is not None and not self._event.query():
                self._event.synchronize()  # the copy was issued a check ago: normally done
            values = self._take_numbers([int(v) for v in self._host_np], self._tail)
            n, _ = self.pending
            self.pending = None
            status = CheckStatus(values[:8], values[8:], n, batch)
        return status

    def issue_async_copy(self, batch):
        src, _, self._tail = self._source(batch)
        if self._host is None or self._host.numel() != src.numel():
            self._make_host_buffer(src.numel())
        self._host.copy_(src, non_blocking=True)
        if self._event is not None:
            # The copy runs on the ring device's stream, which need not be the current device's.
            self._event.record(torch.cuda.current_stream(self.ring.device))
        self.pending = (len(self.ring.frames), batch)

    @outside_inference_mode
    def _make_host_buffer(self, size):
        """Host memory the async check copies the state into (pinned for CUDA; read through a numpy
        view made once, so reading it later is a plain memory read)."""
        pin = self.ring.device.type == "cuda"
        self._host = torch.empty(size, dtype=torch.int64, pin_memory=pin)
        self._host_np = self._host.numpy()
        self._event = torch.cuda.Event() if pin else None

    def device_moved(self):
        self._host = None
        self.pending = None


# ---------------------------------------------------------------------------------------------
# Cross-rank numbers of a check (numguard.distributed.numerics.DEVICE_FIELDS)

_INF = float("inf")
_INV_MAX = {getattr(torch, name): 1.0 / float(info.max) for name, info in schema.DTYPES.items()
            if info.recordable and hasattr(torch, name)}
_GRADIENT_SECTIONS = frozenset({"backward"})


def batch_numbers(ring) -> torch.Tensor:
    """float64[4] on the ring's device over the records of the frames since the last check:
    non-finite values, worst activation headroom and worst gradient headroom (abs max / the
    dtype's largest finite value), smallest non-zero gradient magnitude (inf: none). Device ops
    only: no host sync (the index lists are built from host metadata and copied to the device)."""
    size = ring.size
    rows, inv, grad = [], [], []
    for f in ring.frames[ring.last_check_frames:]:
        g = f.section in _GRADIENT_SECTIONS
        # Parameter gradients count as non-finite values only: after a gradient all_reduce they
        # are the same on every rank, and their abs max (the mean of the ranks') would hide the
        # one rank whose own gradients (tapped in its backward) are 1000x the others'.
        reduced = is_parameter_gradients(f)
        start = f.start
        for p, dtype in zip(f.positions, f.dtypes):
            if p >= start:  # a record this frame wrote (earlier ones are counted where written)
                rows.append(p % size)
                inv.append(0.0 if reduced else _INV_MAX.get(dtype, 0.0))
                grad.append(g and not reduced)
    device = ring.device
    if not rows:
        out = torch.zeros(4, dtype=torch.float64, device=device)
        out[3] = _INF
        return out
    rows_t = torch.tensor(rows, dtype=torch.int64)
    inv_t = torch.tensor(inv, dtype=torch.float64)
    grad_t = torch.tensor(grad, dtype=torch.bool)
    rows_t, inv_t, grad_t = (host_to_device(t, device) for t in (rows_t, inv_t, grad_t))
    recs = ring.ring.index_select(0, rows_t)
    headroom = recs[:, schema.ABS_MAX] * inv_t
    zero = headroom.new_zeros(())
    return torch.stack([
        recs[:, schema.NAN:schema.NEG_INF + 1].sum(),
        torch.where(grad_t, zero, headroom).amax(),  # (parameter gradients: headroom 0 here)
        torch.where(grad_t, headroom, zero).amax(),
        torch.where(grad_t, recs[:, schema.MIN_NONZERO], zero + _INF).amin(),
    ])
