"""Exceptions and warnings raised by numguard's inspector."""
from __future__ import annotations

import dataclasses

VERDICTS = ("transient", "device", "reproducible")


@dataclasses.dataclass(frozen=True)
class Attribution:
    """What a rerun of the faulty step said about its cause (watch(rerun=True), numguard.rerun_step;
    NOTE: [rerun verdict] in numguard.inspector.rerun).

    Attributes:
        verdict: "transient" (the same inputs on the same device gave finite values: a glitch),
            "device" (this device reproduces it, a data-parallel peer does not) or "reproducible"
            (it repeats: the data or the model); for replicas that diverged (the replica check),
            "device" naming the rank whose copy is corrupted (where that cannot be told there is
            no Attribution: the finding's message names the ranks that disagree and what to check).
        rank: the rank whose step was rerun (None outside torch.distributed).
        host: that rank's host name.
        device: the device the step ran on (e.g. "cuda:3", "cpu").
        batch_number: the 0-indexed batch that was rerun.
        detail: what the rerun saw, in words.
    """

    verdict: str
    rank: int | None
    host: str
    device: str
    batch_number: int | None
    detail: str

    def __post_init__(self):
        if self.verdict not in VERDICTS:
            raise ValueError(f"numguard.Attribution: verdict={self.verdict!r} is not one of {VERDICTS}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def __str__(self):
        where = f"rank {self.rank} " if self.rank is not None else ""
        return (f"{self.verdict} (batch_number={self.batch_number}, {where}on {self.host} {self.device}): "
                f"{self.detail}")


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
        attribution: with watch(rerun=True) or numguard.rerun_step, a numguard.Attribution (the
            rerun's verdict); None when no rerun ran.
    """

    def __init__(self, message: str, *, report: str = "", batch_number: int | None = None,
                 module: str | None = None, labels=(), rank: int | None = None, ranks=(),
                 fault_rank: int | None = None, fault_kind: str | None = None,
                 own_module: str | None = None, attribution: Attribution | None = None):
        super().__init__(message)
        self.attribution = attribution
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
    """on_trip="warn" or "dump" (or a transient fault a rerun recovered): a watched tensor held NaN
    or +-Inf; training goes on. `attribution`: the rerun's numguard.Attribution, or None."""

    def __init__(self, message, attribution=None):
        super().__init__(message)
        self.attribution = attribution


class HeadroomWarning(UserWarning):
    """A low-precision tensor came close to its dtype's largest finite value."""


class SpikeWarning(UserWarning):
    """watch(spikes=True): a module's value jumped far outside its own recent range (NOTE: [spike
    rule] in numguard.inspector.spikes). `spike`: module, class, quantity, value, baseline, factor,
    batch, rank. `attribution`: with rerun=True, the rerun's numguard.Attribution (else None)."""

    def __init__(self, message, spike=None, attribution=None):
        super().__init__(message)
        self.spike = spike
        self.attribution = attribution


class SpikeError(RuntimeError):
    """watch(spikes="raise"): as SpikeWarning, raised; `spike` says where."""

    def __init__(self, message, spike=None, attribution=None):
        super().__init__(message)
        self.spike = spike
        self.attribution = attribution


class InspectorWarning(UserWarning):
    """numguard could not watch part of a model (it stops watching that part; training goes on)."""
