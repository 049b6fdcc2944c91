"""A trip's report (numguard.dump's schema, read by numguard.report, plot and advice), built from the
ring's host copy: the frames before the offender (Transformers' last N frames, weights first), the
operation blamed with ops=True, and the run's settings."""
from __future__ import annotations

from .. import ops
from .. import process as _process
from .. import report as _report
from ..report_types import ABSENT, Operation, Report, ReportFrame, ReportLine
from ..schema import LineKind
from . import blame as _blame
from . import operations as _operations
from .frames import EXTRA
from .ring import record_at

OPERATION_FRAMES = 6  # operation frames shown: the first bad operation and those just before it


def _operation_summary(frame: ReportFrame) -> Operation:
    """The first bad operation of an operations frame: its name, call site, and the largest
    input and the output as ``x.abs().max()`` would show them (None when not recorded)."""
    inputs, outputs = [], []
    for line in frame.lines:
        if line.record is None:
            continue
        shown = _report.shown_abs_min_max(line.record)[1]
        (inputs if line.label.startswith("input") else outputs).append(shown)
    bad_out = [v for v in outputs if v != v or v == float("inf")]
    return Operation(op=frame.op, module=frame.name, class_name=frame.class_name, site=frame.site,
                     backward_of=None if frame.backward_of is ABSENT else frame.backward_of,
                     input_abs_max=max(inputs, key=lambda v: (v != v, v)) if inputs else None,
                     output_abs_max=bad_out[0] if bad_out else (max(outputs) if outputs else None))


class ReportBuilder:
    """Builds reports from a FrameRing, its WeightTable and the watch() options; owns
    nothing on the device. `lineage`: operation mode's (operations.OperationRecorder.lineage)."""

    def __init__(self, ring, weights, options, reader):
        self.ring = ring
        self.weights = weights
        self.options = options
        self.reader = reader
        self.lineage = None

    def frame_record(self, f, host_ring, tables, valid_end) -> dict:
        """One frame as the report's dictionary has it (for trace printing)."""
        return self.frame_entry(f, host_ring, tables, valid_end).to_json()

    def frame_entry(self, f, host_ring, tables, valid_end, in_report=ABSENT, offender=ABSENT) -> ReportFrame:
        """One frame of a report (weights first, like Transformers)."""
        owner = f.owner
        lines = []
        table = tables.get(f.batch)
        # The rows of the layout of the frame's batch (a lazy module's parameters made since moved them).
        wnames, widx = (owner.wnames, owner.widx) if table is None else table[1].get("rows", {}).get(
            id(getattr(owner, "source", owner)), ((), ()))   # a compiled module's frame: its eager owner's
        if f.with_weights and widx:
            for name, w in zip(wnames, widx):
                if table is not None and w < len(table[0]):
                    lines.append(ReportLine(label=name, kind=LineKind.TENSOR, record=[float(v) for v in table[0][w]],
                                            dtype=table[1]["dtypes"][w], shape=table[1]["shapes"][w]))
                else:
                    lines.append(ReportLine(label=name, kind=LineKind.TENSOR, record=None))
        t = 0
        for label, code in zip(f.labels, f.kinds):
            kind = LineKind.of(code)
            extra = bool(code & EXTRA) or not f.hf
            if kind is LineKind.TENSOR:
                lines.append(ReportLine(label=label, kind=kind, extra=extra, dtype=str(f.dtypes[t]),
                                        shape=list(f.shapes[t]), record=record_at(host_ring, f.positions[t], valid_end)))
                t += 1
            else:
                lines.append(ReportLine(label=label, kind=kind, extra=extra, record=None))
        op = getattr(owner, "op", None)
        op_fields = {}
        if op is not None:  # an operation frame (ops=True)
            op_fields = {"op": op, "site": owner.site}
            if owner.backward_of is not None:
                op_fields["backward_of"] = owner.backward_of
        return ReportFrame(name=owner.name, class_name=owner.cls, section=f.section, batch=f.batch,
                           batch_start=f.batch_start, hf=bool(f.hf), lines=tuple(lines), in_report=in_report,
                           offender=offender, **op_fields)

    def build_report(self, offender, host_ring, found_at=None, view=None) -> dict:
        """The report dictionary (numguard.dump's schema: report_types.Report.to_json) for the
        frame at index `offender` of `view`'s frames (the ring's, or graph.ReportView's with
        compiled graphs' frames). A dictionary: features add their fields to it, and users
        index it (Inspector.last_report)."""
        view = view or self.ring
        frames = view.frames
        off = frames[offender]
        section = off.section
        max_frames = self.options.max_frames_to_save
        chosen = set()
        floor = min(view.floor, offender)
        valid_end = off.start + off.n_records  # the ring froze after the offending frame
        blamed = None
        if self.lineage is not None and view is self.ring and getattr(off.owner, "op", None) is None:
            blamed = _blame.blame_operation(frames, self.ring.floor, self.lineage, offender, host_ring, valid_end)
        anchors = [("forward", offender), (section, offender)]
        if blamed is not None:
            anchors.append((frames[blamed].section, blamed))
        for want, anchor in anchors:
            count = 0
            j = anchor
            # Operation frames: the offender and the few just before it.
            limit = (min(max_frames, OPERATION_FRAMES)
                     if want in (_operations.SECTION, _operations.BACKWARD_SECTION) else max_frames)
            while j >= floor and count < limit:
                f = frames[j]
                if f.section == want:
                    if want != "forward" or f.hf:
                        count += 1
                    chosen.add(j)
                j -= 1
        lo = min(chosen) if chosen else offender
        tables = self.weights.host_tables({frames[j].batch for j in range(lo, offender + 1)})
        out_frames = [self.frame_entry(frames[j], host_ring, tables, valid_end, in_report=j in chosen,
                                       offender=j == offender) for j in range(lo, offender + 1)]
        offender_frame = out_frames[-1]
        bad = [line.label for line in offender_frame.lines if _report.is_nonfinite(line.record)]
        batch = off.batch
        hf_batch = batch + (1 if (off.owner.is_root and section == "forward" and off.hf) else 0)
        operation = ABSENT
        if offender_frame.op is not ABSENT:
            operation = _operation_summary(offender_frame)
        elif blamed is not None:
            operation = _operation_summary(out_frames[blamed - lo])
        return Report(
            batch_number=hf_batch, batch=batch, found_at_batch=found_at,
            check=self.options.check, check_every=self.options.check_every, where=self.reader.where,
            rank=_process.rank(default=None), ranks=[],
            module=off.owner.name, class_name=off.owner.cls, labels=bad, section=_blame.pass_of(section),
            max_frames_to_save=max_frames, headroom=self.options.headroom,
            backend=ops.backend(), frames=out_frames, operation=operation,
        ).to_json()


__all__ = ["ReportBuilder", "OPERATION_FRAMES"]
