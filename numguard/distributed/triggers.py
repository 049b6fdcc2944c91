"""Triggers: any rank raises a flag, every rank sees it at the same check.

``set_trigger()`` sets a local flag. ``check_trigger()`` is a collective (every rank of the group
calls it the same number of times): ONE all_reduce(MAX) of a one-element int64 tensor, so every
rank returns the same answer; the flag is cleared once it has been sent.

``check_trigger(blocking=False)`` does not wait: it reads the reduction started by the previous
non-blocking call (False on the first call) and starts the next one with the flag as it is now.
A trigger set before non-blocking check ``k`` is therefore seen by every rank at check ``k + 1``.
Use one form or the other consistently on all ranks.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import channel as _channel
from . import collectives as _collectives


class _TriggerState:
    __slots__ = ("flag", "pending")

    def __init__(self):
        self.flag = 0
        self.pending = None  # (work, tensor, seq, timeout_s, site) of a non-blocking check


_STATES: dict = {}


def _forget(group) -> None:
    """Drop pending checks of a released group (they hold numguard's own process group)."""
    if group is None:
        _STATES.clear()
    else:
        _STATES.pop(group, None)


_channel.on_release(_forget)


def _state(group) -> _TriggerState:
    key = group if group is not None else "default"
    st = _STATES.get(key)
    if st is None:
        st = _STATES.setdefault(key, _TriggerState())  # one state even when threads race here
    return st


def set_trigger(group=None) -> None:
    """Raise the trigger on this rank; every rank sees it at the next (blocking) check."""
    _state(group).flag = 1


def check_trigger(blocking: bool = True, group=None, timeout: float | None = None) -> bool:
    """True on every rank if any rank called :func:`set_trigger` before this check (blocking) or
    before the previous non-blocking check (``blocking=False``). See the module docstring."""
    ts = _state(group)
    if not _channel.is_initialized():
        seen, ts.flag = bool(ts.flag), 0
        return seen
    st = _channel.group_state(group)
    if st.broken is not None:
        st.warn_once("broken trigger", (
            f"numguard.distributed: check_trigger on process group {st.name!r} sees this "
            f"rank's trigger only: numguard stopped using the group after: {st.broken}"))
        seen, ts.flag, ts.pending = bool(ts.flag), 0, None
        return seen
    site = _channel.call_site()
    with _channel.exclusive(st, "check_trigger"):
        return _check(st, ts, blocking, site, timeout)


def _check(st, ts, blocking: bool, site: str, timeout) -> bool:
    if blocking:
        if ts.pending is not None:
            _finish(st, ts)  # drain a non-blocking check so the two forms stay paired
        t = torch.full((1,), ts.flag, dtype=torch.int64, device=st.device)
        ts.flag = 0
        _collectives.timed_all_reduce(st, t, dist.ReduceOp.MAX, "numguard check_trigger (all_reduce)",
                             site, timeout)
        return bool(t.item())
    seen = _finish(st, ts) if ts.pending is not None else False
    t = torch.full((1,), ts.flag, dtype=torch.int64, device=st.device)
    ts.flag = 0
    work, seq, timeout_s = _collectives.timed_all_reduce(
        st, t, dist.ReduceOp.MAX, "numguard check_trigger(blocking=False) (all_reduce)", site,
        timeout, wait=False)
    ts.pending = (work, t, seq, timeout_s, site)
    return seen


def _finish(st, ts) -> bool:
    work, t, seq, timeout_s, site = ts.pending
    ts.pending = None
    _collectives.wait_work(st, work, seq, "numguard check_trigger(blocking=False) (all_reduce)", site,
                  timeout_s)
    return bool(t.item())
