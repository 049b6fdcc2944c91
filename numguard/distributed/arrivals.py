"""Arrival bookkeeping in a store: each rank writes marks of its own, and any rank reads who has
written one, so a wait that gives up can name the ranks that never came.

One implementation for numguard's cross-rank code: the timed collectives post their check number
here when a check is slow and read the others' to name missing ranks (NOTE: [arrivals] in
collectives.py), the trip exchange's rendezvous names the ranks that never waited, and ``numguard
doctor`` meets here before any process group exists (``arrived``, its verdict, the acks) and marks
where each rank is in each step (its census). A key is ``<prefix>/<kind>/<tag>/<rank>`` (kind and
tag left out when None), one per rank, overwritten. Store errors propagate to the caller.
"""
from __future__ import annotations

import time

__all__ = ["Arrivals"]

_POLL_S = 0.05


class Arrivals:
    """The marks of `ranks` under `prefix` in `store` (a torch.distributed Store)."""

    def __init__(self, store, prefix: str, ranks):
        self.store = store
        self.prefix = prefix
        self.ranks = list(ranks)

    def key(self, kind, rank, tag=None) -> str:
        return "/".join([self.prefix] + [str(p) for p in (kind, tag) if p is not None] + [str(rank)])

    def post(self, kind, rank, value="1", tag=None) -> None:
        """Write `rank`'s mark (overwriting its earlier one)."""
        self.store.set(self.key(kind, rank, tag), str(value))

    def value(self, kind, rank, tag=None):
        """`rank`'s mark as bytes, or None when it wrote none (never blocks)."""
        key = self.key(kind, rank, tag)
        return self.store.get(key) if self.store.check([key]) else None

    def posted(self, kind, tag=None, ranks=None) -> list:
        """The ranks (of `ranks`, default all) that wrote this mark."""
        return [r for r in (self.ranks if ranks is None else ranks)
                if self.store.check([self.key(kind, r, tag)])]

    def wait(self, kind, ranks, timeout_s: float, tag=None) -> list:
        """Wait up to `timeout_s` for every rank of `ranks` to write this mark; returns those that
        did not."""
        pending = list(ranks)
        deadline = time.monotonic() + timeout_s
        while pending and time.monotonic() < deadline:
            pending = [r for r in pending if not self.store.check([self.key(kind, r, tag)])]
            if pending:
                time.sleep(_POLL_S)
        return pending

    def behind_and_ahead(self, kind, count: int, grace_s: float, tag=None):
        """(behind, ahead): the ranks whose numeric mark (a count, 0 when none) is below `count`,
        and those above it. Ranks that look behind get `grace_s` more seconds (they may have
        arrived just before this rank gave up)."""
        deadline = time.monotonic() + grace_s
        while True:
            behind, ahead = [], []
            for r in self.ranks:
                mark = self.value(kind, r, tag)
                seen = int(mark) if mark is not None else 0
                if seen < count:
                    behind.append(r)
                elif seen > count:
                    ahead.append(r)
            if not behind or time.monotonic() > deadline:
                return behind, ahead
            time.sleep(0.02)
