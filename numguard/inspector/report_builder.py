"""A trip's report (numguard.dump's schema, read by numguard.report, plot and advice), built from the
ring's host copy: the frames before the offender (Transformers' last N frames, weights first), the
operation blamed with ops=True, and the run's settings."""
from __future__ import annotations

from .. import ops, schema
from .. import process as _process
from .. import report as _report
from . import blame as _blame
from . import operations as _operations
from .frames import EXTRA
from .ring import record_at

OPERATION_FRAMES = 6  # operation frames shown: the first bad operation and those just before it


def _operation_summary(frame):
    """The first bad operation of an operations frame: its name, call site, and the largest
    input and the output as ``x.abs().max()`` would show them (None when not recorded)."""
    inputs, outputs = [], []
    for label, record in zip(frame["labels"], frame["records"]):
        if record is None:
            continue
        shown = _report.shown_abs_min_max(record)[1]
        (inputs if label.startswith("input") else outputs).append(shown)
    bad_out = [v for v in outputs if v != v or v == float("inf")]
    return {"op": frame["op"], "module": frame["name"], "class": frame["class"], "site": frame["site"],
            "backward_of": frame.get("backward_of"),
            "input_abs_max": max(inputs, key=lambda v: (v != v, v)) if inputs else None,
            "output_abs_max": bad_out[0] if bad_out else (max(outputs) if outputs else None)}


class ReportBuilder:
    """Builds report dictionaries from a FrameRing, its WeightTable and the watch() options; owns
    nothing on the device. `lineage`: operation mode's (operations.OperationRecorder.lineage)."""

    def __init__(self, ring, weights, options, reader):
        self.ring = ring
        self.weights = weights
        self.options = options
        self.reader = reader
        self.lineage = None

    def frame_record(self, f, host_ring, tables, valid_end):
        """One frame as a report dict entry (weights first, like Transformers)."""
        owner = f.owner
        labels, kinds, dtypes, shapes, records, extra = [], [], [], [], [], []
        if f.with_weights and owner.widx:
            table = tables.get(f.batch)
            for name, w in zip(owner.wnames, owner.widx):
                labels.append(name)
                kinds.append(schema.KIND_TENSOR)
                extra.append(False)
                if table is not None and w < len(table[0]):
                    records.append([float(v) for v in table[0][w]])
                    dtypes.append(table[1]["dtypes"][w])
                    shapes.append(table[1]["shapes"][w])
                else:
                    records.append(None)
                    dtypes.append(None)
                    shapes.append(None)
        t = 0
        for label, kind in zip(f.labels, f.kinds):
            base = schema.LineKind.of(kind)
            labels.append(label)
            kinds.append(base.report_name)
            extra.append(bool(kind & EXTRA) or not f.hf)
            if base is schema.LineKind.TENSOR:
                p = f.positions[t]
                records.append(record_at(host_ring, p, valid_end))
                dtypes.append(str(f.dtypes[t]))
                shapes.append(list(f.shapes[t]))
                t += 1
            else:
                records.append(None)
                dtypes.append(None)
                shapes.append(None)
        out = {"name": owner.name, "class": owner.cls, "section": f.section, "batch": f.batch,
               "batch_start": f.batch_start, "hf": bool(f.hf), "labels": labels, "kinds": kinds,
               "extra": extra, "dtypes": dtypes, "shapes": shapes, "records": records}
        op = getattr(owner, "op", None)
        if op is not None:  # an operation frame (ops=True)
            out["op"] = op
            out["site"] = owner.site
            if owner.backward_of is not None:
                out["backward_of"] = owner.backward_of
        return out

    def build_report(self, offender, host_ring, found_at=None, view=None) -> dict:
        """The report dictionary (numguard.dump's schema) for the frame at index `offender` of
        `view`'s frames (the ring's, or graph.ReportView's with compiled graphs' frames)."""
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
        out_frames = []
        for j in range(lo, offender + 1):
            fr = self.frame_record(frames[j], host_ring, tables, valid_end)
            fr["in_report"] = j in chosen
            fr["offender"] = j == offender
            out_frames.append(fr)
        offender_frame = out_frames[-1]
        bad = [lab for lab, rec in zip(offender_frame["labels"], offender_frame["records"])
               if _report.is_nonfinite(rec)]
        batch = off.batch
        hf_batch = batch + (1 if (off.owner.is_root and section == "forward" and off.hf) else 0)
        report = {
            "format": "numguard-report", "version": 1,
            "batch_number": hf_batch, "batch": batch, "found_at_batch": found_at,
            "check": self.options.check, "check_every": self.options.check_every, "where": self.reader.where,
            "rank": _process.rank(default=None), "ranks": [],
            "module": off.owner.name, "class": off.owner.cls, "labels": bad, "section": _blame.pass_of(section),
            "max_frames_to_save": max_frames, "headroom": self.options.headroom,
            "backend": ops.backend(), "frames": out_frames,
        }
        if "op" in offender_frame:
            report["operation"] = _operation_summary(offender_frame)
        elif blamed is not None:
            report["operation"] = _operation_summary(out_frames[blamed - lo])
        return report


__all__ = ["ReportBuilder", "OPERATION_FRAMES"]
