"""Outlier ranks: which rank's activations, gradients or step time stand out from the others'.

Every checked batch the trip exchange (trip_exchange.exchange_trip) already all_gathers a small
fixed record per rank on numguard's own gloo group. That record also carries a few numbers each
rank has without any extra host sync (:data:`FIELDS`):

- ``nonfinite``, ``activation_headroom``, ``gradient_headroom``, ``gradient_min_nonzero``:
  folded on the device into the state copy the check already reads (numguard.inspector.checks),
  over the records of the frames since the previous check; headroom is abs max / the dtype's
  largest finite value (the worst tensor), so ranks are compared on the same scale whatever the
  dtypes. Being read by a check, they travel with the NEXT check's exchange (one check late).
- ``skipped_steps``: GradScaler-skipped optimizer steps so far (a host counter).
- ``step_time_s``: host seconds per batch from the previous exchange to the end of the last
  forward. It leaves the backward out, where DDP's gradient all_reduce makes fast ranks wait for
  slow ones: a rank slow in its data loading, optimizer step or forward shows its own longer time.

The rule (:func:`_flags`) runs identically on every rank from the same gathered table, so every
rank names the same outliers. A rank named persistently (:data:`PERSIST` of the last
:data:`WINDOW` checks) is warned about once through numguard's distributed logger (rank 0 logs),
is listed by :func:`last_outliers`, and goes into dump files (``"outliers"``).
"""
from __future__ import annotations

import collections
import math
import socket
import threading

from . import channel as _channel
from . import trip_exchange as _trip_exchange
from .logging import get_logger

FIELDS = ("nonfinite", "activation_headroom", "gradient_headroom", "gradient_min_nonzero",
          "skipped_steps", "step_time_s")
DEVICE_FIELDS = FIELDS[:4]   # computed on the device by the check (float64 each)

# The rule. A rank's value is compared, on a log scale, with the median of the OTHER ranks'
# values (leave-one-out: with 2 ranks the other rank alone, where a median/MAD over both could
# never single one out). It is flagged when it exceeds that median by more than
#   max(log(FACTOR), MAD_LIMIT * 1.4826 * MAD of the others' logs)
# Why these numbers:
# - log scale: ranks of a data-parallel job run one model on batches of one distribution, so their
#   magnitudes differ by a noise factor, not an offset; a log test is scale-free (fp16 and fp32
#   jobs are judged alike).
# - FACTOR 8 (3 binades) for abs max: the abs max of i.i.d. batches concentrates (it grows like
#   sqrt(log n) for Gaussian-like values), so healthy ranks differ by well under 2x; 8x is far
#   outside that and far below what data bugs give (un-normalized pixels: 255x; a unit slip: 1e3).
# - 2x and at least 50 ms more for step time: host step times jitter by 10-30% (GC, logging,
#   data loader workers), and on shared or oversubscribed hosts a process can lose tens of ms
#   to the scheduler; a rank twice as slow as the others' median, costing every rank 50 ms or
#   more per batch, is worth a warning, while smaller differences are noise more often than not.
# - MAD_LIMIT 5 (1.4826 * MAD estimates a standard deviation for normal data): with 3 or more
#   other ranks a noisy job widens its own threshold instead of flagging its noise.
# - PERSIST 3 of WINDOW 8 checks: one odd batch is not a rank problem; three within eight are.
RULES = {
    "activations": ("activation_headroom", 8.0, 0.0),
    "gradients": ("gradient_headroom", 8.0, 0.0),
    "step_time": ("step_time_s", 2.0, 0.05),
}
MAD_LIMIT = 5.0
WINDOW = 8
PERSIST = 3

_log = get_logger("numguard.distributed.numerics")
_trackers: dict = {}
_lock = threading.Lock()


def _median(values):
    s = sorted(values)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def _flags(values, factor, floor):
    """Per rank: (flagged, median of the others) for one metric's values (None/NaN/<=0: unknown)."""
    usable = [v is not None and math.isfinite(v) and v > 0 for v in values]
    logs = [math.log(v) if ok else 0.0 for v, ok in zip(values, usable)]
    out = []
    for r, ok in enumerate(usable):
        others = [logs[o] for o in range(len(values)) if o != r and usable[o]]
        if not ok or not others:
            out.append((False, None))
            continue
        m = _median(others)
        mad = _median([abs(x - m) for x in others])
        limit = max(math.log(factor), MAD_LIMIT * 1.4826 * mad)
        flagged = logs[r] - m > limit and values[r] - math.exp(m) > floor
        out.append((flagged, math.exp(m)))
    return out


