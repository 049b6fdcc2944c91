"""watch(model, quant=FORMAT): what a low-precision format would do to each module's outputs.

Each watched module's forward hook (this feature's own, after the inspector's) measures its
floating outputs as if cast to FORMAT with current scaling, and with backward=True a tensor hook
on each output measures the gradient flowing into it (quantity "grad_output"):

- float8_e4m3fn / float8_e5m2: one per-tensor scale, ``fmax / amax`` of the tensor as it is now
  (Transformer Engine's current scaling; one float32 step lower where the quotient rounded up and
  would saturate amax itself; 1 when amax is 0 or not finite, a batch that trips anyway). The tensor is scaled on the device and measured at scale 1: the native CPU kernel
  takes its scale as a host number, and reading a device amax there would wait for the device.
  The squared error is divided back by scale^2 (the float32 product x * scale is the only
  rounding that differs from quant_stats(x, format, scale), far below a float8 step);
- mxfp8_* and nvfp4: their own block scales (numguard.quant_stats with scale=None; nvfp4's
  global scale is its current amax).

A module call the inspector's native fast path records (one tensor in, one out: Linear,
LayerNorm, Dropout, ...) has its output measured by that same record_ call, the amax taken from
the stats it computes (NOTE: [quant in the stats call]); the hook here only counts it. Other
calls' tensors are measured by one native call (``numguard::quant_watch_``: the amax,
the scale and the record of each tensor in the kernels, no torch operation per tensor, no host
sync), which also adds the records into the module's running sums on the device (non-zero,
underflow and saturated counts, squared error); element and batch counts are host numbers the
hook knows. Where the native kernels do not serve the device (or for float64 and tensor
subclasses) the same numbers come from torch operations and ``multi_tensor_quant_stats``.
Nothing is read back until ``table()`` (``insp.quant_table()``, ``advice()``, the history of a
dump). Records are summed per call, not per batch: holding a batch's activations to its end
would cost their memory.

A real float8 tensor among them (a float8 dtype, or a wrapper carrying float8 data and a scale,
torchao's float8 training tensor; numguard.float8) is not a what-if: the cast was made. Its row
is quantity "real output" / "real grad_output" with its own format, counted from the data as
torchao's and Transformer Engine's fp8 statistics count it (NOTE: [real float8 casts]).

numguard's own failure here warns once and stops this feature; the NaN/Inf watch goes on.
"""
from __future__ import annotations

import collections
import weakref
import zlib

import torch

from .. import quant as _quant
from ..float8 import float8_parts, real_quant_stats
from ..schema import (QUANT_FORMATS, Q_AMAX, Q_NONFINITE, Q_NONZERO, Q_SATURATED, Q_SCALE_EXP_MAX, Q_SCALE_EXP_MIN,
                      Q_SQ_ERROR, Q_UNDERFLOW)
from .features import Feature
from .graph import GraphBlindWarning
from .history import WINDOW
from .ring import host_to_device
from .rerun import output_tensors

OUTPUT, GRAD_OUTPUT = "output", "grad_output"
REAL = "real "   # the quantity of a real float8 cast: "real output", "real grad_output"
_SUMMED = Q_SQ_ERROR + 1   # the record's leading fields that add up across calls
_is_compiling = torch.compiler.is_compiling


def _floating(output):
    """The floating, non-empty tensors in a module's output."""
    return [t for t in output_tensors(output, []) if t.is_floating_point() and t.numel()]


def current_scale(x, fmax, amax=None):
    """Transformer Engine's current per-tensor scale of `x` as a 0-dim float32 device tensor:
    fmax / amax (1 when amax is 0 or not finite). `fmax`: the format's max as a 0-dim tensor;
    `amax`: x's abs max as a 0-dim float32 tensor, when known."""
    amax = x.detach().abs().amax().to(torch.float32) if amax is None else amax
    good = torch.isfinite(amax) & (amax > 0)
    scale = torch.where(good, fmax / torch.where(good, amax, fmax), torch.ones_like(amax))
    # fmax / amax rounded up would push amax itself past fmax: one saturated element that only
    # the rounding made. One float32 step down keeps amax * scale <= fmax.
    return torch.where(amax * scale > fmax, torch.nextafter(scale, torch.zeros_like(scale)), scale)


