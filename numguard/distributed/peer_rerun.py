"""The cross-rank half of a rerun verdict (``watch(rerun=True)``): after a trip, the rank whose
fault came first tells every rank what its own rerun said, and when its own device reproduced the
fault, a data-parallel peer (same weights) runs the same inputs and every rank learns its answer:
the peer reproduces it too ("reproducible": the data or the model) or not ("device").

NOTE: [peer rerun]
Every rank calls :func:`settle` at the same point: the handling of a trip, which every rank
reaches after a complete trip exchange, or a check whose complete exchange carried a rank's
request (for a spike). Every rank's request word in that exchange says whether it watches with
rerun=True (``RERUN_ON``) and whether it has a claim (``CLAIMED``); unless every rank has rerun on
and the exchange was complete, nothing is exchanged and each rank keeps its own verdict. There
is no store meeting here: the exchange just lined the ranks up, and a meeting of another kind
could pair this one with the next check's (a rank that gave up on a meeting waits at the next
slot). Then, on numguard's own group (the channel; never the user's group, where DDP's
collectives run), each step timed by ``NUMGUARD_DIST_TIMEOUT``:

1. claims: an all_gather of ``CLAIM_BYTES`` of JSON per rank: its claim (the batch, its own
   rerun's verdict and words, the length of its inputs' payload when it wants a peer), and what
   it can do as a peer: whether it can rerun, its data-parallel ranks (DDP's process group, the
   replica check's), a digest of its parameters, its host and device;
2. inputs: the claimant sends its payload (``torch.save`` of the inputs, random states and
   buffers at the call) to the peer alone (send/recv; the other ranks only count the step);
3. answers: an all_gather of ``ANSWER_BYTES`` of JSON: the peer's result of its rerun.

The peer of a claimant: the first rank after it (in rank order, wrapping) that can rerun, in its
data-parallel group when one is known, else among the ranks whose parameters are bitwise the
claimant's (a rank of another pipeline stage never runs another stage's inputs); a rank that
made no claim of its own is preferred. No peer, a peer whose rerun failed, or a peer that never
answered (it is named; the collective gives up after ``NUMGUARD_DIST_TIMEOUT`` and numguard stops
using its group, as after any timeout) leave the claimant's own verdict with the reason.

No rank is inside one of DDP's collectives here: a check runs at the root's return (before the
backward) or at the optimizer step (after DDP's reducer has finished the backward's all_reduces),
and every rank reaches it through the trip exchange. The reruns run a DDP model's ``.module`` (no
DDP collective) with the replica check quiet; a model whose forward runs collectives of its own
is not rerun (numguard.inspector.rerun.RootRerun.target).

A healthy batch never comes here: the claims are exchanged only after a trip or a request.
"""
from __future__ import annotations

import json
import socket
from typing import NamedTuple

import torch

from .channel import _GroupState, call_site, group_state, is_initialized
from .collectives import _mark_arrival, _wait, timed_all_gather
from .errors import DistributedOperationException

CLAIM_BYTES = 4096
RERUN_ON, CLAIMED = 2, 1   # bits of a rank's request word in the trip exchange
ANSWER_BYTES = 1024
_TAG = 0x4E47   # the send/recv tag of a payload


class Outcome(NamedTuple):
    """How one claim was settled: the claimant's global rank and claim (dict), what it said it
    is (``card``: host, device, ...), the peer's global rank (None: none was asked), the peer's
    answer (dict, None when there is none) and, when there is none, why."""
    claimant: int
    claim: dict
    card: dict
    peer: int | None
    answer: dict | None
    problem: str


def _encode(record: dict, capacity: int) -> bytes:
    raw = json.dumps(record, separators=(",", ":")).encode("utf-8")
    if len(raw) > capacity:   # the words are shortened, the facts kept
        for key in ("detail", "reason"):
            for part in ("claim", "answer", None):
                holder = record.get(part) if part else record
                if isinstance(holder, dict) and isinstance(holder.get(key), str):
                    holder[key] = holder[key][:200] + "..."
        raw = json.dumps(record, separators=(",", ":")).encode("utf-8")
    if len(raw) > capacity:
        raise ValueError(f"a peer-rerun record of {len(raw)} bytes does not fit in {capacity}")
    return raw.ljust(capacity, b"\0")


def _gather_json(st: _GroupState, record: dict, capacity: int, what: str, site: str) -> list:
    words = capacity // 8
    hin_b = st.gather_buffers(words)[0]
    hin_b[:] = _encode(record, capacity)
    out = timed_all_gather(st, words, what, site)
    rows = []
    for r in range(st.world):
        raw = bytes(out[r * capacity:(r + 1) * capacity]).rstrip(b"\0")
        rows.append(json.loads(raw.decode("utf-8")) if raw else {})
    return rows


def _send_payload(st: _GroupState, payload: bytes | None, length: int, src: int, dst: int,
                  what: str, site: str):
    """The payload from group rank ``src`` to ``dst`` (bytes on ``dst``, None elsewhere). Every
    rank counts the step, so the ranks' check numbers stay equal."""
    _mark_arrival(st)
    if st.rank not in (src, dst):
        return None
    buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if st.rank == src else \
        torch.empty(length, dtype=torch.uint8)
    if st.rank == src:
        work = st.comm.send([buf], dst, _TAG)
    else:
        work = st.comm.recv([buf], src, _TAG)
    _wait(work, st, what, site, _timeout_s())
    return bytes(buf.numpy()) if st.rank == dst else None


