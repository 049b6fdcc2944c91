"""The device ring and its recording state: where each frame's records go, the frames still
held for a report, the reuse of tensors already recorded this batch, growth and wrap-around.

Nothing here reads a device value: recording is one ``numguard.ops.record_`` launch per frame.
"""
from __future__ import annotations

import bisect
import weakref

import torch

from .. import ops, schema
from .frames import ONE_IN_ONE_OUT_KINDS, ONE_IN_ONE_OUT_LABELS, Frame, local_shard

MAX_RECORDS = 1 << 18   # records (16 MiB of float64[8]); older frames drop out beyond this
_SEEN_LIMIT = 512       # tensors remembered for reuse within a batch
_RECORDABLE = frozenset(getattr(torch, name) for name in schema.RECORDABLE_DTYPES if hasattr(torch, name))
_STRIDED = torch.strided

# The state buffer: the op's recording state (numguard.schema.STATE_FIELDS), then the weight
# table's headroom flag; read in one device->host copy.
WEIGHT_HEADROOM = schema.STATE_SIZE
_STATE_BUFFER = schema.STATE_INITIAL + (0, 0, 0, 0)


def outside_inference_mode(method):
    """numguard's own buffers are made and updated as normal tensors even when the model runs
    under torch.inference_mode(): an inference tensor could not be updated in place after it."""
    return torch.inference_mode(False)(method)


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

    def set_ring(self, ring, state):
        """Nothing to do: the ring and state are read from the FrameRing at each record."""

    def clear_seen(self):
        self._seen.clear()

    @staticmethod
    def module_call(owner, inspector, args, kwargs, output):
        """The native fast path only: every call takes the hook's Python path here."""
        return False

    def seen_count(self):
        return len(self._seen)

    def record_frame(self, owner, xs, labels, kinds, section, hf, weights, batch, state=None):
        ring = self._ring()
        flag = None
        if weights and owner.flag is not None and owner.flag_batch != batch:
            # The module's weight flag (NaN when one of its weights is non-finite), first call of the batch.
            owner.flag_batch = batch
            flag = owner.flag
        pos = self.pos
        dtypes, shapes, positions, n, lo = self._record(ring, xs, flag, pos, owner.headroom,
                                                        ring.state if state is None else state, state is None)
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

    def _record(self, ring, xs, flag, pos, headroom, state, reuse):
        seen = self._seen if reuse else {}
        dev_index = ring.device_index
        dtypes = []
        shapes = []
        positions = []
        new = []
        lo = pos
        clean = True
        for x in xs:
            dtype = x.dtype
            dtypes.append(dtype)
            try:
                shapes.append(tuple(x.shape))
            except RuntimeError:  # nested tensors have no single shape
                shapes.append(())
            hit = seen.get(id(x))
            # Only tensors with a version counter are ever in `seen` (inference tensors are not).
            if hit is not None and hit[0]() is x and hit[1] == x._version:
                p = hit[2]
                positions.append(p)
                if p < lo:
                    lo = p
            else:
                positions.append(pos + len(new))
                new.append(x)
                if clean and (dtype not in _RECORDABLE or x.get_device() != dev_index
                              or x.layout is not _STRIDED):
                    clean = False
        fresh = new
        if not clean:
            new = ring.sanitize(new)
        if flag is not None:
            positions.append(pos + len(new))
            new.append(flag)
        n = len(new)
        if n:
            window = lo if not ring.frames or lo < self.window_lo else self.window_lo
            if pos + n - window > ring.size:
                ring._grow(pos + n - window)
            try:
                ops.record_(ring.ring, state, new, pos, headroom)
            except Exception:
                if not clean or not any(x.is_meta or x.is_nested or local_shard(x) is not x for x in fresh):
                    raise
                # The quick screen above passes what only the op can reject (meta, nested
                # tensors, DTensors): record their values through sanitize instead of losing the frame.
                new[:len(fresh)] = ring.sanitize(fresh)
                ops.record_(ring.ring, state, new, pos, headroom)
            if len(seen) > _SEEN_LIMIT:
                seen.clear()
            try:
                for i, x in enumerate(fresh if reuse else ()):
                    seen[id(x)] = (weakref.ref(x), x._version, pos + i)
            except (RuntimeError, TypeError):  # inference tensors: no version counter, no reuse
                pass
        return tuple(dtypes), tuple(shapes), tuple(positions), n, lo