class _Row:
    """One (module, quantity): where its sums are, and what the host counts."""
    __slots__ = ("index", "module", "quantity", "format", "elements", "batches", "last_batch", "first")

    def __init__(self, index, module, quantity, format=None):
        self.index, self.module, self.quantity = index, module, quantity
        self.format = format   # a real cast's format (None: the what-if's)
        self.elements = 0
        self.batches = 0
        self.last_batch = -1
        self.first = None  # rows measured before it (rows made up front count from their first call)


class QuantWatch(Feature):
    """The quant= feature: its hooks go to the inspector's handles (removed at close())."""

    def __init__(self, inspector, format, amax_key=None):
        self.inspector = inspector
        self.format = format
        self.spec = QUANT_FORMATS[format]
        self.off = False
        self.batch = 0
        self.rows = {}       # (owner index, quantity) -> _Row
        self.measured = 0    # rows measured so far
        self.sums = {}       # device -> float64[capacity, _SUMMED]
        self._fmax = {}      # device -> the format's max, 0-dim float32
        self.seen = {}       # id(tensor) -> (weak ref, version, record): measured in this batch
        self.code = _quant.FORMAT_CODES[format]
        self.native = None   # device -> whether quant_watch_'s kernels serve it
        # (last batch in, {device: float64[capacity, 2]}): the non-zero and underflow sums as they
        # stood at each batch's start, for the per-batch series (one small device copy a batch)
        self.snapshots = collections.deque(maxlen=WINDOW + 1)
        self.graph_blind = GraphBlindWarning(   # says once what torch.compile hides
            "quant", "where its hooks do not run: they have no row in quant_table() (only a compiled module's own "
            "output is measured, eagerly). Watch the model uncompiled for their what-if.")
        # amax_group (NOTE: [amax digest]): each row's amax since the last check, per device, and
        # the rows' hashes there (rebuilt when rows are added)
        self.amax = {}
        self.hashes = {}
        if amax_key is not None:
            inspector._reader.amax = (float(amax_key), self.amax_digest)
        self.backward = bool(inspector.options.backward)
        for owner in inspector._owners:
            module = owner.ref() if owner.ref is not None else None
            if module is not None:
                hook = self._hook_for(owner)
                if owner.is_root:   # outside any compiled graph, as the root's other hooks (NOTE: [compile])
                    hook = torch.compiler.disable(hook)
                inspector._handles.append(module.register_forward_hook(hook))
        self.folded = False  # whether the recorder measures fast-path outputs (_start_fold)
        self._start_fold()

    # NOTE: [quant in the stats call] Each owner gets its output row up front (owner.quant_row),
    # and the ring's recorder the running sums of the ring's device, so that the record_ call of a
    # module_call measures its output too: one native call per module call, and one pass less
    # over the tensor (csrc/cpu/stats_ops.cpp). Not with amax_group (the digest takes each
    # record's amax here) or where the native kernels do not serve the ring's device.
    def _start_fold(self):
        ring = self.inspector._ring
        if self.off or self.inspector._reader.amax is not None or not _quant.native_serves("quant_watch_",
                                                                                          ring.device):
            return
        for owner in self.inspector._owners:
            if owner.ref is not None:
                row = self.rows.get((owner.index, OUTPUT))
                if row is None:
                    row = self.rows[(owner.index, OUTPUT)] = _Row(len(self.rows), owner.name, OUTPUT)
                owner.quant_row = row.index
        self.folded = True
        ring.set_quant(self._sums_for(ring.device, len(self.rows)), self.code)

    def _end_fold(self):
        if self.folded:
            self.folded = False
            self.inspector._ring.set_quant(None, -1)
            for owner in self.inspector._owners:
                owner.quant_row = -1

    # -- recording (no host sync) ------------------------------------------------------------
    def _hook_for(self, owner):
        took = self.inspector._ring.quant_took

        def quant_hook(module, args, output):
            if self.off or _is_compiling():
                return
            try:
                record = took(output)
                if record is not None:  # measured by the recorder's record_ call
                    tensors = [output]
                    self._count(self.rows[(owner.index, OUTPUT)], tensors, [record[:_SUMMED]])
                else:
                    tensors = _floating(output)
                    if tensors:
                        self._record(owner, OUTPUT, tensors)
                if tensors:
                    if self.backward and torch.is_grad_enabled():
                        for t in tensors:
                            if t.requires_grad:
                                t.register_hook(self._grad_hook_for(owner))
            except Exception as exc:  # numguard's failure, never the job's
                self._stop(exc)
        return quant_hook

    def _grad_hook_for(self, owner):
        def quant_grad_hook(grad):
            if not self.off and grad is not None and grad.is_floating_point() and grad.numel():
                try:
                    self._record(owner, GRAD_OUTPUT, [grad])
                except Exception as exc:
                    self._stop(exc)
        return quant_grad_hook

    def measure(self, tensors, into=None):
        """float64[len(tensors), len(QUANT_FIELDS)]: the records of `tensors` under current
        scaling (the module docstring), on the first tensor's device. `into`: (sums, row), whose
        row also gets the records' leading fields added."""
        tensors = [t.detach() for t in tensors]
        device = tensors[0].device
        if self._native(tensors, device):
            if into is None:
                into = (torch.zeros((1, _SUMMED), dtype=torch.float64, device=device), 0)
            return torch.ops.numguard.quant_watch_.default(into[0], into[1], tensors, self.code)
        records = self._measure_with_torch(tensors, device)
        if into is not None:
            into[0][into[1]] += records[:, :_SUMMED].sum(dim=0)
        return records

    def _native(self, tensors, device):
        """Whether quant_watch_'s kernels take `tensors` as they are."""
        if self.native is None:
            self.native = {}
        serves = self.native.get(device)
        if serves is None:
            serves = self.native[device] = _quant.native_serves("quant_watch_", device)
        return serves and all(type(t) is torch.Tensor and t.dtype in _quant.NATIVE_DTYPES and t.device == device
                              for t in tensors)

    def _measure_with_torch(self, tensors, device):
        if self.spec.scale != "tensor":
            return _quant.multi_tensor_quant_stats(tensors, self.format)
        fmax = self._fmax.get(device)
        if fmax is None:
            fmax = self._fmax[device] = torch.full((), self.spec.element_max, dtype=torch.float32, device=device)
        scales = [current_scale(t, fmax) for t in tensors]
        scaled = [t.to(torch.float32) * s for t, s in zip(tensors, scales)]
        records = _quant.multi_tensor_quant_stats(scaled, self.format)
        scales = torch.stack(scales).to(records.device)
        records[:, Q_SQ_ERROR] /= scales.to(torch.float64).square()
        # the record of x itself (as quant_watch_ gives it): its own amax, the scale's exponent
        records[:, Q_AMAX] = torch.stack([_quant.quant_stats(t, self.format)[Q_AMAX] for t in tensors]).to(records.device)
        records[:, Q_SCALE_EXP_MIN] = records[:, Q_SCALE_EXP_MAX] = (torch.frexp(scales)[1] - 1).to(torch.float64)
        return records

    def _measure_real(self, tensors, into):
        """The records of real float8 tensors (NOTE: [real float8 casts]), added into `into`'s row."""
        records = torch.stack([real_quant_stats(float8_parts(t)) for t in tensors])
        into[0][into[1]] += records[:, :_SUMMED].sum(dim=0)
        return records

    def _record(self, owner, quantity, tensors):
        """One call's tensors: the what-if of the wide ones, the real cast of the float8 ones."""
        wide = []
        for t in tensors:
            parts = float8_parts(t)
            if parts is None:
                wide.append(t)
            else:
                self._add(owner, REAL + quantity, [t], self._measure_real, parts.format)
        if wide:
            self._add(owner, quantity, wide, self.measure)

    def _sums_for(self, device, index):
        """The running sums on `device`, grown to hold row `index`."""
        sums = self.sums.get(device)
        if sums is None or sums.shape[0] <= index:
            grown = torch.zeros((max(16, 2 * (index + 1)), _SUMMED), dtype=torch.float64, device=device)
            if sums is not None:
                grown[:sums.shape[0]] = sums
            sums = self.sums[device] = grown
            if self.folded and device == self.inspector._ring.device:
                self.inspector._ring.set_quant(sums, self.code)
        return sums

    def _add(self, owner, quantity, tensors, measure, format=None):
        """Adds one call's records (by `measure`) into the row's sums. A tensor measured earlier
        in the batch and unchanged since (the root returns its last child's output; a block returns
        its last layer's) is not measured again: the kernel is the cost of this feature."""
        row = self.rows.get((owner.index, quantity))
        index = len(self.rows) if row is None else row.index  # a new row is kept once measured
        sums = self._sums_for(tensors[0].device, index)
        records, fresh = [], []
        for t in tensors:
            hit = self.seen.get(id(t))
            if hit is not None and hit[0]() is t and hit[1] == t._version:
                sums[index] += hit[2]
                records.append(hit[2])
            else:
                fresh.append(t)
        fresh_records = measure(fresh, into=(sums, index)) if fresh else ()
        if row is None:
            row = self.rows[(owner.index, quantity)] = _Row(index, owner.name, quantity, format)
        if self.inspector._reader.amax is not None:
            self._note_amax(row, torch.stack([r[Q_AMAX] for r in records + list(fresh_records)]).amax())
        self._count(row, tensors, fresh_records[:, :_SUMMED] if fresh else (), fresh)

    def _count(self, row, tensors, records, fresh=None):
        """The host's part of a call: `records` (of `fresh`, by default all of `tensors`) kept for
        the rest of the batch, the row's element and batch counts."""
        for t, record in zip(tensors if fresh is None else fresh, records):
            self.seen[id(t)] = (weakref.ref(t), t._version, record)
        row.elements += sum(t.numel() for t in tensors)
        if row.first is None:
            row.first = self.measured
            self.measured += 1
        if row.last_batch != self.batch:
            row.last_batch = self.batch
            row.batches += 1

    # NOTE: [amax digest]
    # With amax_group, each check sends one number per rank in the trip exchange's record (no new
    # collective, no new host read: it is read with the check's state and sent one check late): a
    # digest of the amax of every watched tensor since the last check, sum over rows of
    # (amax's float64 bits >> 24) XOR (a hash of the row's module and quantity), 40 bits each.
    # Integer sums are exact and do not depend on the order rows were first seen, so ranks that
    # saw the same amax everywhere send the same integer (below 2^52: exact as a float64), and a
    # rank with any other amax, or another set of rows, sends another one. The 24 bits dropped
    # are zero for amax from float32, bfloat16 and float16 tensors. numguard.distributed.amax
    # names the ranks of a group whose digest is not their group's.
    def _note_amax(self, row, amax):
        buf = self.amax.get(amax.device)
        if buf is None or buf.shape[0] <= row.index:
            grown = torch.zeros(max(16, 2 * len(self.rows)), dtype=torch.float64, device=amax.device)
            if buf is not None:
                grown[:buf.shape[0]] = buf
            buf = self.amax[amax.device] = grown
            self.hashes.pop(amax.device, None)
        buf[row.index] = torch.maximum(buf[row.index], amax)

    def amax_digest(self):
        """float64[1] on the first device of the rows: the digest of the amax of every row since
        the last check (NOTE: [amax digest]), which it starts again. Device ops only."""
        total = None
        for device, buf in self.amax.items():
            known = self.hashes.get(device)
            if known is None or known[0] != (len(self.rows), buf.shape[0]):
                values = [0] * buf.shape[0]
                for row in self.rows.values():
                    if row.index < len(values):
                        values[row.index] = zlib.crc32(f"{row.module}\0{row.quantity}".encode()) << 8
                known = self.hashes[device] = ((len(self.rows), buf.shape[0]),
                                               host_to_device(torch.tensor(values, dtype=torch.int64), device))
            terms = torch.where(buf > 0, (buf.view(torch.int64) >> 24) ^ known[1], 0)
            part = terms.sum().reshape(1)
            total = part if total is None else total + part.to(total.device)
            buf.zero_()
        if total is None:
            return torch.zeros(1, dtype=torch.float64, device=self.inspector._ring.device)
        return total.to(torch.float64)

    def _stop(self, exc):
        self.off = True
        self._end_fold()
        self.inspector._reader.amax = None  # this rank sends no amax from now on (not a mismatch)
        self.inspector._warn_once(("quant",), f"numguard: the quant={self.format!r} what-if stopped after an "
                                              f"internal error ({type(exc).__name__}: {exc}); quant_table() "
                                              "keeps what it had, NaN/Inf are still watched")

    # -- the lifecycle -------------------------------------------------------------------------
    def begin_batch(self, batch):
        if self.measured and not self.off:  # the gradients of the batch before are in by now
            self.snapshots.append((batch - 1, self._counts()))
        self.batch = batch
        self.seen.clear()

    def end_batch(self, batch):
        self.graph_blind.check(self.inspector)

    def _counts(self):
        return {device: sums[:, Q_NONZERO:Q_UNDERFLOW + 1].clone() for device, sums in self.sums.items()}

    def device_moved(self, device):
        self.native = None
        self.amax.clear()
        self.hashes.clear()
        self.snapshots.clear()
        self.seen.clear()
        self._end_fold()
        self.rows.clear()
        self.measured = 0
        self.sums.clear()
        self._fmax.clear()
        self._start_fold()

    def close(self):
        self.off = True  # the forward hooks go with the inspector's handles
        self._end_fold()

    # -- reading (one device->host copy per device) --------------------------------------------
    def table(self) -> list:
        """Rows {"module", "quantity", "underflow", "saturated", "mse", "batches"}, worst first
        (underflow, then MSE): underflow and saturated as fractions of the non-zero elements,
        mse the squared error per finite element. A real float8 cast's row also has "format",
        and mse None (NOTE: [real float8 casts])."""
        host = {device: sums.cpu().tolist() for device, sums in self.sums.items()}
        out = []
        for row in self.rows.values():
            if not row.batches:  # a row made up front (_start_fold) whose module never ran
                continue
            total = [0.0] * _SUMMED
            for values in host.values():
                if row.index < len(values):
                    total = [a + b for a, b in zip(total, values[row.index])]
            nonzero, finite = total[Q_NONZERO], row.elements - total[Q_NONFINITE]
            entry = {"module": row.module, "quantity": row.quantity,
                     "underflow": total[Q_UNDERFLOW] / nonzero if nonzero else 0.0,
                     "saturated": total[Q_SATURATED] / nonzero if nonzero else 0.0,
                     "mse": total[Q_SQ_ERROR] / finite if finite else 0.0,
                     "batches": row.batches}
            if row.format is not None:
                entry["format"], entry["mse"] = row.format, None
            out.append((row.first, entry))
        # ties in the order rows were first measured
        out.sort(key=lambda pair: (-pair[1]["underflow"], -(pair[1]["mse"] or 0.0), pair[0]))
        out = [entry for _, entry in out]
        return out

    def series(self):
        """(batches, {row index: [underflow fraction per batch, None where nothing non-zero was
        measured]}) over the last WINDOW batches (one device->host copy per device)."""
        snaps = list(self.snapshots) + [(self.batch, self._counts())]
        if len(self.snapshots) < self.snapshots.maxlen:  # nothing dropped: counting started at 0
            snaps.insert(0, (None, {}))
        per_device = {}
        for device in self.sums:
            parts = [snap.get(device) for _, snap in snaps]
            rows = max(p.shape[0] for p in parts if p is not None)
            full = [torch.zeros((rows, 2), dtype=torch.float64, device=device) if p is None else
                    torch.nn.functional.pad(p, (0, 0, 0, rows - p.shape[0])) for p in parts]
            per_device[device] = torch.stack(full).cpu().tolist()   # [snapshot][row][nonzero, underflow]
        out = {}
        for row in self.rows.values():
            fractions = []
            for i in range(1, len(snaps)):
                nonzero = under = 0.0
                for table in per_device.values():
                    if row.index < len(table[i]):
                        nonzero += table[i][row.index][0] - table[i - 1][row.index][0]
                        under += table[i][row.index][1] - table[i - 1][row.index][1]
                fractions.append(under / nonzero if nonzero > 0 else None)
            out[row.index] = fractions
        return [b for b, _ in snaps[1:]], out

    def to_dict(self) -> dict:
        """The "quant" field of the history (what advice reads): the format, the table and, per
        row, its underflow fraction in each of the last batches (the heatmap's)."""
        batches, series = self.series()
        keys = {(row.module, row.quantity): row.index for row in self.rows.values()}
        rows = [dict(entry, series=series[keys[(entry["module"], entry["quantity"])]]) for entry in self.table()]
        return {"format": self.format, "batches": batches, "rows": rows}


__all__ = ["QuantWatch", "current_scale", "OUTPUT", "GRAD_OUTPUT"]