def _timeout_s() -> float:
    from ._env import dist_timeout
    return dist_timeout()


def choose_peer(claimant: int, cards: list, claimed: set) -> int | None:
    """The group rank that reruns ``claimant``'s inputs (see NOTE: [peer rerun]), or None."""
    world = len(cards)
    mine = cards[claimant]
    group = mine.get("dp")
    order = [(claimant + k) % world for k in range(1, world)]
    able = []
    for r in order:
        card = cards[r]
        if not card.get("serve"):
            continue
        if group is not None:
            if card.get("rank") not in group:
                continue
        elif card.get("digest") is None or card.get("digest") != mine.get("digest"):
            continue
        able.append(r)
    free = [r for r in able if r not in claimed]
    return (free or able or [None])[0]


def ready(group=None) -> bool:
    """Whether the last trip exchange of ``group`` was complete and every rank watches with
    rerun=True (so every rank calls :func:`settle` now)."""
    if not is_initialized():
        return False
    last = group_state(group).last
    return bool(last.complete and last.requests and all(r & RERUN_ON for r in last.requests))


def claimed(group=None) -> bool:
    """Whether a rank announced a claim in the last trip exchange of ``group``."""
    return ready(group) and any(r & CLAIMED for r in group_state(group).last.requests)


def settle(claim: dict | None, payload: bytes | None, serve, card: dict, *, only=None,
           group=None) -> tuple[list[Outcome], list[dict]] | None:
    """Settle every rank's claim (NOTE: [peer rerun]); called by every rank together.

    Args:
        claim: this rank's claim (JSON-able dict with at least ``batch``; ``peer``: True when it
            wants a peer to run ``payload``), or None.
        payload: the bytes a peer gives to ``serve`` (None: no peer can be asked).
        serve: ``serve(claim, card, payload) -> dict`` runs a claimant's inputs on this rank; a
            dict with ``error`` when it could not.
        card: what this rank is: ``serve`` (it can rerun), ``dp`` (the global ranks of its
            data-parallel group, or None), ``digest`` (of its parameters, or None), ``device``.
        only: settle the claim of this global rank only (the earliest fault), or every claim.

    Returns (the outcomes in claimant order, every rank's card in group rank order), or None
    when the ranks cannot settle now (:func:`ready`; each goes on with its own verdict).
    """
    if not ready(group):
        return None
    st = group_state(group)
    if st.world == 1 or st.broken is not None:
        return None
    site = call_site()
    me = st.global_ranks[st.rank]
    card = dict(card, rank=me, host=socket.gethostname())
    if claim is not None:
        claim = dict(claim, length=len(payload) if payload is not None and claim.get("peer") else 0)
    rows = _gather_json(st, {"claim": claim, "card": card}, CLAIM_BYTES,
                        "numguard peer rerun claims (all_gather)", site)
    cards = [row.get("card") or {} for row in rows]
    claimants = [r for r, row in enumerate(rows) if row.get("claim") is not None and (
        only is None or st.global_ranks[r] == only)]
    outcomes = []
    for r in claimants:
        theirs = rows[r]["claim"]
        peer, answer, problem = None, None, ""
        if theirs.get("peer"):
            peer = choose_peer(r, cards, set(claimants))
            if peer is None:
                problem = ("no data-parallel peer could run it (none with rerun=True in its data-parallel group, "
                           "or with bitwise the same parameters)")
            elif not theirs.get("length"):
                problem = theirs.get("unsent") or "its inputs could not be sent"
                peer = None
            else:
                answer, problem = _ask(st, r, peer, theirs, cards[r], payload, serve, site)
                if answer is not None:
                    answer = dict(answer, card=cards[peer])
        outcomes.append(Outcome(st.global_ranks[r], theirs, cards[r],
                                None if peer is None else st.global_ranks[peer], answer, problem))
    return outcomes, cards


def _ask(st, claimant, peer, claim, card, payload, serve, site):
    """(answer, problem) of the peer's rerun of ``claimant``'s payload; every rank takes part."""
    who = st.global_ranks[peer]
    try:
        got = _send_payload(st, payload, claim["length"], claimant, peer,
                            f"numguard peer rerun inputs (rank {st.global_ranks[claimant]} to rank {who})", site)
        answer = None
        if st.rank == peer:
            try:
                answer = serve(claim, card, got)
            except Exception as exc:  # the peer's failure is an answer too
                answer = {"error": f"{type(exc).__name__}: {exc}"}
        rows = _gather_json(st, {"answer": answer}, ANSWER_BYTES,
                            "numguard peer rerun answers (all_gather)", site)
    except DistributedOperationException as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return None, (f"the peer, rank {who}, never answered ({first}); numguard stops using its "
                      "process group")
    answer = rows[peer].get("answer")
    if not isinstance(answer, dict):
        return None, f"the peer, rank {who}, sent no answer"
    if answer.get("error"):
        return None, f"the peer, rank {who}, could not run it ({answer['error']})"
    return answer, ""


__all__ = ["ANSWER_BYTES", "CLAIMED", "CLAIM_BYTES", "Outcome", "RERUN_ON", "choose_peer", "claimed", "ready",
           "settle"]
