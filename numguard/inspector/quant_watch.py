"""watch(model, quant=FORMAT): what a low-precision format would do to each module's outputs.

Each watched module's forward hook (this feature's own, after the inspector's) measures its
floating outputs as if cast to FORMAT with current scaling, and with backward=True a tensor hook
on each output measures the gradient flowing into it (quantity "grad_output"):

- float8_e4m3fn / float8_e5m2: one per-tensor scale, ``fmax / amax`` of the tensor as it is now
  (Transformer Engine's current scaling; one float32 step lower where the quotient rounded up and
  would saturate amax itself; 1 when amax is 0 or not finite, a batch that trips anyway). The
  tensor is measured as v = x * scale at scale 1 and the squared error divided back by scale^2
  (the float32 product x * scale is the only rounding that differs from quant_stats(x, format,
  scale), far below a float8 step);
- mxfp8_* and nvfp4: their own block scales (numguard.quant_stats with scale=None; nvfp4's
  global scale is its current amax).

The tensors of one call are measured by one native call (``numguard::quant_watch_``: the amax,
the scale and the record of each tensor in the kernels, no torch operation per tensor, no host
sync), which also adds the records into the module's running sums on the device (non-zero,
underflow and saturated counts, squared error); element and batch counts are host numbers the
hook knows. Where the native kernels do not serve the device (or for float64 and tensor
subclasses) the same numbers come from torch operations and ``multi_tensor_quant_stats``.
Nothing is read back until ``table()`` (``insp.quant_table()``, ``advice()``, the history of a
dump). Records are summed per call, not per batch: holding a batch's activations to its end
would cost their memory.

numguard's own failure here warns once and stops this feature; the NaN/Inf watch goes on.
"""
from __future__ import annotations

import weakref

import torch

from .. import quant as _quant
from ..schema import (QUANT_FORMATS, Q_AMAX, Q_NONFINITE, Q_NONZERO, Q_SATURATED, Q_SCALE_EXP_MAX, Q_SCALE_EXP_MIN,
                      Q_SQ_ERROR, Q_UNDERFLOW)
from .features import Feature
from .rerun import output_tensors

OUTPUT, GRAD_OUTPUT = "output", "grad_output"
_SUMMED = Q_SQ_ERROR + 1   # the record's leading fields that add up across calls
_is_compiling = torch.compiler.is_compiling


def _floating(output):
    """The floating, non-empty tensors in a module's output."""
    return [t for t in output_tensors(output, []) if t.is_floating_point() and t.numel()]


def current_scale(x, fmax):
    """Transformer Engine's current per-tensor scale of `x` as a 0-dim float32 device tensor:
    fmax / amax (1 when amax is 0 or not finite). `fmax`: the format's max as a 0-dim tensor."""
    amax = x.detach().abs().amax().to(torch.float32)
    good = torch.isfinite(amax) & (amax > 0)
    scale = torch.where(good, fmax / torch.where(good, amax, fmax), torch.ones_like(amax))
    # fmax / amax rounded up would push amax itself past fmax: one saturated element that only
    # the rounding made. One float32 step down keeps amax * scale <= fmax.
    return torch.where(amax * scale > fmax, torch.nextafter(scale, torch.zeros_like(scale)), scale)


class _Row:
    """One (module, quantity): where its sums are, and what the host counts."""
    __slots__ = ("index", "module", "quantity", "elements", "batches", "last_batch")

    def __init__(self, index, module, quantity):
        self.index, self.module, self.quantity = index, module, quantity
        self.elements = 0
        self.batches = 0
        self.last_batch = -1


