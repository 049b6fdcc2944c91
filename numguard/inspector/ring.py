"""The device ring and its recording state: where each frame's records go, the frames still
held for a report, the reuse of tensors already recorded this batch, growth and wrap-around.

Nothing here reads a device value: recording is one ``numguard.ops.record_`` launch per frame
(one per device for a frame whose tensors sit on several devices).

NOTE: [one ring per device] A model spread over devices (``device_map="auto"``, pipeline stages,
a CPU-offloaded part) records each tensor on its own device, into that device's side ring: same
rows, same global positions, its own recording state. No activation is copied across devices.
Every check first merges the side rings into the main one (`merge_devices`: per side device, one
copy of the rows it wrote since the last merge and one combine of its state, the earliest trip
winning), so everything that reads the ring or the state afterwards (the flag read, reports,
history, the cross-rank numbers) sees one ring, exactly as on a single device.
"""
from __future__ import annotations

import bisect
import weakref

import torch

from .. import ops, schema
from .frames import ONE_IN_ONE_OUT_KINDS, ONE_IN_ONE_OUT_LABELS, Frame, local_shard, plain_values, tensor_label

MAX_RECORDS = 1 << 18   # records (16 MiB of float64[8]); older frames drop out beyond this
_SEEN_LIMIT = 512       # tensors remembered for reuse within a batch
_RECORDABLE = frozenset(getattr(torch, name) for name in schema.RECORDABLE_DTYPES if hasattr(torch, name))
_STRIDED = torch.strided
_PLAIN = frozenset({torch.Tensor, torch.nn.Parameter})  # no subclass (DTensor: through sanitize)

# The state buffer: the op's recording state (numguard.schema.STATE_FIELDS), then the weight
# table's headroom flag; read in one device->host copy.
WEIGHT_HEADROOM = schema.STATE_SIZE
_STATE_BUFFER = schema.STATE_INITIAL + (0, 0, 0, 0)


def outside_inference_mode(method):
    """numguard's own buffers are made and updated as normal tensors even when the model runs
    under torch.inference_mode(): an inference tensor could not be updated in place after it."""
    return torch.inference_mode(False)(method)


def _combine_state(into, other):
    """Fold a side device's recording state into the main one, on the main device: a flag is up
    when either is, and its position is the earlier of those that are up (idempotent)."""
    flags, positions = into[0::2], into[1::2]
    other_flags, other_positions = other[0::2], other[1::2]
    take = (other_flags != 0) & ((flags == 0) | (other_positions < positions))
    positions.copy_(torch.where(take, other_positions, positions))
    flags.copy_(torch.maximum(flags, other_flags))


def host_to_device(host, device):
    """A CPU tensor of numguard's own bookkeeping (index lists) on `device`, without blocking the
    host: from pinned memory for CUDA, the copy ordered before the ops that read it."""
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def _to_device(values, device):
    """A host int64 list on `device` (host_to_device)."""
    return host_to_device(torch.tensor(values, dtype=torch.int64), device)


def record_at(host_ring, position, valid_end):
    """The host record at `position` (None once overwritten): a ring's host copy, or
    graph.HostRecords when compiled graphs' frames are in the report."""
    lookup = getattr(host_ring, "record_at", None)
    if lookup is not None:
        return lookup(position)
    size = host_ring.shape[0]
    return None if position < valid_end - size else [float(v) for v in host_ring[position % size]]


def device_index(device):
    """What Tensor.get_device() returns for tensors on `device` (-1 on the CPU)."""
    if device.type == "cpu":
        return -1
    return device.index if device.index is not None else 0


