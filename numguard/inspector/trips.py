"""What happens when the flag is up: the report (numguard.inspector.report_builder) rendered and
the on_trip action (raise / warn / dump), the cross-rank fault named (numguard.inspector.blame),
headroom warnings, and trace printing."""
from __future__ import annotations

import sys
import warnings

from .. import schema
from .. import process as _process
from .. import report as _report
from ..errors import HeadroomWarning, InspectorWarning, NonFiniteError, NonFiniteWarning
from ..report_types import FirstFault, FrameworkStep
from . import blame as _blame
from . import checks
from .frames import TENSOR
from .options import STDOUT
from .report_builder import ReportBuilder
from .ring import record_at
from .weights import LOW_PRECISION_MAX


class Reporter:
    """Turns a tripped state into a report and the configured action. Owns nothing on the device:
    it reads the FrameRing and the WeightTable it is given."""

    def __init__(self, ring, weights, options, warned, reader):
        self.ring = ring
        self.weights = weights
        self.options = options
        self.warned = warned
        self.reader = reader
        self.builder = ReportBuilder(ring, weights, options, reader)
        self.trips = 0                    # trips handled (on_trip warn/dump go on after one)
        self.last_report = None
        self.trip_message = None          # the NonFiniteError text, when the caller wants its own
        self.step_counter = None          # (label, read): a framework's step, shown next to the batch
        self.annotate = None              # annotate(report, offender, frames): adds fields before rendering
        self.attribution = lambda rerun: None   # rerun field -> numguard.Attribution (watch(rerun=True))
        self.settle = None   # (rerun field, first fault's rank, shared, tripped) -> the field every rank gives
        self.graph = None                 # the inspector's GraphRecorder (frames inside compiled graphs)

    def forget_graph_frames(self):
        if self.graph is not None:
            self.graph.forget_frames()

    # -- a trip ----------------------------------------------------------------------------------
    def handle_trip(self, status, host_ring, on_trip=None, on_report=None):
        """Report the trip `status` read, reset the ring, then raise / warn / dump. `on_report(
        report, frames_after_offender)` is told of the report before the ring is reset."""
        on_trip = on_trip or self.options.on_trip
        report = None
        module = None
        labels = []
        batch = None
        view, offender = self.ring, None
        if status.tripped:
            view = self.ring
            if self.graph is not None and self.graph.used:
                # Frames recorded inside compiled graphs: only now are their log and ring read.
                view, host_ring = self.graph.report_view(self.ring, host_ring)
            offender = view.find_offender(status.first_trip)
            if offender is not None:
                try:
                    report = self.builder.build_report(offender, host_ring, status.found_at, view)
                except Exception as exc:  # the NaN is real even if numguard cannot render it
                    off = view.frames[offender]
                    module, batch = off.owner.name, off.batch
                    warnings.warn(f"numguard: could not render the report ({type(exc).__name__}: {exc})",
                                  InspectorWarning, stacklevel=5)
                else:
                    module = report["module"]
                    labels = report["labels"]
                    batch = report["batch"]
                    if self.annotate is not None:
                        try:
                            self.annotate(report, offender, view.frames)
                        except Exception as exc:  # extra fields never hide the trip
                            warnings.warn(f"numguard: could not add the history/replay to the report "
                                          f"({type(exc).__name__}: {exc})", InspectorWarning, stacklevel=5)
                    if on_report is not None:
                        on_report(report, sum(1 for f in view.frames[offender + 1:] if f.hf))
            else:
                module = "(frames no longer in the ring)"
        kind, ordinal = None, 0
        if offender is not None and status.tripped:
            kind = _blame.fault_kind(view.frames[offender])
            ordinal = _blame.fault_ordinal(view.frames, offender, kind)
        ranks = []
        exchange = checks.trip_exchange(self.warned) if status.others else None
        if exchange is not None:
            ranks = exchange.gather_trip_details(module if status.tripped else None,
                                                     batch if batch is not None else status.found_at,
                                                     tripped=status.tripped, kind=kind, ordinal=ordinal,
                                                     labels=labels)
        rank = _process.rank(default=None)
        me = rank  # the details' ranks are the default group's, as numguard.process.rank()
        # The fault every rank names: the earliest across ranks (NOTE: [earliest fault]).
        first, elsewhere = _blame.earliest_elsewhere(
            ranks, me, exchange.earliest_fault if exchange is not None else None)
        step = self._framework_step()
        rerun = report.get("rerun") if report is not None else None
        if self.settle is not None:   # watch(rerun=True): every rank's verdict (NOTE: [device verdict])
            try:
                rerun = self.settle(rerun, first[0] if first is not None else None, exchange is not None,
                                    status.tripped)
            except Exception as exc:  # the verdict is lost, never the trip
                warnings.warn(f"numguard: the cross-rank rerun verdict failed ({type(exc).__name__}: {exc})",
                              InspectorWarning, stacklevel=5)
            if report is not None and rerun is not None:
                report["rerun"] = rerun
        if report is not None:
            report["ranks"] = [list(r) for r in ranks]
            if first is not None:
                report["first_fault"] = FirstFault(rank=first[0], module=first[1], labels=list(first.labels),
                                                   kind=first.kind, batch=first.batch,
                                                   this_rank=not elsewhere).to_json()
            if step is not None:
                report["framework_step"] = FrameworkStep(name=step[0], value=step[1]).to_json()
        self.last_report = report
        self.ring.reset_after_trip()
        self.forget_graph_frames()
        text = _report.render(report, self.options.extras) if report is not None else ""
        self.trips += 1
        if text:
            self.emit(text)
        step_text = f" ({step[0]}={step[1]})" if step is not None else ""
        if report is not None and self.trip_message is not None:
            msg = self.trip_message
        elif elsewhere:
            msg = _blame.elsewhere_message(first, ranks, me, kind, labels, step_text,
                                          batch if batch is not None else status.found_at)
        elif report is not None:
            on_rank = f" on rank {rank}" if rank is not None else ""
            operation = report.get("operation")
            op_text = f" by operation {operation['op']}{_report.op_where(operation)}" if operation else ""
            replayed = report.get("replay")
            if not operation and replayed and replayed.get("reproduced"):
                op_text = (f" by operation {replayed['op']}" + (f" at {replayed['site']}" if replayed["site"] else "")
                           + " (found by replay)")
            msg = (f"numguard: inf/nan detected{on_rank} during batch_number={report['batch']}{step_text} in "
                   f"{module if module else '(root module)'} ({report['class']}) "
                   f"[{', '.join(labels)}]{op_text}; the report above shows the frames that led to it")
            carried = [d for d in ranks if d[0] != me]
            if carried:
                msg += "; " + _blame.carried_text(carried)
        else:
            tripping = [i for i, v in enumerate(status.others) if v]
            names = ", ".join(f"rank {r}" for r in tripping)
            msg = (f"numguard: inf/nan detected on {names}; that rank printed the report "
                   "(this rank's values were finite)")
        fault_rank = first[0] if first is not None else rank
        if first is not None:
            fault_module, fault_labels, fault_kind_ = first[1], list(first.labels), first.kind
            fault_batch = first.batch if first.batch is not None else status.found_at
        else:
            fault_module, fault_labels, fault_kind_ = (module if status.tripped else None), labels, kind
            fault_batch = batch if batch is not None else status.found_at
        attribution = self.attribution(rerun) if rerun else None
        if rerun:
            msg += "; " + _report.rerun_text(rerun)
            if rerun.get("recovered"):
                on_trip = "warn"   # the rerun's output replaced the corrupted one (NOTE: [rerun verdict])
        if on_trip == "raise":
            raise NonFiniteError(msg, report=text, batch_number=fault_batch, module=fault_module,
                                 labels=fault_labels, rank=rank, ranks=[r for r, _ in ranks],
                                 fault_rank=fault_rank, fault_kind=fault_kind_,
                                 own_module=module if status.tripped else None, attribution=attribution)
        if on_trip == "dump" and report is not None:
            # Whatever goes wrong writing the file, the trip itself is still reported below.
            try:
                from .. import dump as _dump
                path = _dump.write(report, self.options.dump_dir, rank=rank)
                msg += f"; report written to {path}"
            except Exception as exc:
                msg += (f"; could not write the dump file ({type(exc).__name__}: {exc}): fix "
                        f"dump_dir={self.options.dump_dir!r}")
        warnings.warn(NonFiniteWarning(msg, attribution), stacklevel=5)

    def _framework_step(self):
        """(label, value) of the step counter, or None; a counter that cannot be read is skipped
        (it must never hide the trip)."""
        if self.step_counter is None:
            return None
        label, read = self.step_counter
        try:
            value = read()
        except Exception:
            return None
        return None if value is None else (label, value)

    def emit(self, text):
        """Print a report or trace to report_to; a failing target never hides the trip."""
        target = self.options.report_to
        if target is None:
            return
        try:
            if target is STDOUT:
                print(text, file=sys.stdout, flush=True)
            elif callable(target) and not hasattr(target, "write"):
                target(text)
            else:
                print(text, file=target, flush=True)
        except Exception as exc:
            warnings.warn(f"numguard: could not print the report to report_to={target!r} "
                          f"({type(exc).__name__}: {exc}); it is still on the exception and in last_report",
                          InspectorWarning, stacklevel=5)

    # -- headroom --------------------------------------------------------------------------------
    def handle_headroom(self, host_ring, boundary):
        """Warn for each module whose low-precision tensor passed `headroom` of its dtype's
        largest value (a module warns once), then re-arm the flags."""
        ring = self.ring
        limit = self.options.headroom
        reported = set()  # a tensor seen by several modules is reported for the first (its producer)
        frames = ring.frames[:boundary]
        if self.graph is not None and self.graph.used:
            # With the frames recorded inside compiled graphs (their log and ring read only now).
            view, host_ring = self.graph.report_view(ring, host_ring)
            frames = view.frames
        for f in frames:
            owner = f.owner
            if owner.headroom == 0.0:
                continue
            t = 0
            for label, kind in zip(f.labels, f.kinds):
                if kind & schema.LINE_KIND_MASK != TENSOR:
                    continue
                dtype = f.dtypes[t]
                p = f.positions[t]
                t += 1
                dmax = LOW_PRECISION_MAX.get(dtype)
                if dmax is None or p in reported:
                    continue
                record = record_at(host_ring, p, ring.pos)
                if record is None:
                    continue
                reported.add(p)
                value = record[schema.ABS_MAX]
                if value > limit * dmax:
                    self._warn_headroom(owner, label, value, dtype, dmax)
                    break
        for owner, name, value, dtype in self.weights.over_headroom(limit):
            self._warn_headroom(owner, name, value, dtype, LOW_PRECISION_MAX[dtype], weight=True)
        ring.clear_headroom()

    def _warn_headroom(self, owner, label, value, dtype, dmax, weight=False):
        if not weight:
            owner.headroom = 0.0  # warn once per module: this module no longer raises the flag
        key = ("headroom", id(owner), label if weight else None)
        if key in self.warned:
            return
        self.warned.add(key)
        name = owner.name or "(root module)"
        warnings.warn(f"numguard: {name} ({owner.cls}) {label} reached abs max {value:.4g}, "
                      f"{value / dmax:.0%} of {str(dtype).replace('torch.', '')}'s largest finite value "
                      f"{dmax:.6g} (headroom={self.options.headroom}); it may overflow soon: consider loss "
                      "scaling, a wider dtype for this module, or smaller activations", HeadroomWarning,
                      stacklevel=5)

    def worst_headroom(self) -> float:
        """See Inspector.worst_headroom."""
        ring = self.ring
        wanted = [(position % ring.size, LOW_PRECISION_MAX[dtype])
                  for f in ring.frames for dtype, position in zip(f.dtypes, f.positions)
                  if dtype in LOW_PRECISION_MAX and ring.valid(position, ring.pos)]
        if not wanted:
            return 0.0
        host = ring.host_copy()
        worst = 0.0
        for row, dmax in wanted:
            record = host[row]
            if record[schema.NAN] + record[schema.POS_INF] + record[schema.NEG_INF] > 0:
                return float("inf")
            worst = max(worst, float(record[schema.ABS_MAX]) / dmax)
        return worst

    # -- trace mode ------------------------------------------------------------------------------
    def print_trace(self, batch):
        """Print every forward frame of `batch` in Transformers' trace format."""
        view, host_ring = self.ring, None
        if self.graph is not None and self.graph.used:
            view, host_ring = self.graph.report_view(self.ring, self.ring.host_copy())
        frames = view.frames
        first = None
        for i in range(len(frames) - 1, view.floor - 1, -1):
            if frames[i].batch != batch:
                break
            first = i
        if first is None:
            return
        if host_ring is None:
            host_ring = self.ring.host_copy()
        tables = self.weights.host_tables({batch})
        records = [self.builder.frame_record(f, host_ring, tables, self.ring.pos) for f in frames[first:]
                   if f.section == "forward"]
        self.emit(_report.render_trace(records, self.options.extras)[:-1])
