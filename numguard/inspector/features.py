"""The lifecycle every optional part of a watch() implements.

The Inspector knows its features by this protocol only: it calls each one in turn at the points
below and never asks which kind it is. A feature is built with what it needs (the inspector, the
ring's device) and added to ``Inspector.features``; a new one is a module with its class and one
line in ``core._add_features``. The features today: the history and spike detector
(``watched_history.HistoryFeature``), replay's input keeper (``replay.InputKeeper``), the root's
rerun (``rerun.RootRerun``), frames inside compiled graphs (``graph.GraphRecorder``), operation
mode (``operations.OperationRecorder``), gradient watching (``gradients.BackwardWatcher``), the
low-precision what-if (``quant_watch.QuantWatch``) and the normalization layers' running
statistics (``norm_stats.NormStatsWatch``).

A feature's own failure is its own: the methods below handle it (warn, switch the feature off)
and never raise into the training step, except where the user asked for an error (SpikeError).
"""
from __future__ import annotations


class Feature:
    """No-op defaults: a feature overrides the points it acts at."""

    def begin_batch(self, batch: int) -> None:
        """A root forward begins batch `batch` (0-indexed)."""

    def end_batch(self, batch: int) -> None:
        """The root forward of batch `batch` returned; called before the batch-end check."""

    def device_moved(self, device) -> None:
        """The model (and so the ring) moved to `device` after watch(): start over there."""

    def check_read(self, status) -> None:
        """A check read the state (a checks.CheckStatus); called before a trip is handled."""

    def parameter_gradients(self, labels, grads) -> None:
        """backward=True recorded the parameter gradients an optimizer is about to apply (labels
        ``<parameter name>.grad``); called before that step's check."""

    def frames_confirmed(self, ring, start: int, boundary: int) -> None:
        """A check found `ring.frames[start:boundary]` finite (nothing tripped)."""

    def annotate_report(self, report: dict, offender: int, frames: list) -> None:
        """Add fields to a trip's report before it is rendered: `frames[offender]` tripped (the
        report's frames: with a compiled model, the ring's merged with the graphs', so never an
        index into the ring itself)."""

    def close(self) -> None:
        """The Inspector closes: remove what this feature installed (idempotent)."""


__all__ = ["Feature"]
