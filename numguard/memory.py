"""numguard.memory: find the largest batch size that fits, on every rank together.

    @numguard.find_executable_batch_size(starting_batch_size=128)
    def train(batch_size, model_name):
        ...
    train("gpt2")          # batch size is passed by the decorator

A drop-in for Accelerate's ``find_executable_batch_size``: it passes Accelerate's own tests
(tests/test_memory_accelerate_parity.py): the same call styles, the same back-off (``int(size *
0.9)``; ``reduction=0.5`` halves), ``reduce_batch_size_fn()`` honoured, the same TypeError when
the caller passes the batch size, and the same RuntimeError when the size reaches zero (also for
``starting_batch_size=0``, at the call). A generator or coroutine function is refused at
decoration (its body would run outside the decorator, never retried). And:

- :func:`is_out_of_memory` knows ``torch.OutOfMemoryError`` by type on any device, Python's
  ``MemoryError``, and the known messages (CUDA/HIP/XPU, MPS, the CPU allocator, cuDNN
  NOT_SUPPORTED, HPU). Anything else propagates at once, untouched.
- The failed try's frames are cleared (they hold its activations through the traceback), garbage
  is collected and the device caches emptied before the next try.
- With torch.distributed initialized, the ranks exchange one tiny all_gather after every try on a
  dedicated gloo group whose timeout is ``NUMGUARD_DIST_TIMEOUT``: all ranks retry together with
  the smallest size any rank proposes, and return together. A DDP model given
  :func:`guard_ddp` (a communication hook) learns of a rank's failure before each gradient bucket
  instead of waiting in an all_reduce the failed rank will never join. A rank that does not
  answer within the timeout is named in a :class:`BatchSizeTimeoutError`, never a silent hang.
- ``minimum_batch_size``, ``reduction``, ``search="down"|"binary"``, ``margin`` and
  ``global_batch_size`` (the function is then called as ``f(batch_size, accumulation_steps, ...)``).
- The size found is remembered: the next call starts from it, and an out-of-memory error after a
  successful run is re-raised (set ``.retry_after_success = True`` on the decorated function, or
  call its ``.reset()``, to search again). ``.finder.tried`` lists the last call's sizes.

Build the model, optimizer and DDP wrapper inside the decorated function, as with Accelerate: a
failed try leaves DDP's reducer in the middle of a step. While the function runs, guard_ddp's hook
adds one small gloo all_gather per gradient bucket and a watchdog thread reads the store every
NUMGUARD_DIST_TIMEOUT/20 seconds (0.2 to 5). After a timeout the default process group is
destroyed or aborted on the ranks involved (see NOTE: [stuck ranks]): the job cannot continue.
"""
from __future__ import annotations

import functools
import gc
import inspect
import numbers
import traceback
import weakref
from datetime import timedelta

import torch

from .env import OptionError, read as _read_env

__all__ = ["BatchSizeNotFoundError", "BatchSizeTimeoutError", "PeerFailedError",
           "find_executable_batch_size", "guard_ddp", "is_out_of_memory", "oom_comm_hook"]

_WHERE = "numguard.find_executable_batch_size"

# Substrings of the messages the allocators raise with (RuntimeError or subclasses).
OOM_MESSAGES = (
    " out of memory.",                                 # CUDA, HIP, XPU
    "MPS backend out of memory",                       # Apple MPS
    "can't allocate memory",                           # DefaultCPUAllocator
    "CUDNN_STATUS_NOT_SUPPORTED",                      # cuDNN's answer to a too-large workspace
    "MODULE:PT_DEVMEM Allocation failed",              # Habana HPU
)


def is_out_of_memory(exc: BaseException) -> bool:
    """True when ``exc`` says a device (or the host) ran out of memory."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    text = exc.args[0] if len(exc.args) == 1 and isinstance(exc.args[0], str) else str(exc)
    return any(m in text for m in OOM_MESSAGES)


class BatchSizeNotFoundError(RuntimeError):
    """Even ``minimum_batch_size`` ran out of memory. ``.tried``: [(size, outcome)], ``.minimum``."""

    def __init__(self, tried, minimum, last_error):
        self.tried, self.minimum, self.last_error = list(tried), minimum, last_error
        # Accelerate's sentence first: scripts and tests match on it.
        head = ("No executable batch size found, reached zero." if minimum <= 1 else
                f"No executable batch size found, the next size would be below "
                f"minimum_batch_size={minimum}.")
        if self.tried:
            steps = ", ".join(f"{s} ({o})" for s, o in self.tried)
            body = (f"tried {steps}. Last out-of-memory error: {last_error}. Lower "
                    f"minimum_batch_size, free memory or shrink the model.")
        else:  # nothing to try: starting_batch_size (snapped to global_batch_size) is too small
            body = f"{last_error}; pass a larger starting_batch_size."
        super().__init__(f"{head} {_WHERE}: {body}")


class PeerFailedError(RuntimeError):
    """A rank failed in a way that ends the search on every rank.

    ``.rank`` (the rank that ran out of memory, else the first that failed), ``.out_of_memory``,
    ``.failures`` ({rank: message} of every rank that failed in that try)."""

    def __init__(self, rank, out_of_memory, failures):
        self.rank, self.out_of_memory, self.failures = rank, out_of_memory, dict(failures)
        what = "ran out of memory" if out_of_memory else "failed with an error that is not out of memory"
        others = "".join(f"\n  rank {r}: {m}" for r, m in sorted(self.failures.items()))
        super().__init__(f"{_WHERE}: rank {rank} {what}; failures in this try:{others}")


class BatchSizeTimeoutError(RuntimeError):
    """Ranks did not answer numguard's exchange within NUMGUARD_DIST_TIMEOUT."""

    def __init__(self, missing, failed, timeout_s, advice=""):
        self.missing, self.failed, self.timeout_s = sorted(missing), dict(failed), timeout_s
        who = "; ".join(f"rank {r}: {m}" for r, m in sorted(self.failed.items())) or "none known"
        super().__init__(f"{_WHERE}: ranks {self.missing} did not answer within "
                         f"{timeout_s:g} s (NUMGUARD_DIST_TIMEOUT), probably waiting in a collective "
                         f"of the training step that a failed rank left. Ranks that failed: {who}. "
                         f"{advice}".rstrip())


