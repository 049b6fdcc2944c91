"""What happens when the flag is up: the report (numguard.dump's schema) built from the ring's
host copy, the on_trip action (raise / warn / dump), headroom warnings, and trace printing."""
from __future__ import annotations

import sys
import warnings

from .. import ops, schema
from .. import process as _process
from .. import report as _report
from ..errors import HeadroomWarning, InspectorWarning, NonFiniteError, NonFiniteWarning
from . import checks
from . import operations as _operations
from .frames import EXTRA, TENSOR, is_parameter_gradients
from .options import STDOUT
from .weights import LOW_PRECISION_MAX

_KIND_NAMES = schema.LINE_KINDS  # indexed by frames.TENSOR, NONE, NOT_A_TENSOR
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


def _pass_of(section):
    """The pass a frame's section belongs to: operation frames are frames of the forward (or
    backward) pass, and the report says so rather than "operations pass"."""
    if section == _operations.SECTION:
        return "forward"
    if section == _operations.BACKWARD_SECTION:
        return "backward"
    return section


def fault_kind(frame):
    """What a frame's non-finite value was (schema.FAULT_KINDS): a forward frame's, a gradient
    tapped in the backward, or the parameter gradients recorded before the optimizer step
    (numguard.backward labels them ``<parameter>.grad``)."""
    if _pass_of(frame.section) != "backward":
        return schema.FAULT_FORWARD
    if is_parameter_gradients(frame):
        return schema.FAULT_PARAMETER_GRADIENT
    return schema.FAULT_GRADIENT


def fault_ordinal(frames, offender, kind):
    """Frames of `kind` in the offender's batch before it (NOTE: [earliest fault] in
    numguard.distributed.coordination: ranks running the same step compare it)."""
    off = frames[offender]
    count = 0
    for j in range(offender - 1, -1, -1):
        f = frames[j]
        if f.batch != off.batch:
            break
        if fault_kind(f) == kind:
            count += 1
    return count


def _record_at(host_ring, position, valid_end):
    """The host record at `position` (None once overwritten): a ring's host copy, or
    graph.HostRecords when compiled graphs' frames are in the report."""
    lookup = getattr(host_ring, "record_at", None)
    if lookup is not None:
        return lookup(position)
    size = host_ring.shape[0]
    return None if position < valid_end - size else [float(v) for v in host_ring[position % size]]


