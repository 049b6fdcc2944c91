"""Who is blamed for a trip: the kind of fault a frame holds and its place in the batch (what ranks
compare to agree on the earliest fault, NOTE: [earliest fault] in numguard.distributed.trip_exchange),
the operation that made a module's NaN/Inf (ops=True), and the words that name another rank's fault."""
from __future__ import annotations

from .. import schema
from . import operations as _operations
from .frames import TENSOR, is_parameter_gradients
from .ring import record_at


def pass_of(section):
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
    if pass_of(frame.section) != "backward":
        return schema.FAULT_FORWARD
    if is_parameter_gradients(frame):
        return schema.FAULT_PARAMETER_GRADIENT
    return schema.FAULT_GRADIENT


def fault_ordinal(frames, offender, kind):
    """Frames of `kind` in the offender's batch before it (NOTE: [earliest fault] in
    numguard.distributed.trip_exchange: ranks running the same step compare it)."""
    off = frames[offender]
    count = 0
    for j in range(offender - 1, -1, -1):
        f = frames[j]
        if f.batch != off.batch:
            break
        if fault_kind(f) == kind:
            count += 1
    return count


def categories(f, host_ring, valid_end, prefix=None):
    """{position: (NaN, +Inf, -Inf) present} of a frame's non-finite tensor lines (those whose
    label starts with `prefix`, when given)."""
    out = {}
    t = 0
    for label, kind in zip(f.labels, f.kinds):
        if kind & schema.LINE_KIND_MASK != TENSOR:
            continue
        p = f.positions[t]
        t += 1
        rec = record_at(host_ring, p, valid_end) if prefix is None or label.startswith(prefix) else None
        if rec is not None and p < valid_end:
            cats = (rec[schema.NAN] > 0, rec[schema.POS_INF] > 0, rec[schema.NEG_INF] > 0)
            if any(cats):
                out[p] = cats
    return out


def blame_operation(frames, floor, lineage, offender, host_ring, valid_end):
    """The operation frame that made the offending module frame's NaN/Inf (NOTE: [operation
    frames do not trip] in operations.py): the last operation before it whose output shares a
    kind of non-finite value (NaN, +Inf, -Inf) with the module's bad lines, then back through
    the operations that made its non-finite inputs (`lineage`: operation mode's) to the first one
    whose inputs were all finite. None when no operation frame explains it."""
    off = frames[offender]
    want = _operations.BACKWARD_SECTION if off.section == "backward" else _operations.SECTION
    bad = set(categories(off, host_ring, valid_end).values())
    if not bad:
        return None
    by_start = {}
    candidates = []   # the operation frames of this pass before the offender, latest first
    for j in range(offender - 1, floor - 1, -1):
        f = frames[j]
        if f.section == want:
            by_start[f.start] = j
            candidates.append(j)
    pick = None
    for j in candidates:  # latest first
        outs = categories(frames[j], host_ring, valid_end, "output")
        if any(any(a and b for a, b in zip(c, cats)) for c in outs.values() for cats in bad):
            pick = j
            break
    if pick is None:
        return None
    lineage = lineage or {}
    seen = set()
    while pick not in seen:
        seen.add(pick)
        f = frames[pick]
        ins = categories(f, host_ring, valid_end, "input")
        if not ins:
            return pick  # its inputs were finite: it made the NaN/Inf
        made = lineage.get(f.start, ())
        labels = [lab for lab, kind in zip(f.labels, f.kinds) if kind & schema.LINE_KIND_MASK == TENSOR]
        nxt = None
        for i, p in enumerate(f.positions):
            if p in ins and i < len(made) and labels[i].startswith("input") and made[i] >= 0:
                start = _frame_start_of(frames, made[i], by_start)
                if start is not None:
                    nxt = start
                    break
        if nxt is None:
            return pick  # its bad input came from outside the operations recorded
        pick = nxt
    return pick


def _frame_start_of(frames, position, by_start):
    """Index of the operation frame (in `by_start`: start -> index) holding `position`."""
    for start, j in by_start.items():
        f = frames[j]
        if start <= position < start + f.n_records:
            return j
    return None


# -- the fault of another rank ---------------------------------------------------------------------
def earliest_elsewhere(ranks, me, earliest):
    """(the fault every rank names, whether it is another rank's) from the gathered `ranks`
    details (`earliest`: trip_exchange.earliest_fault). A rank whose own fault ties with the
    earliest (same batch, kind and frame) made it itself, as every rank does when each computes
    the NaN: it names its own."""
    first = earliest(ranks) if ranks else None
    elsewhere = first is not None and first[0] != me
    if elsewhere:
        mine = next((d for d in ranks if d is not None and d[0] == me), None)
        if mine is not None and (mine.batch, mine.kind, mine.ordinal) == (first.batch, first.kind, first.ordinal):
            elsewhere = False
    return first, elsewhere


def fault_text(detail, own_batch=None):
    """'rank 1 (proj [input[0], output], forward, batch_number=2)'; 'its batch N' when that
    rank's batch differs from this rank's."""
    where = detail[1] if detail[1] else "(root module)"
    labels = f" [{', '.join(detail.labels)}]" if detail.labels else ""
    batch = detail.batch
    batch_text = None if batch is None else (
        f"its batch {batch}" if own_batch is not None and batch != own_batch else f"batch_number={batch}")
    what = ", ".join(x for x in (detail.kind, batch_text) if x)
    return f"rank {detail[0]} ({where}{labels}" + (f", {what})" if what else ")")


def carried_text(carried):
    """What the later faults of other ranks were: carried there by a collective."""
    names = ", ".join(fault_text(d) for d in carried)
    return (f"later also on {names}: a collective (DDP's gradient all_reduce, FSDP's reduce-scatter, a "
            "collective in the forward) carried it there")


def elsewhere_message(first, ranks, me, own_kind, own_labels, step_text, own_batch):
    """The message of a rank whose own records are finite, or whose first NaN/Inf came after
    another rank's (NOTE: [earliest fault]): it names that rank's fault, not its own."""
    msg = (f"numguard: inf/nan detected on {fault_text(first, own_batch)}{step_text}; that rank "
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
        msg += "; " + carried_text(others)
    return msg


__all__ = ["pass_of", "fault_kind", "fault_ordinal", "blame_operation", "earliest_elsewhere",
           "fault_text", "carried_text", "elsewhere_message"]
