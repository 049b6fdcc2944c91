"""Reading the trip flag: synchronously (one tiny device->host copy of the state), or
asynchronously (a copy to pinned memory, read at the next check), and sharing it across ranks.

A check returns a CheckStatus; what to do with it (report, warn about headroom, confirm the
frames) is the inspector's business."""
from __future__ import annotations

import warnings
from typing import NamedTuple

import torch

from ..errors import InspectorWarning
from .ring import outside_inference_mode


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


def distributed_on() -> bool:
    try:
        import torch.distributed as dist
        return dist.is_available() and dist.is_initialized()
    except Exception:
        return False


def rank():
    """This process's rank, or None outside an initialized torch.distributed job."""
    try:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except Exception:
        pass
    return None


def coordination(warned: set):
    """numguard.distributed.coordination, or None (with a warning naming it, once) when this
    installation cannot import it: the other ranks then learn nothing of this rank's trips."""
    try:
        from ..distributed import coordination as module
    except ImportError as exc:
        if "coordination" not in warned:
            warned.add("coordination")
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
        state = self.ring.state_buf
        if distributed_on() and (torch.is_grad_enabled() or self.where != "batch end"):
            module = coordination(self.warned)
            if module is not None:
                # The batch number lets ranks that pair different batches (different check_every,
                # an extra batch on one rank) be told so, naming both.
                flags = module.exchange_trip(state[0], batch_number=batch)
                return torch.cat([state, flags.to(state.device)]), True
        return state, False

    def read_now(self, where, batch) -> CheckStatus:
        """One device->host read of the state (and the cross-rank exchange)."""
        self.where = where
        src, shared = self._source(batch)
        values = src.tolist()  # the one device->host read of a checked batch
        return CheckStatus(values[:8], values[8:] if shared else [], len(self.ring.frames), batch)

    def read_local(self, where, batch) -> CheckStatus:
        """One device->host read of this rank's state only (outside the ranks' common checks)."""
        self.where = where
        values = self.ring.state_buf.tolist()
        return CheckStatus(values[:8], [], len(self.ring.frames), batch)

    def read_async(self, where, batch):
        """The status copied at the previous check (None if none is pending); issues a new copy."""
        self.where = where
        status = None
        if self.pending is not None:
            if self._event is not None and not self._event.query():
                self._event.synchronize()  # the copy was issued a check ago: normally done
            values = [int(v) for v in self._host_np]
            n, _ = self.pending
            self.pending = None
            status = CheckStatus(values[:8], values[8:], n, batch)
        return status

    def issue_async_copy(self, batch):
        src, _ = self._source(batch)
        if self._host is None or self._host.numel() != src.numel():
            self._make_host_buffer(src.numel())
        self._host.copy_(src, non_blocking=True)
        if self._event is not None:
            self._event.record()
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