# ------------------------------------------------------------------------------------------------
# Memory


def _drop_frames(exc):
    """Clear the frames of exc's traceback (and of its cause/context chain): they hold the failed
    try's locals, activations included, for as long as the exception lives."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)  # skips frames still executing (ours)
        exc = exc.__cause__ or exc.__context__


def release_memory(*objects):
    """Collect garbage and return cached device blocks to the driver. Accelerate's call style:
    ``a, b = release_memory(a, b)`` returns one None per object, to rebind the caller's names."""
    objects = [None] * len(objects)   # drop this frame's references before collecting
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    for name in ("xpu", "mps", "npu", "hpu"):
        backend = getattr(torch, name, None)
        try:
            if backend is not None and backend.is_available():
                backend.empty_cache()
        except Exception:  # noqa: BLE001 - a backend without a cache must not stop the search
            pass
    return objects


def device_memory():
    """(in use, peak, total) bytes on the current CUDA device, or None off CUDA."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    dev = torch.cuda.current_device()
    return (torch.cuda.memory_allocated(dev), torch.cuda.max_memory_allocated(dev),
            torch.cuda.get_device_properties(dev).total_memory)


def _reset_peak():
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats()


def _gib(n):
    return f"{n / 2**30:.2f} GiB"


# ------------------------------------------------------------------------------------------------
# Cross-rank exchange

# Codes a rank reports in one exchange.
_RUNNING, _OK, _OOM, _MARGIN, _PEER, _ERROR, _START, _OOM_FINAL = 1, 2, 3, 4, 5, 6, 7, 8
_FAILURES = (_OOM, _MARGIN, _PEER, _ERROR, _OOM_FINAL)
_ENDS = (_ERROR, _OOM_FINAL)   # failures that end the search on every rank
_HEAD = 4                      # code, fail proposal, ok proposal, sequence number
_TEXT_BYTES = 256              # first bytes of the failure message, so peers can name it
_WORDS = _HEAD + _TEXT_BYTES // 8


# NOTE: [finder group] The exchange runs on a gloo group of its own, built the way numguard's
# channel builds its groups (numguard.distributed.channel.open_side_group, NOTE: [own process group]): a
# ProcessGroupGloo over a prefix of the default store, not torch.distributed.new_group (which
# is collective over the default group and renumbers the user's later groups). It is separate
# from the channel's shared group because a rank that failed waits here while another may be in
# a check of the channel (guard_collectives, a trip exchange): one group for both would pair
# records of different sizes. Released with the default group and at exit.
_GROUPS = {}                 # (default group, timeout) -> [side group, its name, tries so far]
_GROUPS_MADE = [0]           # groups built so far: part of the prefix, so keys never repeat


def _release_groups(group=None):
    """Shut the finder's groups down (numguard.distributed releases its state: the default group
    is destroyed, or the interpreter exits)."""
    if group is not None:
        return
    for pg, _, _ in list(_GROUPS.values()):
        try:
            pg.abort()  # a group a timeout left with a pending operation must not be waited for
        except Exception:  # noqa: BLE001 - releasing must never fail the user's teardown
            pass
    _GROUPS.clear()


def _finder_group(rank, world, store, default_name):
    from .distributed import channel

    _GROUPS_MADE[0] += 1
    name = f"memory/{default_name}/{_GROUPS_MADE[0]}"   # the same on every rank: store keys use it
    return channel.open_side_group(name, rank, world, store, released=_release_groups), name


class _Exchange:
    """One fixed-size all_gather per round on the finder's gloo group (NOTE: [finder group])
    with the numguard timeout."""

    def __init__(self):
        import torch.distributed as dist

        self.dist = dist
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.timeout_s = _read_env("NUMGUARD_DIST_TIMEOUT")
        try:  # held here so that it outlives a destroyed default group (see NOTE: [stuck ranks])
            self.store = dist.distributed_c10d._get_default_store()
        except Exception:  # noqa: BLE001 - naming the failed rank is best effort
            self.store = None
        default = dist.distributed_c10d._get_default_group()
        default_name = str(getattr(default, "group_name", "") or "default")
        key = (id(default), self.timeout_s)
        if key not in _GROUPS:
            if self.store is None:
                raise RuntimeError(f"{_WHERE}: the default process group has no store; the "
                                   f"ranks cannot agree on a batch size without one.")
            # Built lazily (no meeting): every rank connects in its first exchange.
            _GROUPS[key] = [*_finder_group(self.rank, self.world, self.store, default_name), 0]
        self.state = _GROUPS[key]
        self.group, self.group_name = self.state[0], self.state[1]
        self.seq = 0
        self.ddp_guarded = 0       # DDP constructions and forwards numguard watched in this try
        self.ddp_unwatched = []    # why a DDP model's gradient buckets were not watched
        self.peer_failure = None   # set by the DDP hook when a peer reported a failure
        self.in_exchange = False
        self.aborted = False       # the watchdog aborted the default group (see begin_try)
        self._stop = None

    def post_failure(self, code, text):
        store = self.store
        if store is not None:
            try:
                store.set(self._key(self.rank), f"{code}|{text[:_TEXT_BYTES]}")
            except Exception:  # noqa: BLE001
                pass

    def _key(self, rank, what="failed"):
        # Tries are counted per side group, in step on every rank, so keys never repeat.
        return f"numguard/memory/{self.group_name}/{self.state[2]}/{what}/{rank}"

    def gone(self):
        """Ranks that gave up waiting in this try (their default group is destroyed)."""
        return [r for r in range(self.world) if self._has(self._key(r, "gone"))]

    def _has(self, key):
        try:
            return self.store is not None and self.store.check([key])
        except Exception:  # noqa: BLE001
            return False

    def known_failures(self):
        """{rank: (code, message)} of the ranks that posted a failure in this try."""
        store, found = self.store, {}
        for r in range(self.world) if store is not None else ():
            key = self._key(r)
            try:
                if store.check([key]):
                    code, _, text = store.get(key).decode("utf-8", "replace").partition("|")
                    found[r] = (int(code), text)
            except Exception:  # noqa: BLE001
                pass
        return found

    def round(self, code, fail_prop=0, ok_prop=0, text=""):
        """Every rank's (code, fail proposal, ok proposal, text)."""
        self.seq += 1
        mine = torch.zeros(_WORDS, dtype=torch.int64)
        mine[:_HEAD] = torch.tensor([code, fail_prop, ok_prop, self.seq])
        raw = text.encode("utf-8", "replace")[:_TEXT_BYTES]
        if raw:
            mine.view(torch.uint8)[_HEAD * 8:_HEAD * 8 + len(raw)] = torch.frombuffer(
                bytearray(raw), dtype=torch.uint8)
        outs = [torch.empty(_WORDS, dtype=torch.int64) for _ in range(self.world)]
        self.in_exchange = True
        try:
            opts = self.dist.distributed_c10d.AllgatherOptions()
            opts.timeout = timedelta(seconds=self.timeout_s)
            self.group.allgather([outs], [mine], opts).wait()
        except RuntimeError as exc:  # the group's timeout expired: name who never came
            failures = {r: m for r, (_, m) in self.known_failures().items()}
            if code in _FAILURES:
                failures[self.rank] = text
            missing = [r for r in range(self.world) if r != self.rank and r not in failures]
            self._give_up()
            raise BatchSizeTimeoutError(missing, failures, self.timeout_s,
                                        self.advice()) from exc
        finally:
            self.in_exchange = False
        rows = []
        for t in outs:
            head = t[:_HEAD].tolist()
            body = bytes(t.view(torch.uint8)[_HEAD * 8:].tolist()).rstrip(b"\0")
            rows.append((head[0], head[1], head[2], body.decode("utf-8", "replace")))
        return rows

    # NOTE: [stuck ranks] A rank that fails while the others wait in a collective of the training
    # step (not a DDP bucket under guard_ddp) posts its failure in the store, then waits in the
    # exchange for up to the timeout. The others cannot be told while they wait in that
    # collective, so both sides act:
    # - a watchdog thread on every rank polls the store during a try; when a peer's failure has
    #   been posted for 9/10 of the timeout and this rank is still outside numguard's exchange,
    #   it aborts the default process group (NCCL then fails the stuck collective; gloo ignores
    #   abort, measured);
    # - the failed rank, when its exchange times out, marks itself gone in the store and destroys
    #   its default group: gloo closes the connections and the stuck collective on the others
    #   fails at once (measured: about 1 s after, instead of the group's 30-minute timeout).
    # The stuck rank then sees the peer gone, skips the exchange and raises PeerFailedError
    # naming the rank that ran out of memory. The job cannot go on (the group is gone), but every
    # rank fails within about NUMGUARD_DIST_TIMEOUT with an error that names the failed rank.
    def begin_try(self):
        import threading

        self.state[2] += 1
        self.aborted = False
        self.ddp_guarded, self.ddp_unwatched = 0, []
        self._observer = torch.nn.modules.module.register_module_module_registration_hook(
            _observe_ddp)
        self._stop = threading.Event()
        threading.Thread(target=self._watch, args=(self._stop,), daemon=True,
                         name="numguard-batch-watchdog").start()

    def end_try(self):
        if self._stop is not None:
            self._stop.set()
        observer, self._observer = getattr(self, "_observer", None), None
        if observer is not None:
            observer.remove()

    def _watch(self, stop):
        import time

        seen = None
        # Polls the store: rarely enough that thousands of ranks do not load it.
        while not stop.wait(min(max(0.2, self.timeout_s / 20), 5.0)):
            if self.in_exchange:
                seen = None
                continue
            if seen is None:
                if any(r != self.rank for r in self.known_failures()):
                    seen = time.monotonic()
            elif time.monotonic() - seen > 0.9 * self.timeout_s and not stop.is_set():
                try:
                    self.aborted = True
                    self.dist.distributed_c10d._get_default_group().abort()
                except Exception:  # noqa: BLE001 - a backend that cannot abort: the peer times out
                    pass
                return

    def _give_up(self):
        """After a timeout: destroy this rank's default group, so that a rank stuck in a
        collective with this one gets an error at once (gloo closes the connections) instead of
        waiting for the group's own timeout. The job cannot use the group after a timeout."""
        if self.store is not None:
            try:
                self.store.set(self._key(self.rank, "gone"), "1")
            except Exception:  # noqa: BLE001
                pass
        try:
            self.dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
        _release_groups()

    def advice(self):
        """What to do about ranks stuck in the training step, given what numguard watched."""
        if self.ddp_unwatched:
            return (f"numguard watched DDP's forward but not its gradient buckets: "
                    f"{'; '.join(self.ddp_unwatched)}.")
        if self.ddp_guarded:
            return ("numguard watched the DDP model's forward and gradient buckets; the others "
                    "were probably in a collective of the function's own (a torch.distributed "
                    "call, a barrier, a metric gather) that numguard cannot interrupt: do those "
                    "after the decorated function returns, or on every rank before the step "
                    "that runs out of memory.")
        return ("No DDP model was built while the function ran: build the DDP model (or "
                "accelerator.prepare it) inside the decorated function, so numguard watches "
                "it, or give a model built outside numguard.memory.guard_ddp(model).")

    def settle(self, code, fail_prop, ok_prop, text):
        """Rounds until no rank is still inside a DDP bucket (a rank there will see this rank's
        code, stop its step and come back with a final code)."""
        while True:
            rows = self.round(code, fail_prop, ok_prop, text)
            if not any(r[0] == _RUNNING for r in rows):
                return rows


