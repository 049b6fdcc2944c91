"""Exceptions and warnings raised by numguard's inspector."""
from __future__ import annotations


class NonFiniteError(ValueError):
    """A watched tensor held NaN or +-Inf.

    Attributes:
        report: the text report (the frames that led to the first non-finite value).
        batch_number: the 0-indexed batch in which the first non-finite value was recorded.
        module: qualified name of the module where the first non-finite value was found ("" is
            the root module). In a distributed job this is the earliest fault across ranks, the
            same on every rank (on rank ``fault_rank``; see ``own_module`` for this rank's own):
            a rank whose values are finite, or whose NaN/Inf a collective carried from another
            rank, names the module where it started. None when no rank could name one.
        labels: the offending labels of that frame (e.g. ["output"], ["weight", "output[0]"]).
        rank: the rank that raised (None when torch.distributed is not initialized).
        ranks: in a distributed job, every rank that tripped (empty otherwise).
        fault_rank: the rank ``module`` is on (this rank, or None outside a distributed job).
        fault_kind: what the first non-finite value was: "forward", "gradient" (tapped in the
            backward) or "parameter gradient" (before the optimizer step); None when unknown.
        own_module: this rank's own first offending module, or None when this rank's records
            are finite.
    """

    def __init__(self, message: str, *, report: str = "", batch_number: int | None = None,
                 module: str | None = None, labels=(), rank: int | None = None, ranks=(),
                 fault_rank: int | None = None, fault_kind: str | None = None,
                 own_module: str | None = None):
        super().__init__(message)
        self.report = report
        self.batch_number = batch_number
        self.module = module
        self.labels = list(labels)
        self.rank = rank
        self.ranks = list(ranks)
        self.fault_rank = fault_rank
        self.fault_kind = fault_kind
        self.own_module = own_module


class AbortAfterBatch(ValueError):
    """Raised after the batch named by `abort_after_batch_num` has finished, as requested."""


class NonFiniteWarning(UserWarning):
    """on_trip="warn" or "dump": a watched tensor held NaN or +-Inf; training goes on."""


class HeadroomWarning(UserWarning):
    """A low-precision tensor came close to its dtype's largest finite value."""


class SpikeWarning(UserWarning):
    """watch(spikes=True): a module's value jumped far outside its own recent range (NOTE: [spike
    rule] in numguard.inspector.spikes). `spike`: module, class, quantity, value, baseline, factor,
    batch, rank."""

    def __init__(self, message, spike=None):
        super().__init__(message)
        self.spike = spike


class SpikeError(RuntimeError):
    """watch(spikes="raise"): as SpikeWarning, raised; `spike` says where."""

    def __init__(self, message, spike=None):
        super().__init__(message)
        self.spike = spike


class InspectorWarning(UserWarning):
    """numguard could not watch part of a model (it stops watching that part; training goes on)."""
