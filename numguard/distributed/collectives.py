"""Small fixed-size collectives numguard runs beside the user's own, on numguard's channel
(numguard.distributed.channel), with a timeout that names the ranks that never arrived.

Every numguard collective goes through :func:`timed_all_reduce` or :func:`timed_all_gather`:

- they run on numguard's own process group over the same ranks (see NOTE: [own process group]),
  so a check can never pair with a user collective that another rank is in;
- they wait with a timeout (``Work.wait(timeout)`` on CPU backends; polling
  ``Work.is_completed()`` on CUDA backends, whose ``wait`` does not block the host);
- a check still waiting after 50 ms writes its check number into the default store under a key
  of its own (one key per rank and group, overwritten; see NOTE: [arrivals]). On timeout it reads
  the other ranks' keys and names those whose check number is behind, in a
  :class:`DistributedTimeoutError`.
"""
from __future__ import annotations

import struct
import time

import torch
from torch.distributed import distributed_c10d as _c10d

from ._env import dist_timeout
from .channel import _backend_timeout, _GroupState, _warn, exclusive, torch_timeout
from .errors import DistributedTimeoutError

def _mark_arrival(st: _GroupState) -> None:
    st.seq += 1


def _post_arrival(st: _GroupState, seq: int | None = None) -> None:
    """Write this rank's check number into the store (slow path only, see NOTE: [arrivals])."""
    if st.store is None:
        return
    try:
        st.arrivals.post(None, st.global_ranks[st.rank], st.seq if seq is None else seq)
    except Exception as exc:  # store gone: keep going, lose only the names of missing ranks
        _warn(f"numguard.distributed: cannot write to the process group's store ({exc}); "
              "a timeout will not be able to name the missing ranks.")
        st.store = None


def _arrivals(st: _GroupState, grace_s: float = 0.25):
    """(missing, ahead) global ranks according to the store, relative to this rank's check.
    Ranks that look missing get ``grace_s`` more seconds to post (they may have arrived just
    before this rank gave up)."""
    if st.store is None:
        return None, None
    try:
        return st.arrivals.behind_and_ahead(None, st.seq, grace_s)
    except Exception:
        return None, None