class QuantWatch(Feature):
    """The quant= feature: its hooks go to the inspector's handles (removed at close())."""

    def __init__(self, inspector, format):
        self.inspector = inspector
        self.format = format
        self.spec = QUANT_FORMATS[format]
        self.off = False
        self.batch = 0
        self.rows = {}       # (owner index, quantity) -> _Row
        self.sums = {}       # device -> float64[capacity, _SUMMED]
        self._fmax = {}      # device -> the format's max, 0-dim float32
        self.seen = {}       # id(tensor) -> (weak ref, version, record): measured in this batch
        self.code = _quant.FORMAT_CODES[format]
        self.native = None   # device -> whether quant_watch_'s kernels serve it
        self.backward = bool(inspector.options.backward)
        for owner in inspector._owners:
            module = owner.ref() if owner.ref is not None else None
            if module is not None:
                inspector._handles.append(module.register_forward_hook(self._hook_for(owner)))

    # -- recording (no host sync) ------------------------------------------------------------
    def _hook_for(self, owner):
        def quant_hook(module, args, output):
            if self.off or _is_compiling():
                return
            try:
                tensors = _floating(output)
                if tensors:
                    self._add(owner, OUTPUT, tensors)
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
                    self._add(owner, GRAD_OUTPUT, [grad])
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

    def _add(self, owner, quantity, tensors):
        row = self.rows.get((owner.index, quantity))
        index = len(self.rows) if row is None else row.index  # a new row is kept once measured
        device = tensors[0].device
        sums = self.sums.get(device)
        if sums is None or sums.shape[0] <= index:
            grown = torch.zeros((max(16, 2 * (index + 1)), _SUMMED), dtype=torch.float64, device=device)
            if sums is not None:
                grown[:sums.shape[0]] = sums
            sums = self.sums[device] = grown
        fresh = []
        for t in tensors:  # measured earlier in the batch and unchanged since: its record again
            hit = self.seen.get(id(t))
            if hit is not None and hit[0]() is t and hit[1] == t._version:
                sums[index] += hit[2]
            else:
                fresh.append(t)
        if fresh:
            measured = self.measure(fresh, into=(sums, index))[:, :_SUMMED]
            for t, record in zip(fresh, measured):
                self.seen[id(t)] = (weakref.ref(t), t._version, record)
        if row is None:
            row = self.rows[(owner.index, quantity)] = _Row(index, owner.name, quantity)
        row.elements += sum(t.numel() for t in tensors)
        if row.last_batch != self.batch:
            row.last_batch = self.batch
            row.batches += 1

    def _stop(self, exc):
        self.off = True
        self.inspector._warn_once(("quant",), f"numguard: the quant={self.format!r} what-if stopped after an "
                                              f"internal error ({type(exc).__name__}: {exc}); quant_table() "
                                              "keeps what it had, NaN/Inf are still watched")

    # -- the lifecycle -------------------------------------------------------------------------
    def begin_batch(self, batch):
        self.batch = batch
        self.seen.clear()

    def device_moved(self, device):
        self.seen.clear()
        self.native = None
        self.rows.clear()
        self.sums.clear()
        self._fmax.clear()

    def close(self):
        self.off = True  # the forward hooks go with the inspector's handles

    # -- reading (one device->host copy per device) --------------------------------------------
    def table(self) -> list:
        """Rows {"module", "quantity", "underflow", "saturated", "mse", "batches"}, worst first
        (underflow, then MSE): underflow and saturated as fractions of the non-zero elements,
        mse the squared error per finite element."""
        host = {device: sums.cpu().tolist() for device, sums in self.sums.items()}
        out = []
        for row in self.rows.values():
            total = [0.0] * _SUMMED
            for values in host.values():
                if row.index < len(values):
                    total = [a + b for a, b in zip(total, values[row.index])]
            nonzero, finite = total[Q_NONZERO], row.elements - total[Q_NONFINITE]
            out.append({"module": row.module, "quantity": row.quantity,
                        "underflow": total[Q_UNDERFLOW] / nonzero if nonzero else 0.0,
                        "saturated": total[Q_SATURATED] / nonzero if nonzero else 0.0,
                        "mse": total[Q_SQ_ERROR] / finite if finite else 0.0,
                        "batches": row.batches})
        out.sort(key=lambda r: (-r["underflow"], -r["mse"]))
        return out

    def to_dict(self) -> dict:
        """The "quant" field of the history (what advice reads): the format and the table."""
        return {"format": self.format, "rows": self.table()}


__all__ = ["QuantWatch", "current_scale", "OUTPUT", "GRAD_OUTPUT"]
