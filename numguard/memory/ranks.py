"""The batch finder's rank agreement: one fixed-size all_gather per round on a side group of
numguard's channel (NOTE: [finder group]), the failures ranks report, and the DDP hook that lets
a rank learn of a peer's failure before each gradient bucket (:func:`guard_ddp`, NOTE: [DDP
rounds])."""
from __future__ import annotations

import weakref
from datetime import timedelta

import torch

from .. import patches as _patches
from ..env import read as _read_env
from .oom import BatchSizeTimeoutError, PeerFailedError, _WHERE


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
    from ..distributed import channel

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
        # a process-wide hook: through the one list of numguard's patches, removed at end_try()
        self._observer = _patches.add_hook(
            torch.nn.modules.module.register_module_module_registration_hook, _observe_ddp,
            target=f"register_module_module_registration_hook (batch finder {id(self):#x})",
            why="guard a DistributedDataParallel made inside the batch-size search")
        self._stop = threading.Event()
        threading.Thread(target=self._watch, args=(self._stop,), daemon=True,
                         name="numguard-batch-watchdog").start()

    def end_try(self):
        if self._stop is not None:
            self._stop.set()
        observer, self._observer = getattr(self, "_observer", None), None
        if observer is not None:
            _patches.restore(observer)

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
