"""The batch finder's arguments and its pure search: which size to try next after a success or a
failure (``search="down"|"binary"``), with no torch and no ranks."""
from __future__ import annotations

import numbers

from ..env import OptionError
from .oom import _WHERE


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


def few_sizes_warning(global_batch, world, per_rank):
    """The warning for a per-rank total that is a prime above 3 (None otherwise): no batch size but
    1 and the whole of it keeps ``batch_size * accumulation_steps * world == global_batch_size``,
    so one failed try falls to batch size 1 with per_rank accumulation steps."""
    if per_rank is None or per_rank <= 3 or any(per_rank % d == 0 for d in range(2, int(per_rank ** 0.5) + 1)):
        return None
    lower, upper = (per_rank // 8) * 8 * world, (per_rank // 8 + 1) * 8 * world
    near = f"{lower} or {upper}" if lower else f"{upper}"
    ranks = f" over {world} ranks ({per_rank} per rank)" if world > 1 else ""
    return (f"numguard.find_executable_batch_size: global_batch_size={global_batch}{ranks} leaves {per_rank}, "
            f"a prime, for each rank: the only batch sizes that keep the global batch are {per_rank} and 1, so "
            f"one out-of-memory try falls to batch size 1 with {per_rank} accumulation steps. Pass a global "
            f"batch size with more divisors (e.g. {near}).")


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