class _Tracker:
    """Per process group: each rank's flags over the last WINDOW checks, who is named now."""

    def __init__(self, st):
        self.name = st.name
        self.ranks = list(st.global_ranks)
        self.history = collections.defaultdict(lambda: collections.deque(maxlen=WINDOW))
        self.named = {}            # (rank, metric) -> outlier dict
        self.table = []            # the last exchange's numbers, one dict per rank
        self.hosts = {}
        self.store = st.store
        self.announced = False

    def _announce(self, me):
        """Publish this rank's host name in the store once (read only when a rank is named)."""
        self.announced = True
        if self.store is not None:
            try:
                self.store.set(f"numguard/host/{self.name}/{me}", socket.gethostname())
            except Exception:
                self.store = None

    def host(self, rank):
        if rank not in self.hosts:
            name = "unknown host"
            if self.store is not None:
                try:
                    name = self.store.get(f"numguard/host/{self.name}/{rank}").decode()
                except Exception:
                    pass
            self.hosts[rank] = name
        return self.hosts[rank]

    def observe(self, me, rows, batches):
        if not self.announced:
            self._announce(me)
        self.table = [dict(zip(FIELDS, row), rank=self.ranks[r], batch=batches[r])
                      for r, row in enumerate(rows)]
        fresh = []
        for metric, (field, factor, floor) in RULES.items():
            results = _flags([row[FIELDS.index(field)] for row in rows], factor, floor)
            for r, (flagged, median) in enumerate(results):
                key = (self.ranks[r], metric)
                window = self.history[key]
                window.append(flagged)
                if sum(window) >= PERSIST and flagged:
                    value = rows[r][FIELDS.index(field)]
                    entry = {"rank": self.ranks[r], "host": None, "metric": metric, "field": field,
                             "value": value, "median_of_others": median,
                             "ratio": value / median if median else None,
                             "flagged_checks": sum(window), "window": len(window),
                             "batch": batches[r]}
                    if key not in self.named:
                        fresh.append(entry)
                    self.named[key] = entry
                elif sum(window) < PERSIST:
                    self.named.pop(key, None)
        for entry in fresh:
            entry["host"] = self.host(entry["rank"])
        for entry in self.named.values():
            if entry["host"] is None:
                entry["host"] = self.host(entry["rank"])
        for entry in fresh:
            _log.warning(describe(entry))


def describe(entry: dict) -> str:
    what = {"activations": "activations (abs max / dtype max)",
            "gradients": "gradients (abs max / dtype max)",
            "step_time": "host step time (seconds per batch up to the end of the forward)"}
    metric = entry["metric"]
    ratio = entry["ratio"]
    return (f"numguard.distributed: rank {entry['rank']} on host {entry['host']} is an outlier in "
            f"{what[metric]}: {entry['value']:.4g} against {entry['median_of_others']:.4g} on the "
            f"other ranks (median), {ratio:.3g}x, in {entry['flagged_checks']} of the last "
            f"{entry['window']} checks (batch {entry['batch']}).")


def observe(st, rows, batches) -> None:
    """Feed one exchange's table (a row of FIELDS per rank of ``st``'s group, rank order)."""
    with _lock:
        tracker = _trackers.get(st.name)
        if tracker is None:
            tracker = _trackers[st.name] = _Tracker(st)
    tracker.observe(st.global_ranks[st.rank], rows, batches)


def _tracker(group):
    if not _channel.is_initialized():
        return None
    return _trackers.get(_channel.group_state(group).name)


def last_outliers(group=None) -> list:
    """The ranks of ``group`` (default: the world) named as outliers after the last exchange:
    dicts with ``rank``, ``host``, ``metric`` ("activations", "gradients" or "step_time"),
    ``value``, ``median_of_others``, ``ratio``, ``flagged_checks`` of ``window`` and ``batch``.
    Empty when none (or outside a distributed job)."""
    tracker = _tracker(group)
    if tracker is None:
        return []
    return [dict(e) for e in sorted(tracker.named.values(), key=lambda e: (e["rank"], e["metric"]))]


def last_numbers(group=None) -> list:
    """Every rank's numbers of the last exchange (one dict of FIELDS per rank, with ``rank`` and
    ``batch``); empty before the first."""
    tracker = _tracker(group)
    return [] if tracker is None else [dict(row) for row in tracker.table]


def forget(name=None) -> None:
    """Drop the tracking of a group (by numguard's group name), or of every group."""
    with _lock:
        if name is None:
            _trackers.clear()
        else:
            _trackers.pop(name, None)


def _released(group) -> None:
    forget()  # a released group's ranks may come back as another job: start over


def _install() -> None:
    _channel.on_release(_released)


_install()

__all__ = ["FIELDS", "PERSIST", "RULES", "WINDOW", "describe", "last_numbers", "last_outliers",
           "observe"]


_trip_exchange.on_exchange(observe)  # NOTE: [cross-rank numbers] in trip_exchange.py
