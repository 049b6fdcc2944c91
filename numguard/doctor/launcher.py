"""Rendezvous, process group and timed steps for ``numguard doctor``: nothing here waits forever.

Start-up: every rank connects to the TCPStore at MASTER_ADDR:MASTER_PORT (rank 0 hosts it unless
torchrun's agent already does) and posts its ``arrived`` mark; rank 0 waits up to ``--timeout``
for every rank's, then publishes the list of ranks that never joined. Only when that list is empty
is a process group created, on the same store, so ``init_process_group`` never waits for a missing
rank. The marks are numguard.distributed.arrivals', the bookkeeping numguard's channel keeps its
check numbers with: this meeting must come before any process group, so the channel's own group
cannot hold it.

Steps: the collectives the doctor examines (the checks, the bandwidth table) run on the job's own
process group, as the user's would: each is issued with ``async_op=True`` and waited for with a
deadline. What the ranks tell each other (facts, results, the final barrier) goes through numguard's
channel (its own gloo group and timed collectives), like every other cross-rank message numguard
sends. A step that runs out of time raises :class:`StepTimeout`, one that fails (a peer died, a
backend error) :class:`CollectiveError`. Both carry a census naming the ranks that died, never
reached the step, stopped making progress inside it, saw it fail, or wait for the others: each rank
marks when it enters a step, finishes it, times out or fails in it, and a heartbeat thread bumps
a counter of its own, so a rank whose counter stands still is dead, not slow.
"""
from __future__ import annotations

import atexit
import datetime
import json
import os
import queue
import re
import socket
import sys
import threading
import time

import torch
import torch.distributed as dist

from ..distributed import channel, collectives
from ..distributed.arrivals import Arrivals
from ..distributed.errors import DistributedTimeoutError

__all__ = ["CENSUS", "CollectiveError", "Context", "DoctorError", "SettingError", "StepTimeout",
           "all_gather_single", "describe_census", "gather_json", "parse_sizes",
           "reduce_scatter_single", "start"]

_KEY_PREFIX = "numguard_doctor"
_STORE_GRACE_S = 2.0
HEARTBEAT_S = 0.5
# A rank whose heartbeat did not move for this long is dead (or frozen whole): six beats, so a
# live rank on a loaded machine, whose thread runs late, is not taken for dead.
LIFE_WINDOW_S = 3.0


class DoctorError(RuntimeError):
    """The doctor could not run (bad setting, unreachable store); the message says what to do.

    ``status`` is the exit status it leads to: 2 for a bad option or variable, else 1.
    """

    status = 1


class SettingError(DoctorError):
    """An option or launcher variable (RANK, WORLD_SIZE, MASTER_PORT, ...) has a bad value."""

    status = 2


# Where the other ranks are when a step fails on this one (the census), in the order a message
# names them. Each value is a sorted list of ranks, or a string when the store could not say.
CENSUS = (("died", "ranks that died"),
          ("not_started", "ranks that never reached it"),
          ("stuck", "ranks inside it that stopped making progress"),
          ("failed", "ranks that saw it fail"),
          ("waiting", "ranks waiting for them"))


def describe_census(census):
    """``"ranks that died: [1]; ranks waiting for them: [0, 2]"``: the groups that are not empty."""
    parts = [f"{label}: {census[key]}" for key, label in CENSUS if census.get(key)]
    return "; ".join(parts) or "no other rank reported where it is"


class _StepFailure(DoctorError):
    """A step that did not end well on this rank; ``census`` says where every rank is."""

    def __init__(self, step, message, census):
        self.step, self.census = step, census
        super().__init__(f"{message}; {describe_census(census)}")


class CollectiveError(_StepFailure):
    """A step failed on this rank (a collective raised, e.g. a peer died; the store went away)."""


