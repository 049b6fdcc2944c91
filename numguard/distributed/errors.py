"""Exceptions and warnings raised by numguard.distributed."""
from __future__ import annotations


class DistributedOperationException(Exception):
    """Ranks disagree about a collective (shapes, dtypes, structure or operation), or some ranks
    never arrived at it. Raised on every rank that took part in the check, reporting the same
    differences."""


class DistributedTimeoutError(DistributedOperationException, TimeoutError):
    """Some ranks did not arrive at a checked collective within ``NUMGUARD_DIST_TIMEOUT`` seconds.
    ``.missing_ranks`` lists them (ranks of the default group); ``.backend_error`` is the backend's
    exception when the collective failed instead of running out of time (None when it timed out)."""

    def __init__(self, message: str, missing_ranks=(), backend_error=None):
        super().__init__(message)
        self.missing_ranks = list(missing_ranks)
        self.backend_error = backend_error


class DistributedWarning(RuntimeWarning):
    """numguard.distributed goes on in a degraded way (a rank missing from the trip exchange,
    ranks checking different batches, threads sharing a group's checks); each kind is warned
    about once per process group."""


class ReplicaDivergenceError(RuntimeError):
    """The replicas of data-parallel parameters (or of their gradients before the optimizer step)
    are not bitwise identical on every rank (numguard.distributed.replicas). Raised on every rank
    of the group in the same step. ``.finding`` is the dictionary the warning and the dump show
    (parameters, minority ranks, differing elements, largest difference in ulps); ``.attribution``
    the :class:`numguard.Attribution` naming the rank whose copy is corrupted ("device"), or None
    where that cannot be told (NOTE: [replica verdict] in numguard.distributed.replica_blame)."""

    def __init__(self, message: str, finding: dict, attribution=None):
        super().__init__(message)
        self.finding = finding
        self.attribution = attribution


class CrossRankWarning(DistributedWarning):
    """A cross-rank numerics finding that training goes on with: replicas that diverged
    (on_trip="warn"/"dump"), or a rank whose numbers stand out (an outlier rank)."""
