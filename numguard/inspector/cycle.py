"""An Inspector's batch life cycle: what happens when a batch begins and ends, when the model
moves, and at a check (read the state, then report a trip or confirm the frames).

The module hooks (numguard.inspector.hooks) call ``begin_batch``, ``end_batch``,
``end_direct_call`` and ``after_raised_forward``; the gradient watcher and the user call
``check``, ``check_now`` and ``forget_trip_from`` through the Inspector. Each point calls the
features (numguard.inspector.features) in their order.
"""
from __future__ import annotations

import sys
import warnings

from ..errors import AbortAfterBatch, InspectorWarning, NonFiniteError, SpikeError
from . import checks as _checks
from . import frames as _frames
from .checks import FlagReader
from .graph import GraphRecorder
from .ring import FrameRing
from .trips import Reporter
from .weights import WeightTable


def _is_distributed_failure(exc: BaseException) -> bool:
    errors = sys.modules.get("numguard.distributed.errors")  # loaded only when distributed is in use
    return errors is not None and isinstance(exc, errors.DistributedOperationException)


class BatchCycle:
    """The ring, weight table, flag reader and reporter of one Inspector, and the batch life cycle
    that ties them together.

    Args:
        options: the Inspector's WatchOptions.
        batch: the BatchState the module hooks hold.
        owners: the modules' owners (filled by the hooks' install), for the weight table.
        features: the Inspector's features, called in order at each point.
        device: where the ring starts (the model's device).
        inputs_trip: whether a module's non-finite input trips by itself (NOTE: [context records]).
        on_trip_reported: ``f(report, frames_after)`` once a trip's report is built.
        abort_message: ``f(batch)``, the text of abort_after_batch_num's exception.
    """

    def __init__(self, options, batch, owners, features, device, inputs_trip, on_trip_reported, abort_message):
        self.options = options
        self.batch = batch
        self.features = features
        self.warned = set()
        self.graph = None                 # the GraphRecorder (frames inside compiled graphs), or None
        self.gradients = None             # the BackwardWatcher of backward=True, or None
        self.on_trip_reported = on_trip_reported
        self.abort_message = abort_message
        self.ring = FrameRing(max(64, 8 * options.max_frames_to_save), device,
                              on_drop=self.frames_dropped, on_unchecked=self.unchecked_tensor,
                              inputs_trip=inputs_trip)
        self.weights = WeightTable(owners, options.headroom, on_unchecked=self.unchecked_tensor)
        self.reader = FlagReader(self.ring, options.check, self.warned)
        self.reader.skipped_steps = lambda: getattr(self.gradients, "scaler_skipped_steps", 0)
        self.reporter = Reporter(self.ring, self.weights, options, self.warned, self.reader)
        self.reporter.annotate = self.annotate_report

    def batch_index(self) -> int:
        """The 0-indexed current batch (Inspector.batch_number)."""
        if self.batch.depth > 0 or self.batch.done == 0:
            return self.batch.done
        return self.batch.done - 1

    def warn_once(self, key, message):
        if key not in self.warned:
            self.warned.add(key)
            warnings.warn(message, InspectorWarning, stacklevel=4)

    def unchecked_tensor(self, owner, label, tensor):
        self.warn_once(*_frames.unchecked_warning(owner, label, tensor))  # once per module and label

    def guarded(self, fn, *args):
        try:
            return fn(*args)
        except (NonFiniteError, AbortAfterBatch, SpikeError):  # what the user asked numguard to raise
            raise
        except Exception as exc:
            if _is_distributed_failure(exc):
                # Ranks disagree or one never arrived: going on would hang the next collective.
                raise
            name = fn.__name__.strip("_").replace("_", " ")
            self.warn_once(("internal", fn.__name__),
                           f"numguard: {name} failed ({type(exc).__name__}: {exc}); training goes on")
            return None

    # -- what the hooks call -----------------------------------------------------------------------
    def begin_batch(self):
        self.batch.open = True
        for feature in self.features:
            feature.begin_batch(self.batch.done)
        self.weights.record_or_stop(self.batch.done, self.ring, self.move_to, self.warn_once)

    def move_to(self, device):
        self.ring.move_to(device)
        self.reader.device_moved()
        self.weights.forget()
        for feature in self.features:
            feature.device_moved(device)

    def frames_dropped(self, cut):
        self.reader.frames_dropped(cut)
        frames = self.ring.frames
        self.weights.drop_before(frames[0].batch if frames else self.batch.done)

    def end_batch(self):
        batch = self.batch.done
        self.batch.done += 1
        self.batch.open = False
        self.ring.forget_seen()
        self.ring.pending_start = self.batch.done
        for feature in self.features:
            self.guarded(feature.end_batch, batch)
        traced = batch in self.options.trace_batch_nums
        if traced:
            self.guarded(self.reporter.print_trace, batch)
        watcher = self.gradients
        if self.batch.done % self.options.check_every == 0 and (
                watcher is None or not watcher.takes_batch_end_check()):
            self.guarded(self.check, "batch end")
        if traced:
            # Like Transformers, a later report does not reach back into a traced batch.
            self.ring.floor = len(self.ring.frames)
        limit = self.options.abort_after_batch_num
        if limit is not None and batch >= limit:
            raise AbortAfterBatch(self.abort_message(batch))

    def end_direct_call(self, owner):
        """A watched module called outside the root's forward has returned: check now, or its NaN
        would wait for a root call that may never come."""
        self.batch.open = False
        self.ring.forget_seen()
        self.guarded(self.check, f"{owner.name or '(root module)'} ({owner.cls}) {_checks.OUTSIDE_ROOT}")

    def after_raised_forward(self, exc):
        """The root forward raised. A trip another inspector already raised (or an abort) is not
        reported twice; otherwise a NaN recorded before the exception is reported now, as a
        warning (this rank only: the other ranks are not at a check), while the exception goes on."""
        self.batch.open = False
        self.ring.forget_seen()
        if isinstance(exc, (NonFiniteError, AbortAfterBatch)):
            self.ring.reset_after_trip()
            self.reporter.forget_graph_frames()
            return
        status = self.reader.read_local(f"the forward raised {type(exc).__name__}", self.batch_index())
        if status.tripped:
            on_trip = self.options.on_trip
            self.reporter.handle_trip(status, self.ring.host_copy(), on_report=self.on_trip_reported,
                                      on_trip="warn" if on_trip == "raise" else on_trip)

    # -- checks --------------------------------------------------------------------------------------
    def check(self, where="batch end"):
        if self.batch.closed:
            return
        if self.options.check == "sync":
            self._handle(self.reader.read_now(where, self.batch_index()))
            return
        status = self.reader.read_async(where, self.batch_index())
        if status is not None:
            self._handle(status)
            if self.batch.closed:
                return
        self.reader.issue_async_copy(self.batch_index())

    def check_now(self, where):
        if self.batch.closed:
            return
        self.reader.forget_pending()
        self._handle(self.reader.read_now(where, self.batch_index()))

    def forget_trip_from(self, position, where):
        if self.batch.closed:
            return
        self.ring.merge_devices()  # other devices' trips too (NOTE: [one ring per device])
        tripped, first = self.ring.state[:2].tolist()
        if not tripped:
            return
        # A graph record is forgotten when it is a gradient's (the graphs' forward frames come first).
        if first < position or (GraphRecorder.owns(first) and not self.graph.records_gradient_at(first)):
            self.check_now(where)
        else:
            self.ring.reset_after_trip()
            self.reporter.forget_graph_frames()

    def _handle(self, status):
        for feature in self.features:
            feature.check_read(status)
        host_ring = None
        if status.headroom_hit:
            host_ring = self.ring.host_copy()
            self.guarded(self.reporter.handle_headroom, host_ring, status.boundary)
        if status.any_trip:
            if host_ring is None and status.tripped:
                host_ring = self.ring.host_copy()
            self.reporter.handle_trip(status, host_ring, on_report=self.on_trip_reported)
        else:
            for feature in self.features:
                feature.frames_confirmed(self.ring, self.ring.last_check_frames, status.boundary)
            self.ring.keep_context(status.boundary, self.options.max_frames_to_save)

    def annotate_report(self, report, offender, frames):
        """Fields the features add to a trip's report before it is rendered (the module history;
        with replay=True the replay of the first bad module; with rerun=True the rerun's verdict)."""
        for feature in self.features:
            feature.annotate_report(report, offender, frames)


__all__ = ["BatchCycle"]