_ACTIVE = None   # the exchange of the try in progress, read by the DDP hook


def _failures(rows):
    """{rank: (code, message)} of the ranks whose row reports a failure of their own."""
    return {r: (row[0], row[3]) for r, row in enumerate(rows)
            if row[0] in (_OOM, _MARGIN, _ERROR, _OOM_FINAL)}


def _peer_error(failures):
    """PeerFailedError naming the rank that ran out of memory (else the first that failed)."""
    oom = sorted(r for r, (c, _) in failures.items() if c in (_OOM, _OOM_FINAL, _MARGIN))
    first = oom[0] if oom else min(failures)
    return PeerFailedError(first, bool(oom), {r: m for r, (_, m) in failures.items()})


def _check_peers(ex, where):
    """One round while this rank is still running: raise (on this rank) when another rank
    reported a failure in this try, instead of entering a collective it will never join."""
    rows = ex.round(_RUNNING)
    if any(row[0] != _RUNNING for row in rows):
        ex.peer_failure = _peer_error(_failures(rows) or {
            r: (row[0], f"stopped {where}") for r, row in enumerate(rows) if row[0] != _RUNNING})
        raise ex.peer_failure


def oom_comm_hook(process_group, bucket):
    """DDP communication hook: before each gradient bucket's all_reduce, ask the other ranks
    whether one of them failed in this try; if so, stop this rank's backward instead of waiting
    in an all_reduce the failed rank will never join. Otherwise the same as DDP's default."""
    import torch.distributed as dist

    ex = _ACTIVE
    if ex is not None and ex.world > 1:
        _check_peers(ex, "before this gradient bucket")
    world = dist.get_world_size(process_group)
    tensor = bucket.buffer().div_(world)
    fut = dist.all_reduce(tensor, group=process_group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


class _WrappedCommHook:
    """numguard's round before each bucket, then the user's own communication hook."""

    def __init__(self, hook, state):
        self.hook, self.state = hook, state
        self.__qualname__ = f"numguard.memory.guard_ddp({getattr(hook, '__qualname__', hook)})"

    def __call__(self, _process_group, bucket):
        ex = _ACTIVE
        if ex is not None and ex.world > 1:
            _check_peers(ex, "before this gradient bucket")
        return self.hook(self.state, bucket)


class _DDPGuard:
    """What numguard added to one DDP model: a forward pre-hook (a round before DDP's forward
    collectives: bucket rebuild, buffer broadcast, join) and the communication hook (a round
    before each gradient bucket). See NOTE: [DDP rounds]."""

    def __init__(self, model):
        self.comm = False          # numguard's communication hook is registered
        self.refused = None        # why it could not be (the model has a hook of its own)
        self.pre = model.register_forward_pre_hook(_before_ddp_forward, prepend=True)

    def add_comm_hook(self, model, hook=None, state=None, explicit=False):
        if self.comm:
            return
        try:
            if hook is None:
                model.register_comm_hook(model.process_group, oom_comm_hook)
            else:
                model.register_comm_hook(None, _WrappedCommHook(hook, state))
            self.comm = True
        except RuntimeError as exc:   # DDP takes one hook: the user's (or a built-in) is in place
            if explicit:
                raise
            self.refused = (f"the model has a communication hook of its own ({exc}); pass it "
                            f"to numguard.memory.guard_ddp(model, comm_hook=hook, state=state) "
                            f"before the first forward")


_GUARDS = weakref.WeakKeyDictionary()   # DDP model -> _DDPGuard


# NOTE: [DDP rounds] A rank that fails in a try must not leave the others inside one of DDP's
# collectives: gloo cannot abort one and nccl only by tearing the group down. So every DDP
# model of a try gets numguard's rounds (one small all_gather on the finder's group) right
# before DDP communicates: at construction (before DDP's parameter check and broadcast), before
# a forward that rebuilds buckets, broadcasts buffers or joins (the next step of a rank whose
# peer ran out of memory in backward or in the optimizer step), and before each gradient bucket.
# A rank that sees a failure raises instead of entering the collective; every rank then meets
# in the exchange. Ranks run the same program, so the rounds pair like DDP's own collectives;
# a forward that communicates nothing (an evaluation under no_grad after the buckets are
# rebuilt, without buffers to broadcast) gets no round, so a rank-0-only evaluation is fine.
def _ddp_forward_communicates(ddp):
    try:
        return bool(ddp._check_sync_bufs_pre_fwd() or ddp._join_config.enable or (
            torch.is_grad_enabled() and not ddp._has_rebuilt_buckets))
    except AttributeError:   # another torch's DDP: assume it does
        return True


def _before_ddp_forward(ddp, _args):
    ex = _ACTIVE
    if ex is None or ex.world <= 1:
        return None
    guard = _GUARDS.get(ddp)
    ex.ddp_guarded += 1
    if guard is not None and not guard.comm and guard.refused is None:
        guard.add_comm_hook(ddp)   # the last moment before a backward; after the user's own
    if guard is not None and guard.refused and guard.refused not in ex.ddp_unwatched:
        ex.ddp_unwatched.append(guard.refused)
    if _ddp_forward_communicates(ddp):
        _check_peers(ex, "before DDP's forward")
    return None


def _observe_ddp(parent, name, child):
    """Module registration hook while a try runs: DDP's constructor assigns ``self.module``
    before its first collective; guard the new DDP model and meet the others there."""
    from torch.nn.parallel import DistributedDataParallel

    ex = _ACTIVE
    if ex is None or name != "module" or not isinstance(parent, DistributedDataParallel):
        return None
    if parent not in _GUARDS:
        _GUARDS[parent] = _DDPGuard(parent)
    ex.ddp_guarded += 1
    _check_peers(ex, "before DDP's construction")
    return None


def guard_ddp(model, comm_hook=None, state=None):
    """Watch a DistributedDataParallel model for a failed rank during the search (NOTE: [DDP
    rounds]); returns the model. A model built inside the decorated function is watched without
    it; call it for a model built outside. ``comm_hook``/``state``: your own communication hook,
    run after numguard's round (DDP takes one hook per model). Outside a search the hook is
    DDP's default all_reduce (or yours)."""
    guard = _GUARDS.get(model)
    if guard is None:
        guard = _GUARDS[model] = _DDPGuard(model)
    if comm_hook is not None and guard.comm:
        raise RuntimeError(f"{_WHERE}: guard_ddp: this model already has numguard's "
                           f"communication hook; pass comm_hook= in the first guard_ddp call, "
                           f"before the first forward.")
    guard.add_comm_hook(model, comm_hook, state, explicit=True)
    return model


# ------------------------------------------------------------------------------------------------
# Arguments


def _whole(name, value, minimum):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise OptionError(name, value, f"pass an int >= {minimum}", where=_WHERE)
    return int(value)


def _validate(starting, reduce_fn, minimum, reduction, search, margin, global_batch):
    # 0 is accepted here and raises at the call, as Accelerate does ("reached zero").
    starting = _whole("starting_batch_size", starting, 0)
    minimum = _whole("minimum_batch_size", minimum, 1)
    if starting and minimum > starting:
        raise OptionError("minimum_batch_size", minimum,
                          f"pass at most starting_batch_size={starting}", where=_WHERE)
    if reduce_fn is not None and not callable(reduce_fn):
        raise OptionError("reduce_batch_size_fn", reduce_fn,
                          "pass a function taking no argument that returns the next batch size, "
                          "or None", where=_WHERE)
    if isinstance(reduction, bool) or not isinstance(reduction, numbers.Real) \
            or not 0.0 < float(reduction) < 1.0:
        raise OptionError("reduction", reduction, "pass a number between 0 and 1 (exclusive), "
                                                  "e.g. 0.5 to halve", where=_WHERE)
    if search not in ("down", "binary"):
        raise OptionError("search", search, "use 'down' or 'binary'", where=_WHERE)
    if margin is not None and (isinstance(margin, bool) or not isinstance(margin, numbers.Real)
                               or not 0.0 <= float(margin) < 1.0):
        raise OptionError("margin", margin, "pass the fraction of device memory to keep free, "
                                            "from 0 up to (not including) 1, or None", where=_WHERE)
    if global_batch is not None:
        global_batch = _whole("global_batch_size", global_batch, 1)
    return starting, minimum, float(reduction), search, (None if margin is None else float(margin)), \
        global_batch


# ------------------------------------------------------------------------------------------------
# The search


class _Search:
    """Which size to try next. Deterministic from the agreed outcomes, so ranks stay in step."""

    def __init__(self, finder, per_rank_total):
        self.f = finder
        self.per_rank_total = per_rank_total   # global_batch_size // world, or None
        self.tried = []        # (size, outcome text)
        self.best = None       # largest size that ran
        self.lowest_fail = None

    def allowed(self, size):
        if self.per_rank_total is None:
            return True
        return size >= 1 and self.per_rank_total % size == 0

    def snap(self, size):
        """Largest allowed size <= size (0 when none)."""
        size = int(size)
        while size >= 1 and not self.allowed(size):
            size -= 1
        return max(size, 0)

    def _midpoint(self, low, high):
        """An allowed size strictly between low and high, near the middle, or None."""
        mid = self.snap((low + high) // 2)
        return mid if low < mid < high else None

    def fail_proposal(self, size, call_user_fn):
        """Next size after a failure: >0 a size, -1 below the minimum, -2 binary search done."""
        if self.f.search == "binary" and self.best is not None:
            mid = self._midpoint(self.best, size)
            return -2 if mid is None else mid
        if self.f.reduce_fn is not None:
            if not call_user_fn:
                return 0          # no opinion: the ranks that failed call the user's function
            nxt = self.f.reduce_fn()
        else:
            nxt = int(size * self.f.reduction)
        nxt = self.snap(min(int(nxt), size - 1))
        return nxt if nxt >= self.f.minimum else -1

    def ok_proposal(self, size):
        """Next size after a success: 0 when the search is over."""
        if self.f.search != "binary" or self.lowest_fail is None:
            return 0
        return self._midpoint(size, self.lowest_fail) or 0


def _agree_next(rows, failed):
    """The next size all ranks use (min of the proposals), or 0 done / -1 below minimum."""
    if failed:
        opinions = [r[1] for r in rows if r[1] != 0]
        if opinions and all(p == -2 for p in opinions):
            return 0
        if any(p == -1 for p in opinions):
            return -1
        return min((p for p in opinions if p > 0), default=-1)
    return min(r[2] for r in rows)


class _Finder:
    def __init__(self, function, starting, reduce_fn, minimum, reduction, search, margin,
                 global_batch):
        self.function = function
        self.reduce_fn = reduce_fn
        self.minimum, self.reduction, self.search = minimum, reduction, search
        self.margin, self.global_batch = margin, global_batch
        self.batch_size = starting           # where the next call starts (Accelerate's state)
        self.succeeded = False
        self.tried = []
        self.logger = None
        self.leading = 2 if global_batch is not None else 1
        self.options = {}   # the decorated function's attributes (retry_after_success)

    @property
    def retry_after_success(self):
        return bool(self.options.get("retry_after_success", False))

    @staticmethod
    def _tell_peers(ex, exc, oom):
        """A failure that ends the search on this rank: report it so the other ranks raise too
        instead of waiting. Returns a PeerFailedError to raise instead of ``exc`` when ``exc`` is
        a collective that broke because another rank ran out of memory (the watchdog aborted it,
        NOTE: [stuck ranks], or the group's own timeout expired); None to re-raise ``exc``."""
        text = f"{type(exc).__name__}: {exc}"
        code = _OOM_FINAL if oom else _ERROR
        ex.post_failure(code, text)
        gone = ex.gone()
        try:
            # A peer that gave up waits no more: an exchange would only time out.
            failures = ex.known_failures() if gone else _failures(ex.settle(code, 0, 0, text))
        except BatchSizeTimeoutError:
            failures = ex.known_failures()
        peer_oom = any(c in (_OOM, _OOM_FINAL) for r, (c, _) in failures.items() if r != ex.rank)
        broken = ex.aborted or gone or isinstance(exc, getattr(torch.distributed, "DistError", ()))
        if peer_oom and broken:
            failures[ex.rank] = (code, text)
            return _peer_error(failures)
        return None

    def _log(self, level, msg):
        if self.logger is None:
            from .distributed import get_logger
            self.logger = get_logger("numguard.memory")
        try:
            getattr(self.logger, level)(msg, main_process_only=True)
        except Exception:  # noqa: BLE001 - logging must never end the search
            pass

    def _check_call(self, args):
        params = list(inspect.signature(self.function).parameters.keys())
        if len(params) < len(args) + self.leading:
            name = getattr(self.function, "__name__", repr(self.function))
            arg_str = ", ".join(f"{a}={v}" for a, v in zip(params[self.leading:], args[self.leading:]))
            raise TypeError(f"Batch size was passed into `{name}` as the first argument when "
                            f"called. Remove this as the decorator already does so: "
                            f"`{name}({arg_str})`")

    def reset(self, starting_batch_size=None):
        """Forget the size found; the next call searches again (from starting_batch_size)."""
        if starting_batch_size is not None:
            self.batch_size = _whole("starting_batch_size", starting_batch_size, 0)
        self.succeeded = False

    def __call__(self, *args, **kwargs):
        global _ACTIVE
        self._check_call(args)
        dist = torch.distributed
        ex = _Exchange() if dist.is_available() and dist.is_initialized() \
            and dist.get_world_size() > 1 else None
        world = ex.world if ex is not None else 1
        per_rank = None
        if self.global_batch is not None:
            if self.global_batch % world:
                raise OptionError("global_batch_size", self.global_batch,
                                  f"pass a multiple of the world size ({world})", where=_WHERE)
            per_rank = self.global_batch // world
        search = _Search(self, per_rank)
        self.tried = search.tried   # this call's [(size, outcome)], for the caller to inspect
        size = search.snap(self.batch_size)
        if ex is not None:  # every rank starts from the smallest starting size
            size = min(r[1] for r in ex.round(_START, size))
        if size < self.minimum:
            start = f"starting_batch_size={self.batch_size}" + (
                f" (largest divisor of {per_rank} per rank: {size})" if per_rank is not None else "")
            raise BatchSizeNotFoundError([], self.minimum, f"{start} leaves nothing to try")
        best_result, last_error = None, None
        release_memory()
        while True:
            _reset_peak()
            code, text = _OK, ""
            call = (size, per_rank // size) if per_rank is not None else (size,)
            if ex is not None:
                ex.begin_try()
            _ACTIVE = ex
            try:
                result = self.function(*call, *args, **kwargs)
            except Exception as exc:
                _ACTIVE = None
                peer = ex.peer_failure if ex is not None else None
                oom = is_out_of_memory(exc)
                if peer is None and (not oom or (self.succeeded and not self.retry_after_success)):
                    instead = self._tell_peers(ex, exc, oom) if ex is not None else None
                    if instead is not None:
                        raise instead from exc
                    raise
                code = _PEER if peer is not None else _OOM
                text = str(peer) if peer is not None else f"{type(exc).__name__}: {exc}"
                if ex is not None:
                    ex.peer_failure = None
                    if code == _OOM:
                        ex.post_failure(code, text)
                _drop_frames(exc)
                last_error = exc
                del exc
            finally:
                _ACTIVE = None
                if ex is not None:
                    ex.end_try()
            mem = device_memory()
            if code == _OK and self.margin is not None and mem is not None \
                    and mem[1] > (1.0 - self.margin) * mem[2]:
                code, text = _MARGIN, (f"peak {_gib(mem[1])} leaves less than margin="
                                       f"{self.margin:g} of {_gib(mem[2])} free")
            if code != _OK:
                result = None
                release_memory()
            fail_prop = search.fail_proposal(size, call_user_fn=code in (_OOM, _MARGIN))
            if code == _MARGIN and fail_prop <= 0:  # nothing smaller to go to: keep this size
                code, fail_prop = _OK, 0
                self._log("warning", f"batch size {size} leaves less memory free than margin="
                                     f"{self.margin:g} but no smaller size is allowed; using it")
            ok_prop = search.ok_proposal(size) if code == _OK else 0
            rows = ex.settle(code, fail_prop, ok_prop, text) if ex is not None \
                else [(code, fail_prop, ok_prop, text)]
            if any(row[0] in _ENDS for row in rows):
                raise _peer_error(_failures(rows)) from last_error
            failed_ranks = [r for r, row in enumerate(rows) if row[0] in (_OOM, _MARGIN)]
            failed = any(row[0] in _FAILURES for row in rows)
            outcome = "ok" if not failed else (
                ("out of memory" if any(rows[r][0] == _OOM for r in failed_ranks) else "over margin")
                + (f" on rank {', '.join(map(str, failed_ranks))}" if ex is not None else ""))
            search.tried.append((size, outcome))
            if failed:
                search.lowest_fail = size if search.lowest_fail is None else min(search.lowest_fail, size)
                last_text = next((rows[r][3] for r in failed_ranks), text)
                if not last_text and last_error is not None:
                    last_text = str(last_error)
            else:
                search.best = size
                best_result = result
            nxt = _agree_next(rows, failed)
            if failed:  # one line per try: info (0.9 steps make many); the summary warns
                self._log("info", self._retry_line(size, failed_ranks, ex, mem, nxt, last_text))
            result = None
            if nxt == -1:
                raise BatchSizeNotFoundError(search.tried, self.minimum, last_text) from last_error
            if nxt == 0:
                break
            size = nxt
        self.batch_size, self.succeeded = search.best, True
        tried = ", ".join(f"{s} ({o})" for s, o in search.tried)
        accum = f" x {per_rank // search.best} accumulation steps x {world} ranks = " \
                f"{self.global_batch}" if per_rank is not None else ""
        # Shown by default when the size differs from the one asked for.
        level = "warning" if len(search.tried) > 1 else "info"
        self._log(level, f"batch size {search.best}{accum} fits; tried {tried}")
        return best_result

    @staticmethod
    def _retry_line(size, ranks, ex, mem, nxt, text):
        where = f" on rank {', '.join(map(str, ranks))}" if ex is not None and ranks else ""
        memory = f" (CUDA: {_gib(mem[0])} in use, peak {_gib(mem[1])})" if mem is not None else ""
        then = f"retrying with {nxt}" if nxt > 0 else "no smaller size left" if nxt == -1 \
            else "keeping the largest size that ran"
        return f"batch size {size} failed{where}{memory}: {text.splitlines()[0] if text else ''}; {then}"


def _check_retryable(function):
    """A generator or coroutine function returns at once, before any of its body runs: its
    out-of-memory errors come later, outside the decorator, and would never be retried."""
    kind = ("an async generator function" if inspect.isasyncgenfunction(function) else
            "a coroutine function (async def)" if inspect.iscoroutinefunction(function) else
            "a generator function" if inspect.isgeneratorfunction(function) else None)
    if kind is None:
        return
    name = getattr(function, "__qualname__", None) or repr(function)
    raise TypeError(
        f"{_WHERE} cannot retry `{name}`: it is {kind}, so calling it only creates a "
        f"{'coroutine' if 'coroutine' in kind else 'generator'} and its out-of-memory errors "
        f"happen later, while it is iterated or awaited, outside the decorator. Decorate a plain "
        f"function that runs the whole training (collect what the generator yields into a list "
        f"and return it; run async code with asyncio.run inside a plain function).")


def find_executable_batch_size(function=None, starting_batch_size=128, reduce_batch_size_fn=None,
                               *, minimum_batch_size=1, reduction=0.9, search="down", margin=None,
                               global_batch_size=None):
    """Call ``function(batch_size, *args, **kwargs)`` with smaller batch sizes until it runs
    without running out of memory (Accelerate-compatible decorator, see the module docstring).

    Args:
        function: the function to wrap; None to use as ``@find_executable_batch_size(...)``.
        starting_batch_size: the first size tried (and the largest, even with ``search="binary"``).
        reduce_batch_size_fn: a function of no argument returning the next size after a failure
            (called on the ranks that failed; every rank uses the smallest proposed).
        minimum_batch_size: going below it raises :class:`BatchSizeNotFoundError`.
        reduction: the factor a size is multiplied by after a failure (``int(size *
            reduction)``): 0.9 by default, as Accelerate 1.x; 0.5 halves (Accelerate's guide).
        search: ``"down"`` stops at the first size that runs; ``"binary"`` then searches between
            it and the smallest failed size for the largest that runs.
        margin: keep this fraction of device memory free (CUDA; peak over total), by retrying one
            step smaller when a run's peak leaves less.
        global_batch_size: keep ``batch_size * gradient_accumulation_steps * world_size`` equal to
            it; the function is then called as ``function(batch_size, accumulation_steps, ...)``.
    """
    options = _validate(starting_batch_size, reduce_batch_size_fn, minimum_batch_size, reduction,
                        search, margin, global_batch_size)
    if function is None:
        return functools.partial(find_executable_batch_size, starting_batch_size=starting_batch_size,
                                 reduce_batch_size_fn=reduce_batch_size_fn,
                                 minimum_batch_size=minimum_batch_size, reduction=reduction,
                                 search=search, margin=margin, global_batch_size=global_batch_size)
    _check_retryable(function)
    finder = _Finder(function, options[0], reduce_batch_size_fn, *options[1:])

    @functools.wraps(function)
    def decorator(*args, **kwargs):
        return finder(*args, **kwargs)

    decorator.finder = finder
    decorator.reset = finder.reset
    decorator.retry_after_success = False
    finder.options = decorator.__dict__   # read on each call: the user may set it any time
    return decorator
