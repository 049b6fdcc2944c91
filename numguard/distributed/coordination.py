"""Small fixed-size collectives numguard runs beside the user's own, with a timeout that names
the ranks that never arrived.

Every numguard collective goes through :func:`timed_all_reduce` or :func:`timed_all_gather`:

- they run on numguard's own process group over the same ranks (see NOTE: [own process group]),
  so a check can never pair with a user collective that another rank is in;
- they wait with a timeout (``Work.wait(timeout)`` on CPU backends; polling
  ``Work.is_completed()`` on CUDA backends, whose ``wait`` does not block the host);
- a check still waiting after 50 ms writes its check number into the default store under a key
  of its own (one key per rank and group, overwritten; see NOTE: [arrivals]). On timeout it reads
  the other ranks' keys and names those whose check number is behind, in a
  :class:`DistributedTimeoutError`.

The coordinated-trip helpers used by the inspector live here too: :func:`exchange_trip` and
:func:`gather_trip_details`. Unlike the checks, they tolerate ranks that never come: the ranks
first meet in the store (numguard.distributed.rendezvous) and run the collective only when every
rank is there; otherwise the rank goes on with its own result and warns once.

Per-group state is released when the group is destroyed (``destroy_process_group`` is wrapped)
and at interpreter exit (see NOTE: [teardown]). Threads sharing a group's numguard collectives
run them one after the other, with a one-time warning (see :func:`exclusive`).
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import os
import struct
import threading
import time
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as _c10d

from .. import patches as _patches
from .. import process as _process
from .. import schema
from ._env import dist_timeout
from .errors import DistributedOperationException, DistributedTimeoutError, DistributedWarning
from .rendezvous import Rendezvous

# One copy of each (numguard.process), named here as the distributed code has always called them.
is_initialized = _process.is_distributed
rank = _process.rank
world_size = _process.world_size
call_site = _process.call_site
_user_stacklevel = _process.user_stacklevel


def collective_device(group=None) -> torch.device:
    """The device the user's collectives on ``group`` use: CPU when the group has a gloo backend
    (also for ``cpu:gloo,cuda:nccl``), else the current CUDA device for nccl."""
    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend or "mpi" in backend:
        return torch.device("cpu")
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if "xccl" in backend and hasattr(torch, "xpu") and torch.xpu.is_available():
        return torch.device("xpu", torch.xpu.current_device())
    return torch.device("cpu")


# NOTE: [timeout cap]
# The longest timeout numguard hands to torch, gloo or the store: 2**31 - 1 ms (24.8 days), which
# every timeout field on the way holds. Larger ones overflow in the backend (timeout=1e10 made
# every healthy check fail at once); numguard's own clock still uses the value as given.
MAX_TORCH_TIMEOUT_S = (2 ** 31 - 1) / 1000


def torch_timeout(seconds: float) -> timedelta:
    """``seconds`` as the timedelta passed to torch: at least 1 ms (zero means "no timeout" to
    ``Work.wait``), at most :data:`MAX_TORCH_TIMEOUT_S`."""
    return timedelta(seconds=min(max(seconds, 0.001), MAX_TORCH_TIMEOUT_S))


def _warn(message: str) -> None:
    warnings.warn(message, DistributedWarning, stacklevel=_user_stacklevel())


# NOTE: [own process group]
# numguard's check traffic (check_shapes, check_trigger, in-order logs, trip exchanges) runs on
# a gloo process group of numguard's own over the ranks of the user's group. On the user's group
# itself a check pairs with whatever collective another rank is in: a rank that runs one more
# DDP step or guarded collective than the others met their barrier with a numguard check.
# The group is built directly (ProcessGroupGloo over a PrefixStore of the default store, under
# numguard/side/<group name>/), not with new_group: new_group is collective over the whole
# default group and advances torch's group counter (renaming the user's later groups), while
# this touches nothing of torch's. Its devices connect lazily, so creating it needs no meeting:
# every rank creates it with its first numguard collective on the group, and the connections
# open in that collective, which every rank of the group reaches like any collective (the trip
# exchange only after the store rendezvous has seen every rank). It is released with the user's
# group (NOTE: [teardown]). Where it cannot be built (gloo missing, no usable interface),
# numguard warns once and shares the user's group as before. On nccl jobs the checks thereby run
# on CPU (their records are host bytes: no device copies); the CUDA trip exchange keeps its
# device all_reduce on the user's group, started only once the rendezvous has seen every rank.
# A lazy connection waits for its peer with the group's creation timeout (an operation's own
# timeout does not cover it, measured), so the group is created with the check timeout of
# NUMGUARD_DIST_TIMEOUT (plus the backend margin): a process whose first check found a rank
# missing can exit once that has passed, not after gloo's default 30 minutes.
_OWN_GROUP_PREFIX = "numguard/side/"


def _own_group_timeout() -> timedelta:
    try:
        return _backend_timeout(dist_timeout())
    except ValueError:  # an invalid NUMGUARD_DIST_TIMEOUT is reported by the check itself
        return _backend_timeout(60.0)


def _new_own_group(rank_in_group: int, world: int, store, name: str, global_ranks):
    gloo = dist.ProcessGroupGloo
    opts = gloo._Options()
    opts._timeout = _own_group_timeout()
    interfaces = [i for i in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if i]
    opts._devices = ([gloo.create_device(interface=i, lazy_init=True) for i in interfaces]
                     or [gloo.create_default_device(lazy_init=True)])
    opts._threads = 1  # numguard's operations run one at a time
    opts.global_ranks_in_group = list(global_ranks)
    opts.group_name = f"numguard/{name}"
    return gloo(dist.PrefixStore(f"{_OWN_GROUP_PREFIX}{name}/", store), rank_in_group, world,
                opts)


class LastExchange:
    """What the last trip exchange of a group found (see :func:`last_exchange`)."""

    __slots__ = ("complete", "slot", "missing", "batches")

    def __init__(self, complete=True, slot=0, missing=(), batches=None):
        self.complete = complete
        self.slot = slot
        self.missing = list(missing)
        self.batches = batches

    def as_dict(self) -> dict:
        return {"complete": self.complete, "slot": self.slot, "missing": list(self.missing),
                "batches": None if self.batches is None else list(self.batches)}


class _GroupState:
    """Per process group: ranks, numguard's own group (``comm``) and its device, the check
    counter, the store, preallocated buffers, the rendezvous, the lock of :func:`exclusive`."""

    def __init__(self, group):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.global_ranks = (
            list(range(self.world)) if group is None else dist.get_process_group_ranks(group)
        )
        pg = group if group is not None else _c10d._get_default_group()
        self.pg = pg
        self.name = str(getattr(pg, "group_name", None) or id(pg))
        self.parent_device = collective_device(group)
        self.seq = 0
        self.store = None
        try:
            self.store = _c10d._get_default_store()
        except Exception:  # no store (e.g. a backend initialised without one): no arrival tracking
            self.store = None
        self.buffers: dict[int, tuple] = {}
        self.lock = threading.RLock()
        self.holder: str | None = None
        self.warned: set = set()
        self.broken: str | None = None  # why numguard stopped using its group (a timeout)
        self.last = LastExchange()
        self.numerics_off = False
        self.rendezvous = None
        if self.store is not None:
            self.rendezvous = Rendezvous(self.store, f"numguard/x/{self.name}/",
                                         self.global_ranks, self.global_ranks[self.rank])
        self.own_group = None
        self.comm, self.device = self._open_comm()
        self.gather_single = getattr(_c10d, "all_gather_single", None)
        if self.gather_single is None:
            self.gather_single = getattr(_c10d, "all_gather_into_tensor", None)

    def _open_comm(self):
        """(the process group numguard's collectives use, its device)."""
        if self.world > 1 and self.store is not None:
            try:
                self.own_group = _new_own_group(self.rank, self.world, self.store, self.name,
                                                self.global_ranks)
                return self.own_group, torch.device("cpu")
            except Exception as exc:  # gloo missing or no usable interface: share the group
                self.warn_once("own group", (
                    f"numguard.distributed: cannot create numguard's own gloo process group for "
                    f"process group {self.name!r} ({type(exc).__name__}: {exc}); numguard's "
                    "checks share that group, where a rank that runs one collective more than "
                    "the others meets them with a check. Set GLOO_SOCKET_IFNAME to a usable "
                    "network interface to get numguard's own group."))
        return self.pg, self.parent_device

    def warn_once(self, kind: str, message: str) -> None:
        if kind not in self.warned:
            self.warned.add(kind)
            _warn(message)

    def close(self) -> None:
        """Shut numguard's own group down and drop every reference to the user's group."""
        own, self.own_group = self.own_group, None
        self.comm = self.pg = self.group = self.store = self.rendezvous = None
        self.buffers.clear()
        if own is None:
            return
        try:
            if self.broken:  # a collective left pending by a timeout: do not wait for it
                own.abort()
            else:
                own.shutdown()
        except Exception:  # releasing must never fail the user's teardown
            pass

    def arrival_key(self, global_rank: int) -> str:
        return f"numguard/arrived/{self.name}/{global_rank}"

    def gather_buffers(self, words: int):
        """(host_bytes, host_in, dev_in, host_out_bytes, host_out, dev_out) for an all_gather of
        ``words`` int64 per rank; host tensors share memory with the bytearrays."""
        bufs = self.buffers.get(words)
        if bufs is None:
            hin_b = bytearray(words * 8)
            hin = torch.frombuffer(hin_b, dtype=torch.int64)
            hout_b = bytearray(words * 8 * self.world)
            hout = torch.frombuffer(hout_b, dtype=torch.int64)
            if self.device.type == "cpu":
                din, dout = hin, hout
            else:
                din = torch.empty(words, dtype=torch.int64, device=self.device)
                dout = torch.empty(words * self.world, dtype=torch.int64, device=self.device)
            bufs = (hin_b, hin, din, hout_b, hout, dout)
            self.buffers[words] = bufs
        return bufs

    def reduce_buffers(self, words: int):
        """(host_bytes, host, dev) int64[words] for numguard's small all_reduces."""
        key = -words
        bufs = self.buffers.get(key)
        if bufs is None:
            hb = bytearray(words * 8)
            h = torch.frombuffer(hb, dtype=torch.int64)
            d = h if self.device.type == "cpu" else torch.empty(words, dtype=torch.int64,
                                                                  device=self.device)
            bufs = self.buffers[key] = (hb, h, d)
        return bufs


# ---------------------------------------------------------------------------------------------
# Per-group state and its release

# NOTE: [teardown]
# A ProcessGroupGloo (or the store it holds) still referenced when the interpreter tears down is
# destroyed with its threads unjoined: "terminate called without an active exception" (SIGABRT)
# in some runs of a script that called destroy_process_group and exited normally (1 in 6 and
# 1 in 10 measured on 2 ranks; every run for a gloo group nobody shut down). numguard's
# per-group state held the user's group past destroy_process_group, and
# holds numguard's own group. So the state of a group is released (own group shut down,
# references dropped) when destroy_process_group is called through torch.distributed or
# distributed_c10d (both names wrapped once, when numguard first creates state), and everything
# is released by an atexit handler, which runs before the interpreter tears down, also for a
# destroy_process_group imported by name before numguard was.
_STATES: dict = {}
_RELEASE_HOOKS: list = []
# Two threads making a group's first numguard call together would build two states (two own
# groups under one store prefix, two locks): creation holds this lock.
_states_lock = threading.Lock()
_lifecycle_lock = threading.Lock()
_lifecycle_installed = False


def group_state(group=None) -> _GroupState:
    key = group if group is not None else _c10d._world.default_pg
    st = _STATES.get(key)
    if st is None:
        with _states_lock:
            st = _STATES.get(key)
            if st is None:
                _install_lifecycle()
                st = _STATES[key] = _GroupState(group)
    return st


def on_release(hook) -> None:
    """Call ``hook(group)`` when numguard releases a group's state (``group`` None: all groups)."""
    _RELEASE_HOOKS.append(hook)


def release(group=None) -> None:
    """Forget numguard's state for ``group`` (every group when None or the default group): shut
    numguard's own group down and drop the references to the user's group and store."""
    everything = group is None or group is _c10d.GroupMember.WORLD or (
        group is _c10d._world.default_pg)
    keys = list(_STATES) if everything else [k for k in _STATES if k is group]
    for key in keys:
        _STATES.pop(key).close()
    for hook in _RELEASE_HOOKS:
        hook(None if everything else group)


def _releasing(destroy):
    @functools.wraps(destroy)
    def destroy_process_group(group=None, *args, **kwargs):
        try:
            release(group)
        except Exception as exc:  # never stand in the way of the user's teardown
            _warn(f"numguard.distributed: releasing numguard's state failed ({exc}).")
        return destroy(group, *args, **kwargs)

    destroy_process_group.__numguard_original__ = destroy
    return destroy_process_group


def _release_at_exit() -> None:
    try:
        release(None)
    except Exception:  # at exit there is no one left to tell; the point is not to abort
        pass


def _install_lifecycle() -> None:
    global _lifecycle_installed
    with _lifecycle_lock:
        if _lifecycle_installed:
            return
        _lifecycle_installed = True
        atexit.register(_release_at_exit)
        original = getattr(_c10d, "destroy_process_group", None)
        if original is None or hasattr(original, "__numguard_original__"):
            return
        wrapped = _releasing(original)
        for namespace, where in ((dist, "torch.distributed"), (_c10d, "torch.distributed.distributed_c10d")):
            if getattr(namespace, "destroy_process_group", None) is original:
                _patches.replace(namespace, "destroy_process_group", wrapped, calls=original,
                                 target=f"{where}.destroy_process_group",
                                 why="numguard.distributed: release numguard's own group before the user's teardown")


@contextlib.contextmanager
def exclusive(st: _GroupState, what: str):
    """Run one numguard operation on ``st``'s group at a time in this process. A second thread
    that comes while one is inside waits for it, after a one-time warning: its check numbers and
    buffers stay intact, but ranks may order the threads differently."""
    if not st.lock.acquire(blocking=False):
        me = threading.current_thread().name
        st.warn_once("threads", (
            f"numguard.distributed: thread {me!r} started {what} on process group {st.name!r} "
            f"while thread {st.holder!r} was inside another numguard operation on it. numguard "
            "runs them one after the other on this rank, but each rank may order the threads "
            "differently and so pair different collectives across ranks. Run a process group's "
            "collectives from one thread, or give each thread its own group "
            "(torch.distributed.new_group)."))
        st.lock.acquire()
    outer = st.holder
    st.holder = threading.current_thread().name
    try:
        yield
    finally:
        st.holder = outer
        st.lock.release()


# ---------------------------------------------------------------------------------------------
# Timed collectives

def _mark_arrival(st: _GroupState) -> None:
    st.seq += 1


def _post_arrival(st: _GroupState, seq: int | None = None) -> None:
    """Write this rank's check number into the store (slow path only, see NOTE: [arrivals])."""
    if st.store is None:
        return
    try:
        st.store.set(st.arrival_key(st.global_ranks[st.rank]), str(st.seq if seq is None else seq))
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
    deadline = time.monotonic() + grace_s
    while True:
        missing, ahead = [], []
        for g in st.global_ranks:
            key = st.arrival_key(g)
            try:
                seq = int(st.store.get(key)) if st.store.check([key]) else 0
            except Exception:
                return None, None
            if seq < st.seq:
                missing.append(g)
            elif seq > st.seq:
                ahead.append(g)
        if not missing or time.monotonic() > deadline:
            return missing, ahead
        time.sleep(0.02)


def _is_timeout(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text


def _timeout_error(st: _GroupState, what: str, site: str, timeout_s: float, cause) -> Exception:
    _post_arrival(st)
    missing, ahead = _arrivals(st)
    me = st.global_ranks[st.rank]
    if cause is None or _is_timeout(cause):
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
    return DistributedTimeoutError("\n".join(lines), missing)


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


# NOTE: [backend timeout]
# On CPU (gloo) numguard calls the process group's own methods with the options' timeout set to
# the check's timeout plus _BACKEND_MARGIN_S, instead of the torch.distributed functions (which
# leave the group's default, 30 minutes for gloo). Work.wait(timeout) alone returns to the
# caller in time, but the abandoned operation would keep gloo's worker thread busy and the
# process could not exit until the missing rank died or 30 minutes passed (measured: the process
# lingered after raising until the missing rank exited). With the option set, gloo itself gives
# up shortly after numguard has raised, so the exception can end the process. CUDA (nccl)
# collectives keep the group's timeout: there an expired operation makes the NCCL watchdog tear
# the process down.
_BACKEND_MARGIN_S = 1.0


def _backend_timeout(timeout_s: float) -> timedelta:
    return torch_timeout(timeout_s + _BACKEND_MARGIN_S)


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


def wait_work(st: _GroupState, work, seq: int, what: str, site: str, timeout_s: float) -> None:
    """Finish a collective started with ``wait=False``, naming missing ranks on timeout."""
    with exclusive(st, what):
        cur = st.seq
        st.seq = seq
        try:
            _wait(work, st, what, site, timeout_s)
        finally:
            st.seq = cur


# ---------------------------------------------------------------------------------------------
# Coordinated trips (called by the inspector at the end of a checked batch)

#: Seconds the trip exchange waits for every rank before going on with this rank's own result
#: (at most the check timeout, ``NUMGUARD_DIST_TIMEOUT``).
EXCHANGE_GRACE_S = 5.0
_NO_BATCH = -(2 ** 63)  # "this rank passed no batch number": not compared


def _exchange_grace(grace) -> float:
    if grace is None:
        return min(EXCHANGE_GRACE_S, dist_timeout())
    if isinstance(grace, bool) or not isinstance(grace, (int, float)) or not grace >= 0:
        raise ValueError(f"grace={grace!r} is not valid: pass a number of seconds >= 0.")
    return float(grace)


def _meet_everyone(st: _GroupState, what: str, site: str, grace_s: float) -> LastExchange:
    """Meet the other ranks in the store (NOTE: [rendezvous slots]); ``.complete`` when every
    rank came. Otherwise this rank has warned once and goes on with its own result."""
    if st.broken is not None:
        st.warn_once("broken", (
            f"numguard.distributed: the {what} on process group {st.name!r} uses this rank's "
            f"own result: numguard stopped using the group after: {st.broken}"))
        return LastExchange(False, 0, [])
    if st.rendezvous is None:  # no store: every rank is assumed to come, as with any collective
        return LastExchange(True, 0, [])
    try:
        meeting = st.rendezvous.meet(grace_s)
    except Exception as exc:  # the store failed: numguard's trouble, not the job's
        st.warn_once("store", (
            f"numguard.distributed: the {what} on process group {st.name!r} cannot use the "
            f"process group's store ({type(exc).__name__}: {exc}); this rank reports only its "
            "own NaN/Inf."))
        return LastExchange(False, 0, [])
    if not meeting.joined and meeting.waited_s > 0:
        me = st.global_ranks[st.rank]
        st.warn_once("missing", (
            f"numguard.distributed: ranks {meeting.missing} did not come to numguard's {what} "
            f"#{meeting.slot} of process group {st.name!r} within {meeting.waited_s:g} s (this "
            f"process is rank {me}, called at {site}). This "
            "rank goes on with its own result: it reports its own NaN/Inf, not theirs, until "
            "they take part again (numguard then lines the ranks up by itself). Usual causes: "
            "watch() on some ranks only, or batches run with gradients enabled on some ranks "
            "only (evaluation on rank 0: run it under torch.no_grad()), or a rank much slower "
            "than the others at this point."))
    return LastExchange(meeting.joined, meeting.slot, meeting.missing)


def _local_flags(st: _GroupState, src: torch.Tensor) -> torch.Tensor:
    flags = torch.zeros(st.world, dtype=torch.int64, device=st.parent_device)
    flags[st.rank].copy_(src, non_blocking=src.device.type != "cpu"
                         and st.parent_device.type != "cpu")
    return flags


def _gather_pairs(st: _GroupState, first: int, second: int, what: str, site: str,
                  numbers=None, third: int = 0):
    """All-gather three int64 per rank on numguard's group (the flag, the batch, the rank-local
    batches); [(first, second, third) per rank]. With ``numbers`` (numerics.FIELDS as floats)
    they ride in the same record: then [(first, second, third, numbers) per rank]."""
    numbers = [] if numbers is None else list(numbers)
    words = 3 + len(numbers)
    fmt = f"<3q{len(numbers)}d"
    hin_b = st.gather_buffers(words)[0]
    struct.pack_into(fmt, hin_b, 0, first, second, third, *numbers)
    out = timed_all_gather(st, words, what, site)
    rows = [struct.unpack_from(fmt, out, r * words * 8) for r in range(st.world)]
    return [(row[0], row[1], row[2], row[3:]) for row in rows]


# NOTE: [cross-rank numbers]
# The trip exchange's record also carries each rank's numerics (numguard.distributed.numerics):
# the numbers the inspector's previous check read with its state (no extra host read), and host
# times it measured. Every rank feeds the same gathered table to numerics.observe, so every rank
# names the same outliers. numerics registers itself (on_exchange): the channel knows nothing of
# what its users do with an exchange.
_exchange_observers = []  # observe(st, numbers by rank, batch by rank or None)


def on_exchange(observe) -> None:
    """Have ``observe(st, rows, batches)`` told every trip exchange's table of numbers."""
    if observe not in _exchange_observers:
        _exchange_observers.append(observe)


def _observe_numbers(st: _GroupState, pairs) -> None:
    try:
        rows = [list(p[3]) for p in pairs]
        batches = [None if p[1] == _NO_BATCH else p[1] for p in pairs]
        for observe in _exchange_observers:
            observe(st, rows, batches)
    except Exception as exc:  # numguard's own trouble: the exchange's result stands
        st.warn_once("numerics", (
            f"numguard.distributed: the cross-rank numerics of process group {st.name!r} failed "
            f"({type(exc).__name__}: {exc}); outlier ranks are not named from now on."))
        st.numerics_off = True


def _check_batches(st: _GroupState, batches: list, local=None) -> None:
    """Warn once when the ranks that passed a batch number passed different ones, not counting
    each rank's ``local`` batches (run under no_grad, e.g. rank 0's evaluation: the other ranks
    never ran them)."""
    local = local or [0] * len(batches)
    mine = batches[st.rank]
    others = [(r, b) for r, b in enumerate(batches)
              if b is not None and mine is not None and b - local[r] != mine - local[st.rank]]
    if mine is None or not others:
        return
    listed = ", ".join(f"batch {b} on rank {st.global_ranks[r]}" for r, b in others)
    st.warn_once("batches", (
        f"numguard.distributed: the trip exchange of process group {st.name!r} paired batch "
        f"{mine} on this rank (rank {st.global_ranks[st.rank]}) with {listed}: the ranks check "
        "different batches (different check_every / NUMGUARD_CHECK_EVERY, or batches that only "
        "some ranks ran with gradients enabled, such as evaluation). A NaN/Inf on another rank "
        "is reported with that rank's batch number (numguard.distributed.last_exchange())."))


def exchange_trip(tripped: torch.Tensor, group=None, blocking: bool | None = None, *,
                  batch_number: int | None = None, grace: float | None = None,
                  numbers=None, local_batches: int = 0) -> torch.Tensor:
    """Share this rank's trip flag with every rank of the group.

    Args:
        tripped: 0-dim integer tensor (nonzero = this rank tripped) on any device.
        group: process group (default group when None).
        blocking: wait for the result. Default: True when the user's group runs on the CPU
            (gloo); False on CUDA (nccl), where the flags' all_reduce is only enqueued on the
            current stream so the caller's own device->host read (or event) is the only sync.
        batch_number: the batch this check covers. Ranks that pass one compare them: a pairing
            of different batches (ranks with different ``check_every``) is warned about once,
            naming both numbers, and recorded in :func:`last_exchange`.
        grace: seconds to wait for the other ranks (default: 5, at most
            ``NUMGUARD_DIST_TIMEOUT``).
        numbers: this rank's numbers for the outlier rule (numerics.FIELDS, host floats; NOTE:
            [cross-rank numbers]). Every rank of the group passes them or none does.
        local_batches: batches this rank ran on its own (forwards under no_grad, such as rank
            0's evaluation) among those counted by ``batch_number``: the batch comparison leaves
            them out.

    Returns int64[world_size] on the user's group's collective device: entry ``r`` is rank
    ``r``'s flag. Never raises for a rank that does not come: the ranks first meet in the store
    (NOTE: [rendezvous slots]); when some rank is not there within the grace, this rank warns
    once, naming it, and returns only its own flag (the others' entries 0), and
    :func:`gather_trip_details` stays local too. Without an initialized process group, returns
    ``tripped`` as a 1-element int64 tensor.
    """
    if not is_initialized():
        return tripped.reshape(1).to(torch.int64)
    st = group_state(group)
    src = tripped.reshape(())
    if src.dtype != torch.int64:
        src = src.to(torch.int64)
    flags = _local_flags(st, src)
    if st.world == 1:
        st.last = LastExchange(True, 0, [], None if batch_number is None else [batch_number])
        return flags
    grace_s = _exchange_grace(grace)
    site = call_site()
    what = "trip exchange"
    batch = _NO_BATCH if batch_number is None else int(batch_number)
    on_cpu = st.parent_device.type == "cpu"
    with exclusive(st, f"the {what}"):
        st.last = _meet_everyone(st, what, site, grace_s)
        if not st.last.complete:
            return flags
        try:
            # Every rank is here: this collective cannot be left pending.
            if on_cpu or batch != _NO_BATCH:
                if numbers is not None:
                    numbers = [float(v) for v in numbers]
                pairs = _gather_pairs(st, int(src.item()) if on_cpu else 0, batch,
                                      "numguard trip exchange (all_gather)", site, numbers,
                                      int(local_batches))
                st.last.batches = [None if p[1] == _NO_BATCH else p[1] for p in pairs]
                _check_batches(st, st.last.batches, [p[2] for p in pairs])
                if numbers is not None and not st.numerics_off:
                    _observe_numbers(st, pairs)
                if on_cpu:
                    return torch.tensor([p[0] for p in pairs], dtype=torch.int64)
            # CUDA: the flags stay on the device; the all_reduce on the user's group is safe here
            # because every rank has come (NOTE: [own process group]).
            work = _c10d.all_reduce(flags, op=dist.ReduceOp.SUM, group=st.group, async_op=True)
            if work is not None:
                work.wait()  # stream-ordered on CUDA: no host sync
            if blocking and flags.is_cuda:
                torch.cuda.current_stream(flags.device).synchronize()
            return flags
        except DistributedOperationException as exc:
            st.warn_once("exchange failed", (
                f"numguard.distributed: the {what} of process group {st.name!r} failed after "
                f"every rank came ({exc}); this rank reports only its own NaN/Inf from now on."))
            st.last = LastExchange(False, st.last.slot, [])
            return _local_flags(st, src)


def last_exchange(group=None) -> dict:
    """What the last :func:`exchange_trip` of ``group`` found: ``complete`` (every rank took
    part; False: the result was this rank's own), ``slot`` (the rendezvous slot), ``missing``
    (global ranks that did not come) and ``batches`` (each rank's batch number, when they were
    exchanged; None otherwise)."""
    if not is_initialized():
        return LastExchange().as_dict()
    return group_state(group).last.as_dict()


class TripDetail(tuple):
    """``(rank, module name or None)`` of a rank that tripped, as a 2-tuple; ``.batch`` is the
    batch number that rank reported (None when unknown), ``.kind`` what its first non-finite
    value was (one of schema.FAULT_KINDS, None when unknown), ``.ordinal`` how many frames of
    that kind came before it in its batch, ``.labels`` its offending labels."""

    def __new__(cls, rank_: int, module: str | None, batch: int | None = None,
                kind: str | None = None, ordinal: int = 0, labels=()):
        self = super().__new__(cls, (rank_, module))
        self.batch = batch
        self.kind = kind
        self.ordinal = ordinal
        self.labels = list(labels)
        return self


_DETAIL_HEADER = 4  # magic, batch, info (flags, kind, name and labels lengths), ordinal
_DETAIL_WORDS = 64  # the header + 60 * 8 bytes of module name and labels
_DETAIL_CAPACITY = (_DETAIL_WORDS - _DETAIL_HEADER) * 8
_DETAIL_MAGIC = 0x4E47_5453  # "NGTS"
_TRUNC_MARK = "..."
_NO_KIND_ORDER = len(schema.FAULT_KINDS)


def _encode_name(name: str, capacity: int) -> bytes:
    raw = name.encode("utf-8")
    if len(raw) <= capacity:
        return raw
    mark = _TRUNC_MARK.encode()
    cut = raw[: max(0, capacity - len(mark))].decode("utf-8", errors="ignore").encode("utf-8")
    return cut + mark


def _kind_order(kind) -> int:
    return schema.FAULT_KINDS.index(kind) if kind in schema.FAULT_KINDS else _NO_KIND_ORDER


def earliest_fault(details):
    """The :class:`TripDetail` of the fault that came first, or None for none: the earliest
    batch, then the earliest kind of a step (NOTE: [earliest fault]), then the earliest frame of
    that kind in the batch, then the lowest rank. Every rank gets the same details from
    :func:`gather_trip_details`, so every rank names the same fault."""
    # NOTE: [earliest fault]
    # A NaN made on one rank reaches the others through the collectives after it: with DDP the
    # gradient all_reduce writes rank 1's NaN into rank 0's parameter gradients, so at the
    # optimizer step's check both ranks have tripped, rank 0 in "[every parameter].grad". The
    # ranks cannot compare clocks, but they run the same step: a forward fault comes before any
    # gradient, a gradient tapped in the backward before the parameter gradients a collective
    # reduced, and within a kind the ranks' frames come in the same order (a collective in the
    # forward, such as SyncBatchNorm, carries a NaN to a later frame of the other ranks).
    # Nothing of this costs a healthy batch anything: it rides in the trip details record, which
    # is exchanged only once a rank has tripped.
    def key(d):
        batch = d.batch if d.batch is not None else 2 ** 62
        return (batch, _kind_order(d.kind), d.ordinal, d[0])

    tripped = [d for d in details if d is not None]
    return min(tripped, key=key) if tripped else None


def gather_trip_details(module_name: str | None, batch_number: int, group=None,
                        tripped: bool | None = None, *, kind: str | None = None,
                        ordinal: int = 0, labels=()) -> list[TripDetail]:
    """After :func:`exchange_trip` showed a trip, share which module tripped on which rank.

    Called on every rank (one all_gather of a fixed-size int64 record, after a store
    rendezvous). ``module_name`` is this rank's first offending module (None when this rank did
    not trip); ``tripped`` defaults to ``module_name is not None``; ``kind`` (one of
    schema.FAULT_KINDS), ``ordinal`` (frames of that kind before it in its batch) and ``labels``
    (its offending labels) say what that fault was, for :func:`earliest_fault`. Returns
    ``[(rank, module_name_or_None), ...]`` (:class:`TripDetail`, with ``.batch``, ``.kind``,
    ``.ordinal``, ``.labels``) for the ranks that tripped, in rank order. Module names longer
    than 480 bytes are truncated and end with ``...``; labels get what the name leaves of the
    480 bytes. When the last exchange was local (a rank did not come) or a rank does not come
    now, returns this rank's own entry only.
    """
    if tripped is None:
        tripped = module_name is not None
    if kind is not None and kind not in schema.FAULT_KINDS:
        raise ValueError(f"kind={kind!r} is not valid: use one of {schema.FAULT_KINDS} or None.")
    labels = [str(label) for label in labels]
    mine = TripDetail(0, module_name, batch_number, kind, int(ordinal), labels)
    if not is_initialized():
        return [mine] if tripped else []
    st = group_state(group)
    local = [TripDetail(st.rank, module_name, batch_number, kind, int(ordinal), labels)] \
        if tripped else []
    if st.world == 1:
        return local
    site = call_site()
    what = "trip details exchange"
    with exclusive(st, f"the {what}"):
        if not st.last.complete:
            return local
        if not _meet_everyone(st, what, site, _exchange_grace(None)).complete:
            return local
        hin_b, *_ = st.gather_buffers(_DETAIL_WORDS)
        name = b"" if module_name is None else _encode_name(module_name, _DETAIL_CAPACITY)
        joined = _encode_name("\0".join(labels), _DETAIL_CAPACITY - len(name)) \
            if labels and len(name) < _DETAIL_CAPACITY else b""
        kind_code = 0 if kind is None else schema.FAULT_KINDS.index(kind) + 1
        info = ((1 if tripped else 0) | (2 if module_name is not None else 0) | (kind_code << 2)
                | (len(name) << 8) | (len(joined) << 24))
        struct.pack_into("<qqqq", hin_b, 0, _DETAIL_MAGIC, int(batch_number), info,
                         int(ordinal))
        hin_b[_DETAIL_HEADER * 8:] = (name + joined).ljust(_DETAIL_CAPACITY, b"\0")
        try:
            out = timed_all_gather(st, _DETAIL_WORDS, "numguard trip details (all_gather)",
                                   site)
        except DistributedOperationException as exc:
            st.warn_once("details failed", (
                f"numguard.distributed: the {what} of process group {st.name!r} failed after "
                f"every rank came ({exc}); only this rank's own trip is reported."))
            return local
    result = []
    for r in range(st.world):
        base = r * _DETAIL_WORDS * 8
        magic, batch, info, ordinal_r = struct.unpack_from("<qqqq", out, base)
        if magic != _DETAIL_MAGIC or not info & 1:
            continue
        body = base + _DETAIL_HEADER * 8
        n_name, n_labels = (info >> 8) & 0xFFFF, (info >> 24) & 0xFFFF
        name_r = None
        if info & 2:
            name_r = bytes(out[body: body + n_name]).decode("utf-8", errors="replace")
        raw = bytes(out[body + n_name: body + n_name + n_labels]).decode("utf-8", "replace")
        code = (info >> 2) & 0x3F
        kind_r = schema.FAULT_KINDS[code - 1] if 0 < code <= len(schema.FAULT_KINDS) else None
        result.append(TripDetail(r, name_r, batch, kind_r, ordinal_r,
                                 raw.split("\0") if raw else ()))
    return result


__all__ = [
    "DistributedOperationException",
    "EXCHANGE_GRACE_S",
    "MAX_TORCH_TIMEOUT_S",
    "TripDetail",
    "call_site",
    "collective_device",
    "earliest_fault",
    "exchange_trip",
    "gather_trip_details",
    "is_initialized",
    "last_exchange",
    "rank",
    "release",
    "waited_s",
    "world_size",
]