class StepTimeout(_StepFailure):
    """A step did not finish on this rank within its timeout.

    Census: ``stuck``: ranks inside the step that are not waiting for anyone (the likely cause:
    hung in their own work or in issuing a collective); ``waiting``: ranks whose part is issued
    and that wait for the others; ``not_started``: ranks that never reached the step; ``died``:
    ranks whose heartbeat stopped; ``failed``: ranks on which the step raised.
    """

    def __init__(self, step, timeout, census):
        self.timeout = timeout
        super().__init__(step, f"step {step!r} did not finish within {timeout:g} s", census)


_UNITS = {"": 1, "B": 1, "K": 1024, "KB": 1024, "KIB": 1024, "M": 1024 ** 2, "MB": 1024 ** 2,
          "MIB": 1024 ** 2, "G": 1024 ** 3, "GB": 1024 ** 3, "GIB": 1024 ** 3}


def parse_sizes(texts):
    """``["1K", "4M", "1024"]`` -> byte counts (binary units); a clear error names a bad entry."""
    sizes = []
    for text in texts:
        match = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", str(text))
        unit = match.group(2).upper() if match else None
        if match is None or unit not in _UNITS or int(match.group(1)) == 0:
            raise SettingError(f"--sizes: {text!r} is not a size; use a positive whole number of "
                              "bytes with an optional unit K, M or G (powers of 1024), e.g. 4M")
        sizes.append(int(match.group(1)) * _UNITS[unit])
    return sorted(set(sizes))