class _PythonRecorder:
    """What the native FrameRecorder (csrc/recorder.cpp) does, for the pure-torch backend: the
    ring's position bookkeeping, the reuse of tensors already recorded this batch, one
    ``record_`` per frame and the Frame appended to the ring's list."""

    def __init__(self, ring):
        self._ring = weakref.ref(ring)
        self.pos = 0
        self.window_lo = 0
        self.hf_calls = 0
        self.pending_start = 0
        self._seen = {}  # id(tensor) -> (weakref, version, position), this batch
        self._slots = {}  # routing key -> side slot (1-based; 0 is the main ring)
        self._routed = []  # (slot, start, count) of records written to side rings since the last take

    def set_ring(self, ring, state):
        """Nothing to do: the ring and state are read from the FrameRing at each record."""

    def set_side(self, slot, ring, state):
        """Nothing to do: side rings are read from the FrameRing at each record."""

    def set_router(self, route):
        """Nothing to do: the route is read from the FrameRing at each record."""

    def clear_seen(self):
        self._seen.clear()

    @staticmethod
    def module_call(owner, batch, args, kwargs, output):
        """The native fast path only: every call takes the hook's Python path here."""
        return False

    def set_quant(self, sums, format):
        """Nothing to do: without the fast path, watch(quant=) measures every call itself."""

    @staticmethod
    def quant_took(output):
        return None

    def take_routed(self):
        routed, self._routed = self._routed, []
        return [v for run in routed for v in run]

    def clear_sides(self):
        self._slots.clear()
        self._routed.clear()

    def _slot(self, ring, x, dev_index):
        """Where `x` is recorded: 0 (the main ring), a side slot, or -1 (through sanitize)."""
        key = None if ring.route is None else ring.route(x)
        if key is None:
            if x.get_device() == dev_index:
                return 0
            key = x.device
            if key.type == "meta" or x.is_nested or type(x) not in _PLAIN:
                return -1
        slot = self._slots.get(key)
        if slot is None:
            try:
                ring._add_side(key)
            except Exception:
                return -1
            slot = self._slots[key] = len(ring.sides)
        return slot

    def seen_count(self):
        return len(self._seen)

    def record_frame(self, owner, xs, labels, kinds, section, hf, weights, batch, state=None, fresh=False,
                     context=0):
        ring = self._ring()
        flag = None
        if weights and owner.flag is not None and owner.flag_batch != batch:
            # The module's weight flag (NaN when one of its weights is non-finite), first call of the batch.
            owner.flag_batch = batch
            flag = owner.flag
        pos = self.pos
        dtypes, shapes, positions, n, lo = self._record(ring, xs, flag, pos, owner.headroom,
                                                        ring.state if state is None else state, state is None,
                                                        fresh, (owner, labels, kinds), context)
        self.pos = pos + n
        bstart = None
        if hf:
            self.hf_calls += 1
            bstart = self.pending_start
            self.pending_start = None
        if not ring.frames or lo < self.window_lo:
            self.window_lo = lo
        ring.frames.append(Frame(owner, batch, pos, labels, kinds, dtypes, shapes, section, bstart,
                                 n, weights and bool(owner.widx), hf, positions, lo))
        ring.frame_starts.append(pos)

    def _record(self, ring, xs, flag, pos, headroom, state, reuse, fresh=False, where=None, context=0):
        seen = self._seen if reuse else {}
        lookup = {} if fresh else seen  # NOTE: [fresh frames] (csrc/recorder.cpp)
        dev_index = ring.device_index
        dtypes = []
        shapes = []
        positions = []
        new = []
        new_index = []  # index into xs of each tensor in `new`
        slots = None  # per fresh tensor, once one of them goes to a side ring
        route = reuse and ring.route is not None
        lo = pos
        clean = True
        fresh_context = 0  # fresh records that are context (NOTE: [context records]): a prefix of `new`
        for i, x in enumerate(xs):
            dtype = x.dtype
            dtypes.append(dtype)
            try:
                shapes.append(tuple(x.shape))
            except RuntimeError:  # nested tensors have no single shape
                shapes.append(())
            hit = lookup.get(id(x))
            # Only tensors with a version counter are ever in `seen` (inference tensors are not).
            # A context record is not reused for an output: a value passed on is judged as one.
            if hit is not None and hit[0]() is x and hit[1] == x._version and (i < context or not hit[3]):
                p = hit[2]
                positions.append(p)
                if p < lo:
                    lo = p
            else:
                positions.append(pos + len(new))
                new.append(x)
                new_index.append(i)
                if i < context:
                    fresh_context += 1
                if clean:
                    if route or x.get_device() != dev_index:
                        # NOTE: [one ring per device]; a frame with a state of its own: sanitize.
                        slot = self._slot(ring, x, dev_index) if reuse else -1
                    else:
                        slot = 0
                    if slot < 0 or dtype not in _RECORDABLE or x.layout is not _STRIDED or type(x) not in _PLAIN:
                        clean = False
                    elif slot:
                        if slots is None:
                            slots = [0] * (len(new) - 1)
                        slots.append(slot)
                    elif slots is not None:
                        slots.append(0)
        recorded = new
        at = None if where is None else where + (tuple(new_index),)
        if not clean:
            slots = None
            new = ring.sanitize(new, at)
        if flag is not None:
            positions.append(pos + len(new))
            new.append(flag)
        n = len(new)
        if n:
            window = lo if not ring.frames or lo < self.window_lo else self.window_lo
            if pos + n - window > ring.size:
                ring._grow(pos + n - window)
            try:
                if slots is None:
                    ops.record_(ring.ring, state, new, pos, headroom, fresh_context)
                else:
                    self._record_routed(ring, new, slots, pos, headroom, fresh_context)
            except Exception:
                if not clean or slots is not None or not any(
                        x.is_meta or x.is_nested or local_shard(x) is not x for x in recorded):
                    raise
                # The quick screen above passes what only the op can reject (meta, nested
                # tensors, DTensors): record their values through sanitize instead of losing the frame.
                new[:len(recorded)] = ring.sanitize(recorded, at)
                ops.record_(ring.ring, state, new, pos, headroom, fresh_context)
            if len(seen) > _SEEN_LIMIT:
                seen.clear()
            try:
                for i, x in enumerate(recorded if reuse else ()):
                    if type(x) in _PLAIN:  # a subclass is recorded through its parts: never reused
                        seen[id(x)] = (weakref.ref(x), x._version, pos + i, i < fresh_context)
            except (RuntimeError, TypeError):  # inference tensors: no version counter, no reuse
                pass
        return tuple(dtypes), tuple(shapes), tuple(positions), n, lo

    def _record_routed(self, ring, new, slots, pos, headroom, context=0):
        """One record_ per run of tensors on the same device, into that device's ring (each run
        with its share of the leading context records)."""
        slots = slots + [0] * (len(new) - len(slots))  # the weight flag: on the main device
        i = 0
        while i < len(new):
            j = i + 1
            while j < len(new) and slots[j] == slots[i]:
                j += 1
            run_context = min(max(context - i, 0), j - i)
            if slots[i]:
                side = ring.sides[slots[i] - 1]
                ops.record_(side.ring, side.state, new[i:j], pos + i, headroom, run_context)
                self._routed.append((slots[i], pos + i, j - i))
            else:
                ops.record_(ring.ring, ring.state, new[i:j], pos + i, headroom, run_context)
            i = j