class Reporter:
    """Turns a tripped state into a report and the configured action. Owns nothing on the device:
    it reads the FrameRing and the WeightTable it is given."""

    def __init__(self, ring, weights, options, warned, reader):
        self.ring = ring
        self.weights = weights
        self.options = options
        self.warned = warned
        self.reader = reader
        self.trips = 0                    # trips handled (on_trip warn/dump go on after one)
        self.last_report = None
        self.trip_message = None          # the NonFiniteError text, when the caller wants its own
        self.step_counter = None          # (label, read): a framework's step, shown next to the batch
        self.annotate = None              # annotate(report, offender index): adds fields before rendering
        self.lineage = None               # operation mode's lineage (operations.OperationRecorder.lineage)
        self.graph = None                 # the inspector's GraphRecorder (frames inside compiled graphs)

    def forget_graph_frames(self):
        if self.graph is not None:
            self.graph.forget_frames()

    # -- report dictionaries ---------------------------------------------------------------------
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
            base = kind & 3
            labels.append(label)
            kinds.append(_KIND_NAMES[base])
            extra.append(bool(kind & EXTRA) or not f.hf)
            if base == TENSOR:
                p = f.positions[t]
                records.append(_record_at(host_ring, p, valid_end))
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

    def _categories(self, f, host_ring, valid_end, prefix=None):
        """{position: (NaN, +Inf, -Inf) present} of a frame's non-finite tensor lines (those whose
        label starts with `prefix`, when given)."""
        out = {}
        t = 0
        for label, kind in zip(f.labels, f.kinds):
            if kind & 3 != TENSOR:
                continue
            p = f.positions[t]
            t += 1
            rec = _record_at(host_ring, p, valid_end) if prefix is None or label.startswith(prefix) else None
            if rec is not None and p < valid_end:
                cats = (rec[schema.NAN] > 0, rec[schema.POS_INF] > 0, rec[schema.NEG_INF] > 0)
                if any(cats):
                    out[p] = cats
        return out

    def _blame_operation(self, offender, host_ring, valid_end):
        """The operation frame that made the offending module frame's NaN/Inf (NOTE: [operation
        frames do not trip] in operations.py): the last operation before it whose output shares a
        kind of non-finite value (NaN, +Inf, -Inf) with the module's bad lines, then back through
        the operations that made its non-finite inputs to the first one whose inputs were all
        finite. None when no operation frame explains it."""
        frames = self.ring.frames
        off = frames[offender]
        want = _operations.BACKWARD_SECTION if off.section == "backward" else _operations.SECTION
        bad = set(self._categories(off, host_ring, valid_end).values())
        if not bad:
            return None
        by_start = {}
        candidates = []   # the operation frames of this pass before the offender, latest first
        for j in range(offender - 1, self.ring.floor - 1, -1):
            f = frames[j]
            if f.section == want:
                by_start[f.start] = j
                candidates.append(j)
        pick = None
        for j in candidates:  # latest first
            outs = self._categories(frames[j], host_ring, valid_end, "output")
            if any(any(a and b for a, b in zip(c, cats)) for c in outs.values() for cats in bad):
                pick = j
                break
        if pick is None:
            return None
        lineage = self.lineage or {}
        seen = set()
        while pick not in seen:
            seen.add(pick)
            f = frames[pick]
            ins = self._categories(f, host_ring, valid_end, "input")
            if not ins:
                return pick  # its inputs were finite: it made the NaN/Inf
            made = lineage.get(f.start, ())
            labels = [lab for lab, kind in zip(f.labels, f.kinds) if kind & 3 == TENSOR]
            nxt = None
            for i, p in enumerate(f.positions):
                if p in ins and i < len(made) and labels[i].startswith("input") and made[i] >= 0:
                    start = self._frame_start_of(made[i], by_start)
                    if start is not None:
                        nxt = start
                        break
            if nxt is None:
                return pick  # its bad input came from outside the operations recorded
            pick = nxt
        return pick

    def _frame_start_of(self, position, by_start):
        """Index of the operation frame (in `by_start`: start -> index) holding `position`."""
        frames = self.ring.frames
        for start, j in by_start.items():
            f = frames[j]
            if start <= position < start + f.n_records:
                return j
        return None

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
            blamed = self._blame_operation(offender, host_ring, valid_end)
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
            "module": off.owner.name, "class": off.owner.cls, "labels": bad, "section": _pass_of(section),
            "max_frames_to_save": max_frames, "headroom": self.options.headroom,
            "backend": ops.backend(), "frames": out_frames,
        }
        if "op" in offender_frame:
            report["operation"] = _operation_summary(offender_frame)
        elif blamed is not None:
            report["operation"] = _operation_summary(out_frames[blamed - lo])
        return report

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
                    report = self.build_report(offender, host_ring, status.found_at, view)
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
                            self.annotate(report, offender)
                        except Exception as exc:  # extra fields never hide the trip
                            warnings.warn(f"numguard: could not add the history/replay to the report "
                                          f"({type(exc).__name__}: {exc})", InspectorWarning, stacklevel=5)
                    if on_report is not None:
                        on_report(report, sum(1 for f in view.frames[offender + 1:] if f.hf))
            else:
                module = "(frames no longer in the ring)"
        kind, ordinal = None, 0
        if offender is not None and status.tripped:
            kind = fault_kind(view.frames[offender])
            ordinal = fault_ordinal(view.frames, offender, kind)
        ranks = []
        coordination = checks.coordination(self.warned) if status.others else None
        if coordination is not None:
            ranks = coordination.gather_trip_details(module if status.tripped else None,
                                                     batch if batch is not None else status.found_at,
                                                     tripped=status.tripped, kind=kind, ordinal=ordinal,
                                                     labels=labels)
        rank = _process.rank(default=None)
        # The fault every rank names: the earliest across ranks (NOTE: [earliest fault]).
        first = coordination.earliest_fault(ranks) if ranks else None
        me = rank  # the details' ranks are the default group's, as numguard.process.rank()
        elsewhere = first is not None and first[0] != me
        if elsewhere:
            # A rank whose own fault ties with the earliest (same batch, kind and frame) made it
            # itself, as every rank does when each computes the NaN: it names its own.
            mine = next((d for d in ranks if d is not None and d[0] == me), None)
            if mine is not None and (mine.batch, mine.kind, mine.ordinal) == (first.batch, first.kind, first.ordinal):
                elsewhere = False
        step = self._framework_step()
        if report is not None:
            report["ranks"] = [list(r) for r in ranks]
            if first is not None:
                report["first_fault"] = {"rank": first[0], "module": first[1], "labels": list(first.labels),
                                         "kind": first.kind, "batch": first.batch, "this_rank": not elsewhere}
            if step is not None:
                report["framework_step"] = {"name": step[0], "value": step[1]}
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
            msg = self._elsewhere_message(first, ranks, me, kind, labels, step_text,
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
                msg += "; " + self._carried_text(carried, kind)
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
        if on_trip == "raise":
            raise NonFiniteError(msg, report=text, batch_number=fault_batch, module=fault_module,
                                 labels=fault_labels, rank=rank, ranks=[r for r, _ in ranks],
                                 fault_rank=fault_rank, fault_kind=fault_kind_,
                                 own_module=module if status.tripped else None)
        if on_trip == "dump" and report is not None:
            # Whatever goes wrong writing the file, the trip itself is still reported below.
            try:
                from .. import dump as _dump
                path = _dump.write(report, self.options.dump_dir, rank=rank)
                msg += f"; report written to {path}"
            except Exception as exc:
                msg += (f"; could not write the dump file ({type(exc).__name__}: {exc}): fix "
                        f"dump_dir={self.options.dump_dir!r}")
        warnings.warn(msg, NonFiniteWarning, stacklevel=5)

    @staticmethod
    def _fault_text(detail, own_batch=None):
        """'rank 1 (proj [input[0], output], forward, batch_number=2)'; 'its batch N' when that
        rank's batch differs from this rank's."""
        where = detail[1] if detail[1] else "(root module)"
        labels = f" [{', '.join(detail.labels)}]" if detail.labels else ""
        batch = detail.batch
        batch_text = None if batch is None else (
            f"its batch {batch}" if own_batch is not None and batch != own_batch else f"batch_number={batch}")
        what = ", ".join(x for x in (detail.kind, batch_text) if x)
        return f"rank {detail[0]} ({where}{labels}" + (f", {what})" if what else ")")

    def _carried_text(self, carried, own_kind):
        """What the later faults of other ranks were: carried there by a collective."""
        names = ", ".join(self._fault_text(d) for d in carried)
        return (f"later also on {names}: a collective (DDP's gradient all_reduce, FSDP's reduce-scatter, a "
                "collective in the forward) carried it there")

    def _elsewhere_message(self, first, ranks, me, own_kind, own_labels, step_text, own_batch):
        """The message of a rank whose own records are finite, or whose first NaN/Inf came after
        another rank's (NOTE: [earliest fault]): it names that rank's fault, not its own."""
        msg = (f"numguard: inf/nan detected on {self._fault_text(first, own_batch)}{step_text}; that rank "
               "printed its report")
        mine = next((d for d in ranks if d[0] == me), None)
        if mine is not None:
            what = ("parameter gradients" if own_kind == schema.FAULT_PARAMETER_GRADIENT
                    else f"{own_kind or 'values'}s" if own_kind == schema.FAULT_GRADIENT
                    else "values")
            where = mine[1] if mine[1] else "(root module)"
            how = ("the gradient all_reduce (DDP; FSDP: the reduce-scatter)"
                   if own_kind == schema.FAULT_PARAMETER_GRADIENT else "a collective")
            msg += (f". This rank's (rank {me}) {what} in {where} [{', '.join(own_labels)}] were poisoned by "
                    f"{how} that carried rank {first[0]}'s NaN/Inf here: they are not where it started "
                    "(this rank's report above shows them)")
        else:
            msg += " (this rank's values were finite)"
        others = [d for d in ranks if d[0] not in (me, first[0])]
        if others:
            msg += "; " + self._carried_text(others, own_kind)
        return msg

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
                if kind & 3 != TENSOR:
                    continue
                dtype = f.dtypes[t]
                p = f.positions[t]
                t += 1
                dmax = LOW_PRECISION_MAX.get(dtype)
                if dmax is None or p in reported:
                    continue
                record = _record_at(host_ring, p, ring.pos)
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
        records = [self.frame_record(f, host_ring, tables, self.ring.pos) for f in frames[first:]
                   if f.section == "forward"]
        self.emit(_report.render_trace(records, self.options.extras)[:-1])