def _int_env(name, default=None):
    text = os.environ.get(name)
    if text is None or text == "":
        if default is None:
            raise SettingError(f"{name} is not set; launch with torchrun, or set RANK, WORLD_SIZE, "
                              "MASTER_ADDR and MASTER_PORT for every rank")
        return default
    try:
        return int(text)
    except ValueError:
        raise SettingError(f"{name}={text!r} is not a whole number") from None


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Context:
    """One rank's view of the job: identity, store, process group and step bookkeeping."""

    def __init__(self, timeout):
        single = not os.environ.get("WORLD_SIZE")
        self.world = _int_env("WORLD_SIZE", 1)
        self.rank = _int_env("RANK", 0)
        self.local_rank = _int_env("LOCAL_RANK", self.rank if single else 0)
        if self.world < 1 or not 0 <= self.rank < self.world:
            raise SettingError(f"RANK={self.rank} is not in 0..WORLD_SIZE-1 "
                              f"(WORLD_SIZE={self.world})")
        self.addr = os.environ.get("MASTER_ADDR") or "127.0.0.1"
        self.port = _int_env("MASTER_PORT", _free_port() if single else None)
        if not 0 < self.port < 65536:
            raise SettingError(f"MASTER_PORT={self.port} is not a TCP port (1..65535)")
        self.host = socket.gethostname()
        self.timeout = timeout
        # torchrun restarts reuse the agent's store: keys of an earlier attempt must not count.
        self.prefix = f"{_KEY_PREFIX}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        self.store = None
        self.marks = None  # every rank's marks in the store (numguard.distributed.arrivals)
        self._agent_store = False
        self.cuda = torch.cuda.is_available()
        self.device = torch.device("cpu")
        self.backend = "gloo"
        self._step = 0
        self._waiter = None
        self.arrived = {}  # rank -> host of the ranks that joined; rank 0 reads it in connect()

    # -- start-up ------------------------------------------------------------------------------
    def connect(self, refusal=None):
        """Connect to the store and wait for every rank; returns the ranks that never joined.

        ``refusal`` (rank 0 only): a usage error found before the run (an unwritable --json
        path). Rank 0 publishes it at once instead of a verdict on who arrived, every rank
        leaves with it as a :class:`SettingError`, and nothing is run.
        """
        # Under torchrun the agent hosts the store on MASTER_PORT; every worker is a client.
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        is_master = self.rank == 0 and not agent
        self.store = self._open_store(is_master)
        self.marks = marks = Arrivals(self.store, self.prefix, range(self.world))
        self._agent_store = agent
        self._heartbeat = _Heartbeat(self)
        marks.post("arrived", self.rank, self.host)
        if self.rank == 0:
            if refusal:
                verdict = {"refused": refusal}
            else:
                verdict = {"missing": marks.wait("arrived", range(self.world), self.timeout)}
            marks.post("verdict", 0, json.dumps(verdict))
            self.arrived = {r: marks.value("arrived", r).decode() for r in marks.posted("arrived")}
        else:
            # Rank 0 publishes its verdict at most `timeout` after it arrived; allow as long again.
            if marks.wait("verdict", [0], 2 * self.timeout + 5):
                raise DoctorError(f"rank {self.rank}: rank 0 published no start-up verdict within "
                                  f"{2 * self.timeout + 5:g} s; it may have died after it started")
            verdict = json.loads(marks.value("verdict", 0))
            marks.post("ack", self.rank)
        missing = verdict.get("missing", [])
        if (missing or "refused" in verdict) and self.rank == 0:
            # The others leave on this verdict too; keep the store (this process) up until they
            # have read it, or they would report an unreachable store instead of the verdict.
            marks.wait("ack", [r for r in range(1, self.world) if r not in missing], self.timeout)
        if "refused" in verdict:
            raise SettingError(verdict["refused"] if self.rank == 0 else
                               f"rank 0 refused to start: {verdict['refused']}")
        return missing

    def _open_store(self, is_master):
        """The rendezvous store, or a :class:`DoctorError` naming the address within the timeout.

        ``TCPStore(...)`` retries a refused connection for ``timeout`` by itself, but a program
        that accepts the connection and never answers (a stale server, an HTTP server on the
        same port) blocks it forever: the call runs in a thread we give up on at the deadline.
        """
        where = f"{self.addr}:{self.port}"
        call = _Deadline(lambda: dist.TCPStore(
            self.addr, self.port, self.world, is_master,
            timeout=datetime.timedelta(seconds=self.timeout), wait_for_workers=False),
            _STORE_THREAD)
        # The store's own retries end at `timeout`; the grace lets its clearer error come first.
        if not call.wait(self.timeout + _STORE_GRACE_S):
            if _accepts_connections(self.addr, self.port):
                raise DoctorError(
                    f"rank {self.rank} on {self.host}: {where} accepts connections but did not "
                    f"answer as a torch.distributed store within {self.timeout:g} s: another "
                    f"program listens on MASTER_PORT={self.port} (a stale job, a web server; see "
                    f"`ss -ltnp 'sport = :{self.port}'` on {self.addr}). Stop it, or start every "
                    "rank with a free MASTER_PORT")
            # Nothing listens there: the same answer as the store's own error, whichever comes first.
            raise DoctorError(
                f"rank {self.rank} on {self.host} could not reach the rendezvous store at "
                f"{where} within {self.timeout:g} s: rank 0 never started it, gave up on this rank "
                "after its own start-up timeout, or MASTER_ADDR/MASTER_PORT differ from rank 0's "
                "(or give a longer --timeout)")
        if call.error is None:
            return call.result
        exc = call.error
        if is_master:
            raise DoctorError(f"rank 0 could not host the rendezvous store on {where} "
                              f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}); "
                              f"another program may listen there (`ss -ltnp 'sport = "
                              f":{self.port}'`): pick a free MASTER_PORT") from None
        raise DoctorError(
            f"rank {self.rank} on {self.host} could not reach the rendezvous store at "
            f"{where} within {self.timeout:g} s ({type(exc).__name__}): rank 0 "
            "never started it, gave up on this rank after its own start-up timeout, or "
            "MASTER_ADDR/MASTER_PORT differ from rank 0's") from None

    def init_process_group(self):
        """A process group on the checked store: gloo on CPU, NCCL for CUDA tensors."""
        if self.cuda:
            count = torch.cuda.device_count()
            self.device = torch.device("cuda", self.local_rank % count)
            torch.cuda.set_device(self.device)
            # CPU tensors (facts, timings) go through gloo, so a broken NCCL cannot hide them.
            self.backend = "cpu:gloo,cuda:nccl"
        store = dist.PrefixStore(self.prefix + "/pg", self.store)

        def init():
            if self.cuda:
                torch.cuda.set_device(self.device)  # the current device is per thread
            dist.init_process_group(self.backend, store=store,
                                    rank=self.rank, world_size=self.world,
                                    # Longer than a step's timeout: the step names the late ranks
                                    # before NCCL's watchdog would abort the process without a word.
                                    timeout=datetime.timedelta(seconds=2 * self.timeout + 10))
        # Gloo connects every pair here and waits for a rank that died after it arrived.
        name = "start the process group"
        tag = self._enter()
        call = _Deadline(init, _INIT_THREAD)
        if not call.wait(self.timeout):
            raise self._timed_out(name, tag, self.timeout)
        if call.error is not None:
            raise self._failed(name, tag, call.error)
        self._mark("done", tag)

    # -- steps ---------------------------------------------------------------------------------
    def step(self, name, issue, timeout=None):
        """Run ``issue()`` (returns async works) and wait for them; :class:`StepTimeout` if late."""
        timeout = self.timeout if timeout is None else timeout
        tag = self._enter(name)
        deadline = time.monotonic() + timeout
        works = issue()
        self.wait(works, deadline, name, tag, timeout)
        self._mark("done", tag, name)
        return works

    def exchange(self, name, data):
        """Every rank's ``data`` (bytes), by rank, through numguard's channel: a step like the
        others (marked, timed, with the census when it fails)."""
        tag = self._enter(name)
        try:
            rows = collectives.timed_all_gather_bytes(channel.group_state(), data, name, "numguard doctor",
                                                      timeout=self.timeout)
        except DistributedTimeoutError as exc:
            if exc.backend_error is None:
                raise self._timed_out(name, tag, self.timeout) from None
            raise self._failed(name, tag, exc.backend_error) from None
        except RuntimeError as exc:
            raise self._failed(name, tag, exc) from None
        self._mark("done", tag, name)
        return rows

    def _enter(self, name=None):
        self._step += 1
        tag = f"{self._step}"
        self._mark("entered", tag, name)
        return tag

    def _mark(self, kind, tag, name=None):
        try:
            self.marks.post(kind, self.rank, tag=tag)
        except Exception as exc:  # noqa: BLE001 - torch raises several types for a lost store
            raise CollectiveError(name or f"step {tag}", f"step {name!r} on rank {self.rank}: "
                                  f"the rendezvous store is unreachable ({type(exc).__name__})",
                                  self._store_lost()) from None

    def wait(self, works, deadline, name, tag=None, timeout=None):
        """Wait for async works until ``deadline``; past it raise :class:`StepTimeout`.

        Returns the ``time.perf_counter()`` at which the last work completed.
        """
        works = [w for w in (works if isinstance(works, (list, tuple)) else [works])
                 if w is not None]
        timeout = self.timeout if timeout is None else timeout
        tag = tag or f"{self._step}"
        if time.monotonic() > deadline:
            # This rank itself took the whole step's time before its part was even issued: the
            # others have given up on it (and rank 0's store may be gone), so ask nobody.
            raise StepTimeout(name, timeout, {"stuck": [self.rank],
                                              "waiting": "unknown (they gave up)"})
        if self._waiter is None:
            self._waiter = _Waiter(self.device)
        job = self._waiter.submit(works)
        if not job.done.wait(max(0.0, deadline - time.monotonic())):
            raise self._timed_out(name, tag, timeout)
        if job.error is not None:
            raise self._failed(name, tag, job.error) from job.error
        return job.finished

    def _timed_out(self, name, tag, timeout):
        """A :class:`StepTimeout` with the census (a rank that waits says so; the rest are stuck)."""
        return StepTimeout(name, timeout, self.census(tag, "waiting"))

    def _failed(self, name, tag, error):
        """A :class:`CollectiveError` for ``error`` raised in step ``name``, with the census."""
        first = (str(error).splitlines() or [type(error).__name__])[0] or type(error).__name__
        # Gloo appends a paragraph of generic advice to "Connection reset by peer"; the census
        # below says more.
        first = first.split(" This is typically caused by")[0][:300].rstrip(". ")
        return CollectiveError(name, f"step {name!r} failed on rank {self.rank} ({first})",
                               self.census(tag, "failed"))

    def census(self, tag=None, mark=None):
        """Where every rank is in step ``tag`` (default: the current one), after this rank marks
        itself ``mark`` ("waiting" or "failed") there.

        Takes :data:`LIFE_WINDOW_S`: every rank's heartbeat is read, then read again, and the
        other ranks that fail or time out in the same step get to mark themselves meanwhile.
        """
        tag = tag or f"{self._step}"
        try:
            if mark:
                self.marks.post(mark, self.rank, tag=tag)
            before = self._beats()
            time.sleep(LIFE_WINDOW_S)
            after = self._beats()
            has = {kind: set(self.marks.posted(kind, tag)) for kind in ("entered", "waiting", "failed", "done")}
        except Exception:  # noqa: BLE001 - the store host (rank 0) may be gone
            return self._store_lost()
        alive = {r for r in range(self.world) if after[r] > before[r]} | {self.rank}
        reported = has["waiting"] | has["failed"] | has["done"]
        return {"died": sorted(set(range(self.world)) - alive),
                "not_started": sorted(alive - has["entered"]),
                "stuck": sorted((alive & has["entered"]) - reported),
                "failed": sorted(alive & has["failed"]),
                "waiting": sorted(alive & has["waiting"] - has["failed"])}

    def _beats(self):
        # add(key, 0) reads a counter in one round trip (and is 0 for a rank that never beat).
        return [self.store.add(self.marks.key("beat", r), 0) for r in range(self.world)]

    def _store_lost(self):
        """The census when the store cannot be reached: its host is gone."""
        if self._agent_store:
            return {"died": "unknown (torchrun's agent, which hosts the store, is unreachable)"}
        # Rank 0 hosts the store and, on a failure, keeps it up until every live rank has its
        # census (see linger()), so a store that went away means rank 0 died.
        return {"died": [0] if self.rank else "unknown"}

    def leave(self):
        """Before leaving on a failure: say so, and on rank 0 keep the store up for the others.

        Rank 0 hosts the store: leaving at once would make the ranks still taking their census
        see it vanish and name rank 0 as dead. It waits (bounded) until every rank has left or
        stopped beating.
        """
        try:
            self.marks.post("left", self.rank)
            if self.rank != 0 or self._agent_store:
                return
            deadline = time.monotonic() + self.timeout + 2 * LIFE_WINDOW_S
            pending = set(range(1, self.world))
            beats, beat_at = self._beats(), time.monotonic()
            while pending and time.monotonic() < deadline:
                pending -= set(self.marks.posted("left", ranks=pending))
                if time.monotonic() - beat_at > LIFE_WINDOW_S:
                    now = self._beats()
                    pending = {r for r in pending if now[r] > beats[r]}  # the dead never leave
                    beats, beat_at = now, time.monotonic()
                time.sleep(0.1)
        except Exception:  # noqa: BLE001 - leaving anyway
            pass


