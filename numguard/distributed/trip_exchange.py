"""The trip exchange: at the end of a checked batch every rank learns which ranks found a NaN/Inf
(:func:`exchange_trip`), and then which module tripped where (:func:`gather_trip_details`), so
that every rank names the same earliest fault (:func:`earliest_fault`).

Unlike the checks, the exchange tolerates ranks that never come: the ranks first meet in the
store (numguard.distributed.rendezvous, through the channel's per-group state) and run the
collective (numguard.distributed.collectives) only when every rank is there; otherwise the rank
goes on with its own result and warns once.
"""
from __future__ import annotations

import struct

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as _c10d

from .. import schema
from ._env import dist_timeout
from .channel import LastExchange, _GroupState, call_site, exclusive, group_state, is_initialized
from .collectives import timed_all_gather
from .errors import DistributedOperationException

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
                  numbers=None, third: int = 0, fourth: int = 0):
    """All-gather four int64 per rank on numguard's group (the flag, the batch, the rank-local
    batches, the rank's rerun request); [(first, second, third, numbers, fourth) per rank], with
    ``numbers`` (numerics.FIELDS as floats, riding in the same record) a tuple, empty when None."""
    numbers = [] if numbers is None else list(numbers)
    words = 4 + len(numbers)
    fmt = f"<4q{len(numbers)}d"
    hin_b = st.gather_buffers(words)[0]
    struct.pack_into(fmt, hin_b, 0, first, second, third, fourth, *numbers)
    out = timed_all_gather(st, words, what, site)
    rows = [struct.unpack_from(fmt, out, r * words * 8) for r in range(st.world)]
    return [(row[0], row[1], row[2], row[4:], row[3]) for row in rows]


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
                  numbers=None, local_batches: int = 0, request: int = 0) -> torch.Tensor:
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
        request: this rank's request to the others (nonzero: it has a rerun verdict to settle with
            a data-parallel peer, numguard.distributed.peer_rerun); every rank's is in
            :func:`last_exchange`'s ``requests``.

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
                                      int(local_batches), int(request))
                st.last.batches = [None if p[1] == _NO_BATCH else p[1] for p in pairs]
                st.last.requests = [p[4] for p in pairs]
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


__all__ = ["EXCHANGE_GRACE_S", "TripDetail", "earliest_fault", "exchange_trip", "gather_trip_details",
           "last_exchange", "on_exchange"]