def _recorder_field(name, doc):
    return property(lambda ring: getattr(ring._recorder, name),
                    lambda ring, value: setattr(ring._recorder, name, value), doc=doc)


class FrameRing:
    """The ring of stats records on the device and the frames (host metadata) that refer to it.

    Positions grow without bound; a record lives at ``position % size``. Frames before `floor`
    are not report context (a traced batch's frames); `last_check_frames` frames were confirmed
    healthy by the last check. `on_drop(cut)` is told when the oldest frames are forgotten.

    ``record(owner, xs, labels, kinds, section, hf, weights, batch, state=None)`` records a frame's
    tensors with one launch (tensors unchanged since an earlier frame of the batch are not recorded
    again) and appends its Frame; no host sync. `state`: a recording state to update instead of
    the ring's (operation frames: their NaN/Inf does not trip the ring by itself). It is the recorder's own method (the native FrameRecorder
    when the extension is loaded: no Python frame per watched module call).

    ``module_call(owner, inspector, args, kwargs, output)``: the steady-state module hook's fast
    path (one tensor in, one out, inside an open batch): records the frame and returns True, else
    returns False and the hook's Python path handles the call (always, without the extension)."""

    pos = _recorder_field("pos", "Where the next record goes.")
    window_lo = _recorder_field("window_lo", "The oldest ring position a held frame refers to.")
    hf_calls = _recorder_field("hf_calls", "Module frames recorded (Transformers' total_calls).")
    pending_start = _recorder_field("pending_start", "Transformers' 'Starting batch number' lines go before "
                                                     "the next module frame (None: none pending).")

    def __init__(self, size, device, on_drop=None):
        self.on_drop = on_drop
        self.frames = []
        self.frame_starts = []      # start position per frame (for bisect)
        self._recorder = None
        self.floor = 0
        self.last_check_frames = 0
        self._allocate(size, device)
        self.record = self._recorder.record_frame
        self.module_call = self._recorder.module_call

    @outside_inference_mode
    def _allocate(self, size, device):
        self.device = device
        self.device_index = device_index(device)
        self.ring, _ = ops.new_ring(size, device)
        self.size = size
        self.state_buf = torch.tensor(_STATE_BUFFER, dtype=torch.int64, device=device)
        self.state = self.state_buf[0:schema.STATE_SIZE]
        if self._recorder is None:
            self._recorder = self._new_recorder()
        else:
            self._recorder.set_ring(self.ring, self.state)

    def _new_recorder(self):
        native = ops.native_module()
        recorder = getattr(native, "FrameRecorder", None) if native is not None else None
        if recorder is None:
            return _PythonRecorder(self)
        # Through a weak reference: the recorder must not keep its ring alive (no cycle the
        # garbage collector could see through C++).
        ring_ref = weakref.ref(self)
        native_recorder = recorder(self.ring, self.state, self.frames, self.frame_starts, Frame,
                                   lambda xs: ring_ref().sanitize(xs), lambda needed: ring_ref()._grow(needed),
                                   _SEEN_LIMIT)
        native_recorder.set_fast_path(ONE_IN_ONE_OUT_LABELS, ONE_IN_ONE_OUT_KINDS, "forward")
        return native_recorder

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

    def sanitize(self, xs):
        """Make a frame's tensors recordable, keeping every value that can hold a NaN: sparse,
        nested and quantized tensors are recorded through their values, complex through its real
        view, other devices copied to the ring's device; a meta tensor (no values) becomes an
        empty stand-in."""
        out = []
        for x in xs:
            x = local_shard(x.detach())
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
        return self.ring.cpu().numpy()

    @outside_inference_mode
    def reset_after_trip(self):
        """Untrip and forget every frame (records after a trip were not written: freeze on trip)."""
        self.forget_seen()
        ops.reset_state(self.state)
        self.state_buf[WEIGHT_HEADROOM].fill_(0)
        self.drop_frames(len(self.frames))
        self.floor = 0
        self.last_check_frames = 0

    @outside_inference_mode
    def clear_headroom(self):
        """Re-arm the headroom flags after they were handled."""
        self.state[schema.HEADROOM_HIT].fill_(0)
        self.state[schema.FIRST_HEADROOM_POSITION].fill_(-1)
        self.state_buf[WEIGHT_HEADROOM].fill_(0)
