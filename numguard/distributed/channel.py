"""numguard's cross-rank channel: its own process group beside each of the user's, the per-group
state every cross-rank feature uses, and its release.

Everything numguard sends between ranks goes through here: the timed collectives
(numguard.distributed.collectives) run on :func:`group_state`'s ``comm``, the trip exchange
(numguard.distributed.trip_exchange) meets in its rendezvous, and the batch finder builds its
group with :func:`build_own_group`. Nothing else in numguard makes a process group.

- NOTE: [own process group]: a gloo group of numguard's own over the ranks of the user's group,
  built without ``new_group``;
- NOTE: [teardown]: released with the user's group and at interpreter exit;
- :func:`exclusive`: one numguard operation per group at a time in a process;
- NOTE: [timeout cap] and NOTE: [backend timeout]: the timeouts handed to torch.
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import os
import threading
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as _c10d

from .. import patches as _patches
from .. import process as _process
from ._env import dist_timeout
from .arrivals import Arrivals
from .errors import DistributedWarning
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


def build_own_group(rank_in_group: int, world: int, store, name: str, global_ranks):
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

    __slots__ = ("complete", "slot", "missing", "batches", "requests")

    def __init__(self, complete=True, slot=0, missing=(), batches=None, requests=None):
        self.complete = complete
        self.slot = slot
        self.missing = list(missing)
        self.batches = batches
        self.requests = requests   # each rank's rerun request word (None: not exchanged)

    def as_dict(self) -> dict:
        return {"complete": self.complete, "slot": self.slot, "missing": list(self.missing),
                "batches": None if self.batches is None else list(self.batches),
                "requests": None if self.requests is None else list(self.requests)}


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
                self.own_group = build_own_group(self.rank, self.world, self.store, self.name,
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

    @property
    def arrivals(self) -> Arrivals:
        """Each rank's check number in the store (NOTE: [arrivals] in collectives.py)."""
        return Arrivals(self.store, f"numguard/arrived/{self.name}", self.global_ranks)

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


def open_side_group(name: str, rank_in_group: int, world: int, store, released):
    """A gloo group of numguard's own over the default group's ranks, built like the per-group
    ``comm`` (NOTE: [own process group]) under the store prefix ``name`` (the same on every
    rank), for a user of the channel whose waits must not share ``comm`` (the batch finder's
    rank agreement). ``released(group)`` is called when the channel releases its state (the
    default group destroyed: ``group`` None; interpreter exit): it shuts the group down."""
    _install_lifecycle()
    if released not in _RELEASE_HOOKS:
        on_release(released)
    return build_own_group(rank_in_group, world, store, name, range(world))


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


__all__ = ["LastExchange", "MAX_TORCH_TIMEOUT_S", "build_own_group", "call_site", "collective_device",
           "exclusive", "group_state", "is_initialized", "on_release", "open_side_group", "rank", "release",
           "torch_timeout", "world_size"]
