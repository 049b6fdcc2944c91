"""Store rendezvous: numguard starts an exchange only once every rank of the group is there.

A collective that some rank never joins cannot be taken back: it stays pending, pairs with
whatever that rank runs next, or (gloo, sizes differ) aborts the process. The inspector's trip
exchange is reached by every rank only when every rank runs the same checked batches; a
rank-0-only evaluation with gradients enabled, or ``watch()`` on one rank, breaks that. So the
ranks first meet in the process group's store, where giving up leaves nothing pending, and run
the collective only when the meeting says every rank came.

NOTE: [rendezvous slots]
Meetings are numbered per process group (slots 1, 2, ...; the same numbering on every rank).
For slot ``s`` the store holds, under the group's prefix:

=================  ==========================================================================
``s/n``            arrivals (``store.add``)
``s/state``        ``done`` or ``closed``, written once with ``compare_set("" -> value)``:
                   whichever comes first wins, so every rank reads the same outcome
``seen/<rank>``    the last slot that rank waited at (written only by a rank that waited,
                   to name missing ranks)
=================  ==========================================================================

The rank whose arrival completes the count writes ``done``; the others poll ``state``. A rank
still waiting after the grace writes ``closed`` (or reads ``done``: the last rank came in time).
``done``: every rank runs the collective. ``closed``: the ranks that came go on with their own
result. A rank that finds its slot already closed is late: the others gave up on this slot and
meet next at the following one, so it moves on and waits there (ranks that drifted apart by one
exchange line up again).

A rank waits the full grace only in good standing. After a failed meeting, and when late, it
waits _RETRY_GRACE_S: the ranks it is looking for are then either right behind it (they left
the same DDP all_reduce) or not running exchanges at all. After _PASSIVE_AFTER failed meetings
in a row it stops waiting ("passive"): it joins a slot only when someone already waits there,
so a rank running exchanges alone (evaluation on rank 0, ``watch()`` on one rank) pays one
store round trip per exchange and writes nothing; an absence costs the grace plus
_RETRY_GRACE_S once. One failure is not enough for that: ranks in lockstep (DDP) that drifted
by one exchange wait for each other in turn (one in the exchange, the other in DDP's
all_reduce) until one gives up, and that rank must still wait at its next exchange, where the
other, now late, meets it (measured: passive after one failure, a rank checked just before the
late one arrived, and the two missed each other at every step, a grace per step). A passive rank
that checks just before a returning rank arrives goes on alone once more; the returning rank
gives up after _RETRY_GRACE_S and the two meet at the next exchange.

The rank that completes a slot deletes the keys of the slots before it: every rank has left
them.
"""
from __future__ import annotations

import time

from .arrivals import Arrivals

DONE = b"done"
CLOSED = b"closed"
# compare_set's answer for a key that does not exist yet, when asked to replace this value.
_UNSET = b"unset"
# A rank that has waited this long writes its slot to seen/<rank> (cheap checks never do).
_POST_AFTER_S = 0.05
_MAX_POLL_PAUSE_S = 0.01
# A late rank moves past at most this many closed slots in one call.
_MAX_SKIPS = 64
# Failed meetings in a row after which a rank stops waiting, and the shorter wait after a
# failure or when late (see the module docstring).
_PASSIVE_AFTER = 2
_RETRY_GRACE_S = 0.5


class Meeting:
    """What :meth:`Rendezvous.meet` found: ``joined`` (every rank came), the ``slot``, the
    ``missing`` global ranks when it gave up (empty when joined) and ``waited_s``, how long it
    waited before giving up (0: passive, it did not wait)."""

    __slots__ = ("joined", "slot", "missing", "waited_s")

    def __init__(self, joined: bool, slot: int, missing=(), waited_s: float = 0.0):
        self.joined = joined
        self.slot = slot
        self.missing = list(missing)
        self.waited_s = waited_s


class Rendezvous:
    """The meetings of one process group (see NOTE: [rendezvous slots]). Store errors propagate
    to the caller."""

    def __init__(self, store, prefix: str, global_ranks, me: int):
        self.store = store
        self.prefix = prefix
        self.global_ranks = list(global_ranks)
        self.me = me
        self.world = len(self.global_ranks)
        self.slot = 1
        self.last_done = 0
        self.passive = False
        self.failures = 0  # failed meetings in a row
        self.missing: list = []
        self._can_delete = True
        self.seen = Arrivals(store, prefix.rstrip("/"), self.global_ranks)  # seen/<rank>: its last slot

    def _key(self, slot: int, what: str) -> str:
        return f"{self.prefix}{slot}/{what}"

    def meet(self, grace_s: float) -> Meeting:
        """Arrive at the next slot; return once every rank came, or after ``grace_s``."""
        s = self.slot
        if self.passive and not self.store.check([self._key(s, "n")]):
            return Meeting(False, s, self.missing)
        retry_s = min(grace_s, _RETRY_GRACE_S)
        wait_s = grace_s if self.failures == 0 else retry_s
        for _ in range(_MAX_SKIPS):
            arrived = self.store.add(self._key(s, "n"), 1)
            if arrived >= self.world:
                state = self.store.compare_set(self._key(s, "state"), "", DONE)
                late = state != DONE
            else:
                state, late = self._await(s, wait_s)
            if state == DONE:
                self._done(s, completed_by_me=arrived >= self.world)
                return Meeting(True, s)
            if not late:
                break
            s += 1
            wait_s = retry_s
        self.missing = self._missing(s)
        self.slot = s + 1
        self.failures += 1
        self.passive = self.failures >= _PASSIVE_AFTER
        return Meeting(False, s, self.missing, waited_s=wait_s)

    def _await(self, s: int, grace_s: float):
        """Poll slot ``s`` until its outcome is written; close it after ``grace_s``. Returns
        (state, late): late when the slot was closed before this rank arrived."""
        key = self._key(s, "state")
        start = time.monotonic()
        deadline = start + grace_s
        posted = False
        first = True
        pause = 0.0001
        while True:
            state = self.store.compare_set(key, _UNSET, _UNSET)
            if state != _UNSET:
                return state, first and state == CLOSED
            first = False
            now = time.monotonic()
            if not posted and (now - start >= _POST_AFTER_S or now >= deadline):
                self._post_seen(s)
                posted = True
            if now >= deadline:
                return self.store.compare_set(key, "", CLOSED), False
            time.sleep(min(pause, max(deadline - now, 0.0)))
            pause = min(pause * 2, _MAX_POLL_PAUSE_S)

    def _post_seen(self, s: int) -> None:
        self.seen.post("seen", self.me, s)

    def _missing(self, s: int) -> list:
        """Global ranks that never waited at slot ``s`` or later."""
        missing = []
        for g in self.global_ranks:
            if g == self.me:
                continue
            seen = self.seen.value("seen", g)
            if seen is None or int(seen) < s:
                missing.append(g)
        return missing

    def _done(self, s: int, completed_by_me: bool) -> None:
        if completed_by_me and self._can_delete:
            for j in range(max(self.last_done, 1), s):
                for what in ("n", "state"):
                    try:
                        self.store.delete_key(self._key(j, what))
                    except Exception:  # a store without deletion keeps a few bytes per slot
                        self._can_delete = False
                        break
        self.last_done = s
        self.slot = s + 1
        self.passive = False
        self.failures = 0
        self.missing = []