def _is_timeout(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text


def _timeout_error(st: _GroupState, what: str, site: str, timeout_s: float, cause) -> Exception:
    _post_arrival(st)
    missing, ahead = _arrivals(st)
    me = st.global_ranks[st.rank]
    failure = None if cause is None or _is_timeout(cause) else cause
    if failure is None:
        how = f"did not complete within {timeout_s:g} s (NUMGUARD_DIST_TIMEOUT or timeout=)."
    else:
        how = "failed."
    head = (
        f"numguard.distributed: {what} (numguard check #{st.seq} of process group "
        f"{st.name!r}, called at {site}) {how}"
    )
    # numguard's own group now has an operation left pending: later checks would pair with it.
    st.broken = head
    lines = [head]
    if missing is None:
        lines.append("Could not read the process group's store to name the missing ranks.")
        missing = []
    else:
        arrived = [g for g in st.global_ranks if g not in missing]
        if missing:
            lines.append(f"Ranks that never arrived: {missing}.")
        else:
            lines.append("Every rank arrived, but the collective did not complete.")
        lines.append(f"Ranks that arrived: {arrived} (this process is rank {me}).")
        if ahead:
            lines.append(
                f"Ranks {ahead} are already past this check: the ranks ran different numbers of "
                "checked collectives."
            )
    if cause is not None:
        lines.append(f"Backend error: {cause}")
    lines.append(
        "A rank that never arrives is usually stuck in an earlier step (a collective numguard "
        "does not check, such as DDP's gradient all_reduce), crashed, or took another code path. "
        "numguard stops checking this process group; let the exception end the process."
    )
    return DistributedTimeoutError("\n".join(lines), missing, backend_error=failure)


# NOTE: [arrivals]
# Writing to the store before every check would cost a round trip to the store's server per
# collective (measured: +200 us per check on a loaded 2-core machine, half the collective itself).
# Instead a rank writes its check number only when the check has not completed after
# _POST_AFTER_S: fast checks never touch the store, and by the time any rank gives up (after the
# full timeout) every rank that arrived has posted. Keys are one per rank and group, overwritten.
_POST_AFTER_S = 0.05


# NOTE: [own wait time] Host seconds this process spent waiting in numguard's own collectives
# (replica checks, shape checks, triggers, ...). The cross-rank step time leaves them out: a fast
# rank waits in them for a slow one, and that wait is the slow rank's time, not its own.
_waited = [0.0]


def waited_s() -> float:
    """Host seconds this process has waited in numguard's collectives so far (NOTE: [own wait
    time])."""
    return _waited[0]


def _wait(work, st: _GroupState, what: str, site: str, timeout_s: float) -> None:
    if work is None:
        return
    began = time.perf_counter()
    try:
        _wait_for(work, st, what, site, timeout_s)
    finally:
        _waited[0] += time.perf_counter() - began


def _wait_for(work, st: _GroupState, what: str, site: str, timeout_s: float) -> None:
    first = min(_POST_AFTER_S, timeout_s)
    if st.device.type == "cpu":
        phases = [first] + ([timeout_s - first] if timeout_s - first >= 0.001 else [])
        for i, phase_s in enumerate(phases):
            try:
                if work.wait(torch_timeout(phase_s)) is not False:
                    return
            except RuntimeError as exc:
                if not _is_timeout(exc):
                    raise _timeout_error(st, what, site, timeout_s, exc) from None
            if i == 0:
                _post_arrival(st)
        raise _timeout_error(st, what, site, timeout_s, None)
    # CUDA-like backends: Work.wait only orders streams; poll completion from the host.
    start = time.monotonic()
    posted = False
    spins = 0
    while not work.is_completed():
        waited = time.monotonic() - start
        if not posted and waited > first:
            _post_arrival(st)
            posted = True
        if waited > timeout_s:
            raise _timeout_error(st, what, site, timeout_s, None)
        spins += 1
        if spins > 200:
            time.sleep(min(0.001 * (spins - 200) / 100, 0.01))
    work.wait()


def timed_all_gather(st: _GroupState, words: int, what: str, site: str, timeout=None):
    """All-gather the ``words`` int64 this rank packed into ``st.gather_buffers(words)``'s host
    input; returns the host output bytearray (``world * words`` int64, rank-major)."""
    timeout_s = dist_timeout(timeout)
    hin_b, hin, din, hout_b, hout, dout = st.gather_buffers(words)
    if din is not hin:
        din.copy_(hin, non_blocking=False)
    with exclusive(st, what):
        _mark_arrival(st)
        work = None
        if st.device.type == "cpu":
            work = _cpu_all_gather(st, dout, din, words, timeout_s)
        else:
            if st.gather_single is not None:
                try:
                    work = st.gather_single(dout, din, group=st.group, async_op=True)
                except RuntimeError as exc:
                    if "supported" not in str(exc).lower():
                        raise
                    st.gather_single = None
            if work is None:
                outs = list(dout.view(st.world, words).unbind(0))
                work = _c10d.all_gather(outs, din, group=st.group, async_op=True)
        _wait(work, st, what, site, timeout_s)
    if dout is not hout:
        hout.copy_(dout)
    return hout_b


def timed_all_gather_bytes(st: _GroupState, data: bytes, what: str, site: str, timeout=None) -> list:
    """Every rank's ``data`` (of any length), by rank: one all-gather of the lengths, then one of
    the bytes padded to the longest (none when every rank sends nothing)."""
    st.gather_buffers(1)[1][0] = len(data)
    sizes = struct.unpack_from(f"={st.world}q", timed_all_gather(st, 1, what, site, timeout))
    if not max(sizes):
        return [b""] * st.world
    words = (max(sizes) + 7) // 8
    st.gather_buffers(words)[0][:] = data.ljust(words * 8, b"\0")
    out = timed_all_gather(st, words, what, site, timeout)
    return [bytes(out[r * words * 8:r * words * 8 + size]) for r, size in enumerate(sizes)]


def _cpu_all_reduce(st: _GroupState, tensor: torch.Tensor, op, timeout_s: float):
    try:
        opts = _c10d.AllreduceOptions()
        opts.reduceOp = op
        opts.asyncOp = True
        opts.timeout = _backend_timeout(timeout_s)
        return st.comm.allreduce([tensor], opts)
    except (AttributeError, TypeError):  # an older torch without these options
        if st.comm is not st.pg:
            raise
        return _c10d.all_reduce(tensor, op=op, group=st.group, async_op=True)


def _cpu_all_gather(st: _GroupState, dout, din, words: int, timeout_s: float):
    try:
        opts = _c10d.AllgatherOptions()
        opts.asyncOp = True
        opts.timeout = _backend_timeout(timeout_s)
        method = getattr(st.comm, "all_gather_single", None) or st.comm._allgather_base
        return method(dout, din, opts)
    except (AttributeError, TypeError):
        if st.comm is not st.pg:
            raise
        outs = list(dout.view(st.world, words).unbind(0))
        return _c10d.all_gather(outs, din, group=st.group, async_op=True)


def timed_all_reduce(st: _GroupState, tensor: torch.Tensor, op, what: str, site: str,
                     timeout=None, wait=True):
    """All-reduce ``tensor`` (on ``st.device``) in place; with ``wait=False`` return the work
    handle for :func:`wait_work`."""
    timeout_s = dist_timeout(timeout)
    with exclusive(st, what):
        _mark_arrival(st)
        if st.device.type == "cpu":
            work = _cpu_all_reduce(st, tensor, op, timeout_s)
        else:
            work = _c10d.all_reduce(tensor, op=op, group=st.group, async_op=True)
        if not wait:
            return work, st.seq, timeout_s
        _wait(work, st, what, site, timeout_s)
    return None


def timed_broadcast(st: _GroupState, tensor: torch.Tensor, root: int, what: str, site: str,
                    timeout=None) -> torch.Tensor:
    """Broadcast ``tensor`` (a host tensor of the same size on every rank) from the rank of
    ``st``'s group ``root`` (group-local); returns the received tensor (``tensor`` itself on a
    CPU channel)."""
    timeout_s = dist_timeout(timeout)
    moved = tensor if st.device.type == "cpu" else tensor.to(st.device)
    with exclusive(st, what):
        _mark_arrival(st)
        work = None
        if st.device.type == "cpu":
            try:
                opts = _c10d.BroadcastOptions()
                opts.rootRank = root
                opts.rootTensor = 0
                opts.asyncOp = True
                opts.timeout = _backend_timeout(timeout_s)
                work = st.comm.broadcast([moved], opts)
            except (AttributeError, TypeError):
                if st.comm is not st.pg:
                    raise
        if work is None:
            work = _c10d.broadcast(moved, src=st.global_ranks[root], group=st.group, async_op=True)
        _wait(work, st, what, site, timeout_s)
    if moved is not tensor:
        tensor.copy_(moved)
    return tensor


def wait_work(st: _GroupState, work, seq: int, what: str, site: str, timeout_s: float) -> None:
    """Finish a collective started with ``wait=False``, naming missing ranks on timeout."""
    with exclusive(st, what):
        cur = st.seq
        st.seq = seq
        try:
            _wait(work, st, what, site, timeout_s)
        finally:
            st.seq = cur


__all__ = ["timed_all_gather", "timed_all_gather_bytes", "timed_all_reduce", "timed_broadcast", "wait_work", "waited_s"]
