"""Module frames recorded inside compiled graphs (torch.compile).

While dynamo traces a watched module's forward hook, the hook records its frame with
``numguard.ops.record_at_cursor_``: one op traced into the graph per module call. Nothing in it
depends on a host counter: the frame's base position is read from a device cursor and advanced on
the device, and each call leaves (slot, start, batch) in a small device log. The frame's host
metadata (module, labels, kinds, dtypes, shapes) is registered once, while dynamo traces, under a
slot id that is a constant of the graph (``_slot_for``), so running the graph costs no Python per
frame beyond the op call, causes no graph break and no recompilation.

Graph records share the eager ring's recording state (trip flag, first trip position, headroom
flags, freeze on trip): the batch-end check's one read of the state covers them. Their positions
start at ``schema.GRAPH_POSITION_BASE``, so a trip position says which ring holds the offender.
Only then (after a trip) does the host read the cursor, the log and the graph ring, rebuild the
frames and merge them with the eager ones (``report_view``).
"""
from __future__ import annotations

import itertools
import weakref
from typing import NamedTuple

import torch
from torch._dynamo.comptime import comptime

from .. import ops, schema
from . import frames as _frames
from .ring import outside_inference_mode

GRAPH_RING_RECORDS = 1 << 14  # records (1 MiB); older graph frames are overwritten beyond this
GRAPH_LOG_ROWS = 1 << 12      # module calls remembered
_RECORDABLE = frozenset(getattr(torch, name) for name in schema.RECORDABLE_DTYPES if hasattr(torch, name))
_COMPILED_PREFIX = "_orig_mod"  # torch.compile's OptimizedModule holds the model under this name


class Slot(NamedTuple):
    """What one traced module call records: the host metadata of its frame."""
    recorder: str        # GraphRecorder.key
    owner_name: str      # the Owner's name in its inspector (a string: an int attribute may turn
                         # symbolic under dynamic shapes, and a slot id must be a constant)
    labels: tuple
    kinds: tuple
    dtypes: tuple
    n_records: int       # tensors, plus the module's weight flag


_slots: list = []
_slot_ids: dict = {}
_slot_shapes: dict = {}        # slot id -> shapes of its tensors (from the latest trace)
_recorders = weakref.WeakValueDictionary()
_keys = itertools.count()


@torch._dynamo.assume_constant_result
def _slot_for(recorder, owner_name, labels, kinds, dtypes, with_flag):
    """The slot id of a frame layout, registered on first sight. Dynamo calls this while it
    traces and puts the result in the graph as a constant: it never runs when the graph runs.
    (Shapes are not an argument: a dynamic dimension is no constant; _note_shapes reads them.)"""
    key = (recorder, owner_name, labels, kinds, dtypes, with_flag)
    slot = _slot_ids.get(key)
    if slot is None:
        slot = _slot_ids[key] = len(_slots)
        _slots.append(Slot(recorder, owner_name, labels, kinds, dtypes, len(dtypes) + bool(with_flag)))
        graph = _recorders.get(recorder)
        if graph is not None:
            graph.used = True
    return slot


def _note_shapes(ctx):
    """At trace time (torch._dynamo.comptime, no graph break): the shapes of record_in_graph's
    `xs` under its `slot`, -1 for a dimension that is dynamic in the graph. The latest trace of
    a slot wins. Best effort: shapes are report detail, never worth failing a compile for."""
    try:
        slot = ctx.get_local("slot").as_python_constant()
        xs = ctx.get_local("xs")._i_will_not_complain_if_bc_breaks_VariableTracker()
        shapes = []
        for x in xs.items:
            fake = x.as_proxy().node.meta["example_value"]
            shapes.append(tuple(d if type(d) is int else -1 for d in fake.shape))
        _slot_shapes[slot] = tuple(shapes)
    except Exception:  # noqa: BLE001 - see the docstring
        pass


def _recordable(x, device):
    """`x` as record_at_cursor_ takes it (branches on dtype, layout and device only: static in a
    graph). Values that only a sanitizing copy could keep (sparse, nested, quantized) are not
    followed inside a graph: an empty stand-in keeps the line."""
    x = x.detach()
    if x.layout != torch.strided or x.is_quantized or x.is_nested:
        return torch.empty(0, device=device)
    if x.is_complex():
        x = torch.view_as_real(x)
    if x.dtype not in _RECORDABLE:
        x = x.to(torch.float64)
    if x.device != device:
        x = x.to(device)
    return x