class _Side:
    """Another device's ring and recording state (NOTE: [one ring per device])."""

    __slots__ = ("key", "device", "ring", "state")

    def __init__(self, key, device, ring, state):
        self.key = key
        self.device = device
        self.ring = ring
        self.state = state


def _recorder_field(name, doc):
    return property(lambda ring: getattr(ring._recorder, name),
                    lambda ring, value: setattr(ring._recorder, name, value), doc=doc)


class FrameRing:
    """The ring of stats records on the device and the frames (host metadata) that refer to it.

    Positions grow without bound; a record lives at ``position % size``. Frames before `floor`
    are not report context (a traced batch's frames); `last_check_frames` frames were confirmed
    healthy by the last check. `on_drop(cut)` is told when the oldest frames are forgotten.

    ``record(owner, xs, labels, kinds, section, hf, weights, batch, state=None, fresh=False,
    context=0)`` records a frame's tensors with one launch (tensors unchanged since an earlier
    frame of the batch are not recorded again) and appends its Frame; no host sync. `state`: a
    recording state to update instead of the ring's (operation frames: their NaN/Inf does not trip
    the ring by itself). `context`: how many leading xs are the call's inputs, which trip only with
    a non-finite output (NOTE: [context records]). It is the recorder's own method (the native
    FrameRecorder when the extension is loaded: no Python frame per watched module call).

    ``module_call(owner, batch, args, kwargs, output)``: the steady-state module hook's fast
    path (one tensor in, one out, inside an open batch): records the frame and returns True, else
    returns False and the hook's Python path handles the call (always, without the extension)."""

    pos = _recorder_field("pos", "Where the next record goes.")
    window_lo = _recorder_field("window_lo", "The oldest ring position a held frame refers to.")
    hf_calls = _recorder_field("hf_calls", "Module frames recorded (Transformers' total_calls).")
    pending_start = _recorder_field("pending_start", "Transformers' 'Starting batch number' lines go before "
                                                     "the next module frame (None: none pending).")

    def __init__(self, size, device, on_drop=None, on_unchecked=None, inputs_trip=False):
        self.on_drop = on_drop
        # Whether a module's non-finite input trips by itself (Transformers' rule, the drop-in), or
        # only with a non-finite output (watch(): NOTE: [context records]).
        self.inputs_trip = inputs_trip
        # on_unchecked(owner, label, tensor): a tensor whose values numguard cannot read (NOTE:
        # [tensor subclasses]) was recorded as empty; owner and label are None when not known.
        self.on_unchecked = on_unchecked
        self.frames = []
        self.frame_starts = []      # start position per frame (for bisect)
        self._recorder = None
        self.sides = []             # other devices' rings (NOTE: [one ring per device])
        # Tests only: route(x) -> a key standing for another device (None: x's own device).
        self.route = None
        self.floor = 0
        self.last_check_frames = 0
        self._allocate(size, device)
        self.record = self._recorder.record_frame
        self.module_call = self._recorder.module_call
        # watch(quant=) (NOTE: [quant in the stats call]): set_quant(sums, format code) has
        # module_call measure its output into sums[owner.quant_row] in the same record_ call
        # (sums None: off); quant_took(output) is that output's record (float64[10]) once, or None.
        self.set_quant = self._recorder.set_quant
        self.quant_took = self._recorder.quant_took

    @outside_inference_mode
    def _allocate(self, size, device):
        self.device = device
        self.device_index = device_index(device)
        self.ring, _ = ops.new_ring(size, device)
        self.size = size
        self.state_buf = torch.tensor(_STATE_BUFFER, dtype=torch.int64, device=device)
        self.state = self.state_buf[0:schema.STATE_SIZE]
        self.sides = []
        if self._recorder is None:
            self._recorder = self._new_recorder()
        else:
            self._recorder.set_ring(self.ring, self.state)
            self._recorder.clear_sides()

    def _new_recorder(self):
        native = ops.native_module()
        recorder = getattr(native, "FrameRecorder", None) if native is not None else None
        if recorder is None:
            return _PythonRecorder(self)
        # Through a weak reference: the recorder must not keep its ring alive (no cycle the
        # garbage collector could see through C++).
        ring_ref = weakref.ref(self)
        native_recorder = recorder(self.ring, self.state, self.frames, self.frame_starts, Frame,
                                   lambda xs, where=None: ring_ref().sanitize(xs, where),
                                   lambda needed: ring_ref()._grow(needed),
                                   _SEEN_LIMIT)
        native_recorder.set_fast_path(ONE_IN_ONE_OUT_LABELS, ONE_IN_ONE_OUT_KINDS, "forward",
                                      0 if self.inputs_trip else 1)
        native_recorder.set_side_factory(lambda key: ring_ref()._add_side(key))
        return native_recorder

    @outside_inference_mode
    def _add_side(self, key):
        """A ring and state for another device (`key`: a torch.device, or a test's stand-in key,
        kept on the main device); returns them. The recorder's slot for it is len(self.sides)."""
        device = key if isinstance(key, torch.device) else self.device
        ring, state = ops.new_ring(self.size, device)
        self.sides.append(_Side(key, device, ring, state))
        return ring, state

    def set_route(self, route):
        """Tests only: treat the tensors `route(x)` names (a hashable key, None for none) as if on
        another device, to exercise the multi-device bookkeeping on one device."""
        self.route = route
        self._recorder.set_router(route)

    @outside_inference_mode
    def merge_devices(self):
        """Fold the side rings into the main ring and state (NOTE: [one ring per device]): the rows
        each side device wrote since the last merge (one copy per device) and its trip and
        headroom flags, the earliest position winning. No host read; every check calls it first."""
        if not self.sides:
            return
        routed = self._recorder.take_routed()
        oldest = self.pos - self.size  # earlier positions are no longer in the ring
        rows = {}
        for k in range(0, len(routed), 3):
            slot, start, count = routed[k:k + 3]
            rows.setdefault(slot, []).extend(p % self.size for p in range(max(start, oldest), start + count))
        for slot, side in enumerate(self.sides, 1):
            if rows.get(slot):
                index = _to_device(rows[slot], side.device)
                records = side.ring.index_select(0, index)
                if side.device != self.device:
                    index = _to_device(rows[slot], self.device)
                    records = records.to(self.device, non_blocking=self.device.type == "cuda")
                self.ring.index_copy_(0, index, records)
            state = side.state
            if side.device != self.device:
                state = state.to(self.device, non_blocking=self.device.type == "cuda")
            _combine_state(self.state, state)

    def move_to(self, device):
        """Start over on another device (the model moved after watch())."""
        self._allocate(self.size, device)
        self.drop_frames(len(self.frames))

    def forget_seen(self):
        """A new batch (or a reset): no tensor recorded so far is reused from now on."""
        self._recorder.clear_seen()

    def remembered(self):
        """Tensors remembered for reuse now."""
        return self._recorder.seen_count()

    def sanitize(self, xs, where=None):
        """Make a frame's tensors recordable, keeping every value that can hold a NaN: tensor
        subclasses are recorded through their plain values (frames.plain_values), sparse, nested
        and quantized tensors through their values, complex through its real view, other devices
        copied to the ring's device; a meta tensor (no values) becomes an empty stand-in, and so
        does a subclass whose values cannot be reached, told to `on_unchecked`. `where`: (owner,
        labels, kinds, index of each of `xs` among the frame's tensors), or None."""
        out = []
        for i, x in enumerate(xs):
            values = plain_values(x)
            if values is None:
                self._unchecked(x, i, where)
                out.append(torch.empty(0, device=self.device))
                continue
            x = values.detach()
            if x.is_meta:
                out.append(torch.empty(0, device=self.device))
                continue
            if x.is_nested:
                parts = [t.reshape(-1) for t in x.unbind()]
                x = torch.cat(parts) if parts else torch.empty(0, dtype=x.dtype, device=x.device)
            elif x.layout == torch.sparse_coo:
                x = x._values()
            elif x.layout != torch.strided:  # compressed sparse layouts (CSR, CSC, BSR, BSC)
                x = x.values()
            if x.is_quantized:
                x = x.dequantize()
            if x.is_complex():
                x = torch.view_as_real(x)
            if x.dtype not in _RECORDABLE:
                x = x.to(torch.float64)
            if x.device != self.device:
                x = x.to(self.device, non_blocking=self.device.type == "cuda")
            out.append(x)
        return out

    def _unchecked(self, x, i, where):
        if self.on_unchecked is None:
            return
        owner = label = None
        if where is not None:
            owner, labels, kinds, index = where
            label = tensor_label(labels, kinds, index[i]) if i < len(index) else None
        self.on_unchecked(owner, label, x)

    @outside_inference_mode
    def _grow(self, needed):
        old = self.ring
        size = self.size
        new_size = size
        while new_size < needed and new_size < MAX_RECORDS:
            new_size *= 2
        if new_size < needed:
            # Beyond the cap: the oldest frames' records are overwritten; forget those frames.
            limit = self.pos + (needed - (self.pos - self.window_lo)) - MAX_RECORDS
            cut = 0
            while cut < len(self.frames) and self.frames[cut].lowest < limit:
                cut += 1
            self.drop_frames(cut)
            self.forget_seen()
            if new_size == size:
                return
        ring = torch.zeros((new_size, old.shape[1]), dtype=old.dtype, device=old.device)
        lo = self.window_lo if self.frames else self.pos
        lo = max(lo, self.pos - size)
        if self.pos > lo:
            positions = torch.arange(lo, self.pos, device=old.device)
            ring.index_copy_(0, positions % new_size, old.index_select(0, positions % size))
        self.ring = ring
        self.size = new_size
        self._recorder.set_ring(self.ring, self.state)
        for slot, side in enumerate(self.sides, 1):  # the same rows on every device
            grown = torch.zeros((new_size, old.shape[1]), dtype=old.dtype, device=side.device)
            if self.pos > lo:
                index = torch.arange(lo, self.pos, device=side.device)
                grown.index_copy_(0, index % new_size, side.ring.index_select(0, index % size))
            side.ring = grown
            self._recorder.set_side(slot, grown, side.state)

    def drop_frames(self, cut):
        """Forget the oldest `cut` frames."""
        if cut <= 0:
            return
        del self.frames[:cut]
        del self.frame_starts[:cut]
        self.window_lo = min((f.lowest for f in self.frames), default=self.pos)
        self.floor = max(0, self.floor - cut)
        self.last_check_frames = max(0, self.last_check_frames - cut)
        if self.on_drop is not None:
            self.on_drop(cut)

    def keep_context(self, boundary, max_frames):
        """Frames before `boundary` are healthy: keep only the last `max_frames` module frames
        of them as report context."""
        self.last_check_frames = boundary
        j = boundary
        count = 0
        while j > self.floor and count < max_frames:
            j -= 1
            if self.frames[j].hf:
                count += 1
        self.drop_frames(j)

    def find_offender(self, trip_pos):
        """Index of the frame that wrote the record at `trip_pos`, or None when it is gone."""
        i = bisect.bisect_right(self.frame_starts, trip_pos) - 1
        while i >= 0:
            f = self.frames[i]
            if f.start <= trip_pos < f.start + f.n_records:
                return i
            if f.start + f.n_records <= trip_pos:
                return None
            i -= 1
        return None

    def valid(self, position, end):
        """Whether the record at `position` is still in the ring when `end` records were written."""
        return position >= end - self.size

    def host_copy(self):
        """The ring on the host (one device->host copy; only after a trip, a trace or a headroom hit)."""
        self.merge_devices()
        return self.ring.cpu().numpy()

    @outside_inference_mode
    def reset_after_trip(self):
        """Untrip and forget every frame (records after a trip were not written: freeze on trip)."""
        self.forget_seen()
        ops.reset_state(self.state)
        self.state_buf[WEIGHT_HEADROOM].fill_(0)
        self._recorder.take_routed()
        for side in self.sides:
            ops.reset_state(side.state)
        self.drop_frames(len(self.frames))
        self.floor = 0
        self.last_check_frames = 0

    @outside_inference_mode
    def clear_headroom(self):
        """Re-arm the headroom flags after they were handled."""
        for state in [self.state] + [side.state for side in self.sides]:
            state[schema.HEADROOM_HIT].fill_(0)
            state[schema.FIRST_HEADROOM_POSITION].fill_(-1)
        self.state_buf[WEIGHT_HEADROOM].fill_(0)