_STORE_THREAD = "numguard-doctor-store"
_INIT_THREAD = "numguard-doctor-init"


def end_if_threads_abandoned(status):
    """A doctor that gave up at a deadline (a store that never answered, a rank that never came)
    leaves its waiting threads inside torch's C++ code, and an interpreter that ends around them
    aborts (SIGABRT) instead of exiting with the doctor's status: end the process here."""
    if any(t.is_alive() and t.name in (_STORE_THREAD, _INIT_THREAD) for t in threading.enumerate()):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


class _Deadline:
    """Run ``fn()`` in a daemon thread that the caller may abandon at a deadline."""

    def __init__(self, fn, name):
        self.result = self.error = None
        self._done = threading.Event()

        def body():
            try:
                self.result = fn()
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                self.error = exc
            self._done.set()
        threading.Thread(target=body, name=name, daemon=True).start()

    def wait(self, seconds):
        """True when ``fn`` returned or raised within ``seconds``."""
        return self._done.wait(max(0.0, seconds))


def _accepts_connections(addr, port, seconds=2.0):
    """Whether something at ``addr:port`` accepts a TCP connection (it says nothing of what)."""
    try:
        with socket.create_connection((addr, port), timeout=seconds):
            return True
    except OSError:
        return False


class _Heartbeat:
    """Bumps this rank's counter in the store every :data:`HEARTBEAT_S` from a daemon thread.

    It has a store connection of its own: a ``get`` that blocks the main one (gloo's rendezvous
    waits in one) holds that connection's lock, and the heartbeat must not stop with it.
    """

    def __init__(self, ctx):
        key = ctx.marks.key("beat", ctx.rank)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(ctx.addr, ctx.port, ctx.world, ctx.timeout, key),
                                        name="numguard-doctor-heartbeat", daemon=True)
        self._thread.start()
        # A thread still inside the store's C++ code when the interpreter ends aborts the process
        # ("terminate called without an active exception"): stop it first.
        atexit.register(self.stop)

    def stop(self):
        self._stop.set()
        self._thread.join(timeout=HEARTBEAT_S + 2)

    def _loop(self, addr, port, world, timeout, key):
        store = None
        try:
            store = dist.TCPStore(addr, port, world, False, wait_for_workers=False,
                                  timeout=datetime.timedelta(seconds=timeout))
            while not self._stop.is_set():
                store.add(key, 1)
                self._stop.wait(HEARTBEAT_S)
        except Exception:  # noqa: BLE001 - the store's host ended or died: nobody to tell
            pass
        finally:
            del store