def record_in_graph(inspector, owner, args, kwargs, output):
    """The module hook's work while dynamo traces it: one record_at_cursor_ op in the graph."""
    graph = inspector._graph
    if graph is None:
        return None
    if not kwargs and len(args) == 1 and isinstance(output, torch.Tensor) and isinstance(args[0], torch.Tensor):
        xs, labels, kinds = [args[0], output], _frames.ONE_IN_ONE_OUT_LABELS, _frames.ONE_IN_ONE_OUT_KINDS
    else:
        xs, labels, kinds = _frames.flatten_call(args, kwargs, output)
    ring = inspector._ring
    device = ring.device
    flag = owner.flag
    slot = _slot_for(graph.key, owner.name, tuple(labels), tuple(kinds), tuple(x.dtype for x in xs),
                     flag is not None)
    comptime(_note_shapes)
    xs = [_recordable(x, device) for x in xs]
    if flag is not None:
        # Its weight flag (NaN when one of its weights is non-finite) trips at this frame, as in eager mode.
        xs.append(flag)
    ops.record_at_cursor_(graph.ring, ring.state, graph.cursor, graph.log, xs, slot, owner.headroom)
    return None


class GraphRecorder:
    """An inspector's graph ring, cursor and log (on the model's device), and the host side that
    turns them back into frames after a trip."""

    def __init__(self, inspector, device, records=GRAPH_RING_RECORDS, log_rows=GRAPH_LOG_ROWS):
        self._inspector = weakref.ref(inspector)
        self.key = f"graph{next(_keys)}"  # a string: dynamo keeps it a constant under dynamic shapes
        _recorders[self.key] = self
        self.used = False          # a graph recording into it was traced
        self.records = records
        self.log_rows = log_rows
        self._allocate(device)

    @outside_inference_mode
    def _allocate(self, device):
        self.ring = torch.zeros((self.records, schema.NUM_STATS), dtype=torch.float64, device=device)
        self.cursor, self.log = ops.new_graph_cursor(self.log_rows, device)
        self.floor_calls = None    # device copy of the calls logged when frames were last forgotten

    def move_to(self, device):
        """Start over on another device (the model moved after watch())."""
        self._allocate(device)

    @outside_inference_mode
    def begin_batch(self, batch):
        """Tell the device which batch runs (one fill, only once a graph records into this ring)."""
        if self.used:
            self.cursor[schema.CURSOR_BATCH].fill_(batch)

    @outside_inference_mode
    def forget_frames(self):
        """Frames logged so far are not report context any more (the state was reset after a
        trip). A device copy, no host read."""
        if self.used:
            self.floor_calls = self.cursor[schema.CURSOR_CALLS].clone()

    def untraced_submodules(self, inspector):
        """After the first batch: whether a compiled model ran without numguard's hooks in its
        graph (it was compiled before watch(); dynamo does not guard on hooks, so it reused that
        code): no frame but the model's own was recorded, in the graph or eagerly."""
        root = inspector.model
        if not isinstance(root, torch._dynamo.eval_frame.OptimizedModule) or len(inspector._owners) <= 2:
            return False
        own = {"", _COMPILED_PREFIX}
        recorded = {slot.owner_name for slot in _slots if slot.recorder == self.key}
        recorded.update(f.owner.name for f in inspector._ring.frames)
        return recorded <= own

    @staticmethod
    def owns(position):
        """Whether a trip or headroom position is a graph record's."""
        return position >= schema.GRAPH_POSITION_BASE

    # -- after a trip: the host side ------------------------------------------------------------
    def _owner(self, owners, name):
        """The owner as eager mode names it: a compiled model's modules without the prefix of
        torch.compile's wrapper (its model's own frame is then the root's frame, "")."""
        inspector = self._inspector()
        owner = owners[name]
        root = inspector.model
        if root is not None and isinstance(root, torch._dynamo.eval_frame.OptimizedModule) and (
                name == _COMPILED_PREFIX or name.startswith(_COMPILED_PREFIX + ".")):
            return ShownOwner(owner, name[len(_COMPILED_PREFIX) + 1:], is_root=name == _COMPILED_PREFIX)
        return owner

    def logged_frames(self, first_batch):
        """(frames, host copy of the graph ring, end position): the logged frames of batches from
        `first_batch` on whose records are still in the ring. Host reads: cursor, log, ring."""
        end, calls, _ = self.cursor.tolist()
        log = self.log.cpu().tolist()
        host = self.ring.cpu().numpy()
        floor = int(self.floor_calls.item()) if self.floor_calls is not None else 0
        owners = {owner.name: owner for owner in self._inspector()._owners}
        frames = []
        for call in range(max(floor, calls - self.log_rows), calls):
            slot_id, start, batch = log[call % self.log_rows]
            if batch < first_batch or start < end - self.records or not 0 <= slot_id < len(_slots):
                continue
            slot = _slots[slot_id]
            if slot.owner_name not in owners:
                continue
            n = len(slot.dtypes)
            frames.append(_frames.Frame(self._owner(owners, slot.owner_name), batch, start, list(slot.labels),
                                        list(slot.kinds), list(slot.dtypes), list(_slot_shapes.get(slot_id, ((),) * n)),
                                        "forward", None, slot.n_records, True, True,
                                        [start + i for i in range(n)], start))
        return frames, host, end

    def report_view(self, ring, host_ring):
        """The frames a report of a graph trip reads (eager and graph frames in call order) and
        the host records of both rings."""
        first_batch = ring.frames[0].batch if ring.frames else self._inspector()._batch_index()
        graph_frames, graph_host, graph_end = self.logged_frames(first_batch)
        view = ReportView(ring, graph_frames)
        return view, HostRecords(host_ring, ring.pos, graph_host, graph_end)


