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

The tensors of one call go through ``multi_tensor_quant_stats`` together and their records are
added, on the device, into the module's running sums (non-zero, underflow and saturated counts,
squared error); element and batch counts are host numbers the hook knows. Nothing is read back
until ``table()`` (``insp.quant_table()``, ``advice()``, the history of a dump). Records are
summed per call, not per batch: holding a batch's activations to its end would cost their memory.

numguard's own failure here warns once and stops this feature; the NaN/Inf watch goes on.
"""
from __future__ import annotations

import weakref

import torch

from .. import quant as _quant
from ..schema import QUANT_FORMATS, Q_NONFINITE, Q_NONZERO, Q_SATURATED, Q_SQ_ERROR, Q_UNDERFLOW
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

    def measure(self, tensors):
        """float64[len(tensors), len(QUANT_FIELDS)]: the records of `tensors` under current
        scaling (the module docstring), on the first tensor's device."""
        tensors = [t.detach() for t in tensors]
        if self.spec.scale != "tensor":
            return _quant.multi_tensor_quant_stats(tensors, self.format)
        device = tensors[0].device
        fmax = self._fmax.get(device)
        if fmax is None:
            fmax = self._fmax[device] = torch.full((), self.spec.element_max, dtype=torch.float32, device=device)
        scales = [current_scale(t, fmax) for t in tensors]
        scaled = [t.to(torch.float32) * s for t, s in zip(tensors, scales)]
        records = _quant.multi_tensor_quant_stats(scaled, self.format)
        records[:, Q_SQ_ERROR] /= torch.stack(scales).to(torch.float64).square().to(records.device)
        return records

    def _summed(self, tensors):
        """The summed leading fields of the records of `tensors`. A tensor measured earlier in the
        batch and unchanged since (the root returns its last child's output; a block returns
        its last layer's) is not measured again: the kernel is the cost of this feature."""
        records, fresh = [], []
        for t in tensors:
            hit = self.seen.get(id(t))
            if hit is not None and hit[0]() is t and hit[1] == t._version:
                records.append(hit[2])
            else:
                fresh.append(t)
        if fresh:
            measured = self.measure(fresh)[:, :_SUMMED]
            for t, record in zip(fresh, measured):
                self.seen[id(t)] = (weakref.ref(t), t._version, record)
            records.extend(measured)
        return records[0] if len(records) == 1 else torch.stack(records).sum(dim=0)

    def _add(self, owner, quantity, tensors):
        record = self._summed(tensors)
        row = self.rows.get((owner.index, quantity))
        if row is None:
            row = self.rows[(owner.index, quantity)] = _Row(len(self.rows), owner.name, quantity)
        sums = self.sums.get(record.device)
        if sums is None or sums.shape[0] <= row.index:
            grown = torch.zeros((max(16, 2 * len(self.rows)), _SUMMED), dtype=torch.float64, device=record.device)
            if sums is not None:
                grown[:sums.shape[0]] = sums
            sums = self.sums[record.device] = grown
        sums[row.index] += record
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