class _Job:
    def __init__(self, works):
        self.works, self.done, self.error, self.finished = works, threading.Event(), None, None


class _Waiter:
    """One daemon thread that calls ``work.wait()`` so the caller can give up at a deadline.

    ``Work.is_completed()`` cannot be polled instead: gloo's reduce_scatter returns a work that
    never reports completion. A waiter stuck on a hung collective is abandoned with the process.
    """

    def __init__(self, device):
        self.device = device
        self.jobs = queue.SimpleQueue()
        threading.Thread(target=self._loop, name="numguard-doctor-waiter", daemon=True).start()

    def submit(self, works):
        job = _Job(works)
        self.jobs.put(job)
        return job

    def _loop(self):
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        while True:
            job = self.jobs.get()
            try:
                for w in job.works:
                    w.wait()
                if self.device.type == "cuda":
                    # NCCL's wait() only orders this thread's stream after the collective.
                    torch.cuda.current_stream(self.device).synchronize()
            except Exception as exc:  # noqa: BLE001 - handed to the caller to raise
                job.error = exc
            job.finished = time.perf_counter()
            job.done.set()


def start(timeout):
    """A :class:`Context` for this process (reads RANK, WORLD_SIZE, ... from the environment)."""
    return Context(timeout)


def all_gather_single():
    """``all_gather_single`` where torch has it, else ``all_gather_into_tensor``."""
    # torch 2.13 renamed all_gather_into_tensor; older versions only have the old name.
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def reduce_scatter_single():
    """``reduce_scatter_single`` where torch has it, else ``reduce_scatter_tensor``."""
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def gather_json(ctx, obj, name):
    """Every rank's ``obj`` (JSON-able) on every rank, as a list indexed by rank (through
    numguard's channel: gloo on CPU, so on CUDA jobs it still works when NCCL does not)."""
    return [json.loads(row.decode()) for row in ctx.exchange(name, json.dumps(obj).encode())]