class ShownOwner(_frames.Owner):
    """A module of a compiled model under its eager name, for a report. Its headroom is the
    module's own (a module that warned stays quiet)."""
    __slots__ = ("source",)

    def __init__(self, source, name, is_root):
        self.source = source
        super().__init__(source.index, name, source.cls, source.ref, headroom=source.headroom)
        self.wnames, self.widx, self.flag = source.wnames, source.widx, source.flag
        self.is_root = self.is_top = is_root

    @property
    def headroom(self):
        return self.source.headroom

    @headroom.setter
    def headroom(self, value):
        self.source.headroom = value


def _is_compiled_wrapper(owner):
    module = owner.ref() if owner.ref is not None else None
    return isinstance(module, torch._dynamo.eval_frame.OptimizedModule)


def _top_forward(frame):
    return frame.owner.is_top and frame.section == "forward"


class ReportView:
    """What Reporter.build_report reads of a FrameRing (`frames`, `floor`, `find_offender`), with
    graph frames merged in: a batch's graph frames go before its root's (or a top module's)
    forward frame, which returns after the graph ran, and after the batch's other frames."""

    def __init__(self, ring, graph_frames):
        merged = []
        floor = None
        g = 0
        shown_roots = {f.batch for f in graph_frames if f.owner.is_root}
        for i, frame in enumerate(ring.frames):
            while g < len(graph_frames) and graph_frames[g].batch < frame.batch:
                merged.append(graph_frames[g])
                g += 1
            if i == ring.floor:
                floor = len(merged)
            while g < len(graph_frames) and graph_frames[g].batch == frame.batch and _top_forward(frame):
                merged.append(graph_frames[g])
                g += 1
            if frame.owner.is_root and frame.batch in shown_roots and _is_compiled_wrapper(frame.owner):
                # torch.compile's wrapper: its model's own frame, recorded in the graph, is the root's.
                continue
            merged.append(frame)
        if floor is None:  # the floor is past every eager frame (a traced batch ended last)
            floor = len(merged)
        merged.extend(graph_frames[g:])
        self.frames = _move_batch_starts(merged, ring.frames)
        self.floor = floor

    def find_offender(self, trip_pos):
        for i in range(len(self.frames) - 1, -1, -1):
            f = self.frames[i]
            if f.start <= trip_pos < f.start + f.n_records:
                return i
        return None


def _move_batch_starts(frames, eager_frames):
    """The "Starting batch number" line goes before a batch's first module frame, which may now
    be a graph frame."""
    starts = {}
    for f in eager_frames:
        if f.batch_start is not None:
            starts.setdefault(f.batch, f.batch_start)
    out = list(frames)
    first_hf = {}
    for i, f in enumerate(out):
        if f.hf and f.batch not in first_hf:
            first_hf[f.batch] = i
        if f.batch_start is not None:
            out[i] = f._replace(batch_start=None)
    for batch, start in starts.items():
        i = first_hf.get(batch)
        if i is not None:
            out[i] = out[i]._replace(batch_start=start)
    return out


class HostRecords:
    """The host copies of the eager ring and the graph ring, looked up by position."""

    def __init__(self, eager, eager_end, graph, graph_end):
        self.eager = eager
        self.eager_end = eager_end
        self.graph = graph
        self.graph_end = graph_end
        self.shape = eager.shape

    def record_at(self, position):
        """The record at `position` as a list of floats, or None when it was overwritten."""
        if position >= schema.GRAPH_POSITION_BASE:
            host, end = self.graph, self.graph_end
        else:
            host, end = self.eager, self.eager_end
        size = host.shape[0]
        if position < end - size:
            return None
        return [float(v) for v in host[position % size]]
