"""Exceptions and warnings raised by numguard's inspector."""
from __future__ import annotations


class NonFiniteError(ValueError):
    """A watched tensor held NaN or +-Inf.

    Attributes:
        report: the text report (the frames that led to the first non-finite value).
        batch_number: the 0-indexed batch in which the first non-finite value was recorded.
        module: qualified name of the first offending module ("" is the root module), or None
            when another rank tripped and this rank's own records are finite.
        labels: the offending labels of that frame (e.g. ["output"], ["weight", "output[0]"]).
        rank: the rank that raised (None when torch.distributed is not initialized).
        ranks: in a distributed job, every rank that tripped (empty otherwise).
    """

    def __init__(self, message: str, *, report: str = "", batch_number: int | None = None,
                 module: str | None = None, labels=(), rank: int | None = None, ranks=()):
        super().__init__(message)
        self.report = report
        self.batch_number = batch_number
        self.module = module
        self.labels = list(labels)
        self.rank = rank
        self.ranks = list(ranks)


class AbortAfterBatch(ValueError):
    """Raised after the batch named by `abort_after_batch_num` has finished, as requested."""


class NonFiniteWarning(UserWarning):
    """on_trip="warn" or "dump": a watched tensor held NaN or +-Inf; training goes on."""


class HeadroomWarning(UserWarning):
    """A low-precision tensor came close to its dtype's largest finite value."""


class InspectorWarning(UserWarning):
    """numguard could not watch part of a model (it stops watching that part; training goes on)."""
