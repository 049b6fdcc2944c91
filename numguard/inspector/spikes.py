"""Spikes: a module's value far outside its own recent range, found on the device at each healthy
check (``watch(model, spikes=True)``; NUMGUARD_SPIKES).

NOTE: [spike rule]
What is watched is what the per-module history (numguard.inspector.history) already holds for
every batch: the abs max of each module's outputs and, with ``backward=True``, of the gradients
its backward produced. After each fold, every batch it brought in (one per check; several with
check_every=N or when a step skipped its optimizer step) is tested: its value v of each module is
compared with the module's own baseline, the batches folded before it (up to 63):

    spike  <=>  log v - median(log baseline) > max(K * 1.4826 * MAD(log baseline), log MIN_FACTOR)

armed once the baseline holds ARM values. Why this rule: a median and a MAD ignore the outliers
they are meant to find (a mean and a standard deviation would be dragged by the very spike), and
on log values a factor counts the same at every scale. 1.4826 * MAD estimates the standard
deviation of normally distributed values, so K = 6 robust sigmas keeps false alarms far below
one per run even with thousands of modules per batch; and the floor says that a value within
MIN_FACTOR = 10 of its median is no spike however flat the module's history is (a module whose
abs max never moves has a MAD of 0). Warm-up and decay schedules move these values by percents
per step, the window moves with them, and a 10x jump in one step is what a fault (a bit flip in
an exponent, a bad batch) looks like. A gradient's abs max is one element of a heavy-tailed
distribution: in a healthy 300-step run (tests/test_spikes.py) it jumped 11.5x its median, so its
floor is MIN_GRADIENT_FACTOR = 100 (an exponent bit flip changes a value by 2^8 or more).

NOTE: [loss spikes]
The loss is watched too when the root returns it: a one-element floating tensor, or a model
output's ``.loss`` / ``["loss"]`` (Transformers' ModelOutput, a dict). A forward hook of the root,
before the inspector's own, copies |loss| into a device row of one slot per history batch (NaN
when a call returns none), and the rule above tests it as one more row, with the outputs' floor
(a 10x jump; Megatron-LM's rerun machine flags a loss 10x its early max). It is placed in time
just before the root's own outputs, which hold the same loss: a loss spike is named as "loss" of
the root, not as the root's output. A loss computed outside the model is not seen; return it
from the forward (or watch a module that computes it) to have it watched.

NOTE: [gradient norm spikes]
With ``backward=True`` the parameter gradients an optimizer is about to apply are watched too:
the 2-norm of each parameter's gradient (one multi-tensor launch, float32 accumulation, at the
optimizer step), and the total norm over them (what gradient clipping computes), kept in device
rows beside the loss's. A parameter's norm takes the gradients' floor: in a healthy 300-step run
with dropout (tests/test_spikes.py) one jumped 23x its median (11.5 robust sigmas) while the
total norm never moved more than 2.2x, so the total norm takes the outputs' 10x floor. A fault
that changes only parameter gradients (a bad gradient all_reduce, a corrupted bucket) is named
as "<parameter>.grad norm" of the module that holds the parameter, or as "gradient norm" of the
root. In time they come after every module's gradient of their batch, the parameter's before the
total, so a fault the backward carried into them is named where the backward saw it first. A
sharded parameter's norm is this rank's shard's. A sparse gradient (``Embedding(sparse=True)``) is
checked for NaN/Inf through its values but has no norm row: its values hold repeated indices that
the optimizer sums, so their norm is not the gradient's (summing them here would cost a host sync
on a GPU).

The verdict rides on the one read per check: the first spike in time (the earliest batch; in it,
the forwards' outputs in the order they returned, then the gradients in the backward's order) is
written into free words of the ring's state buffer (SPIKE_WORDS) as a code of batch offset,
module and quantity, which the next check reads with the trip flag; no host sync is added.
"""
from __future__ import annotations

import math
import struct

import torch

from .history import GRAD_MAX, OUT_MAX
from .ring import host_to_device, outside_inference_mode

K = 6.0
MAD_TO_SIGMA = 1.4826
MIN_FACTOR = 10.0            # outputs
MIN_GRADIENT_FACTOR = 100.0  # gradients: their abs max is heavy-tailed even in healthy training
ARM = 16
# State buffer words (numguard.inspector.ring._STATE_BUFFER): the spike's code
# ((batch offset * modules + row) * 2 + field) + 1
# (0: none), then its value and its baseline as float64 bits.
SPIKE_CODE, SPIKE_VALUE, SPIKE_BASELINE = 5, 6, 7
SPIKE_WORDS = slice(SPIKE_CODE, SPIKE_BASELINE + 1)
QUANTITIES = ("output abs max", "gradient abs max")
LOSS = "loss"  # the quantity of the loss row (NOTE: [loss spikes])
GRAD_NORM = "gradient norm"  # the total parameter-gradient norm (NOTE: [gradient norm spikes])
assert GRAD_MAX > OUT_MAX  # the slice in after_fold takes exactly these two fields


class SpikeDetector:
    """The device side of the rule (NOTE: [spike rule]) and the host side that reads its verdict."""

    def __init__(self, mode):
        self.mode = mode          # "warn" or "raise"
        self.found = []           # every spike reported, as dicts (Inspector.spikes())
        self.pending = None        # (first batch, rows, modules) of the last fold's test, read next check
        self._last_tested = None   # the newest batch the last fold tested
        self._order = None         # device int64[rows, 2]: each value's place in time within a batch
        self._floor = None         # device float64[rows, 2]: log of each value's floor
        # Device float64[1 + P, window, 2] of each history slot (NaN: none): row 0 holds |loss| and
        # the total parameter-gradient norm, row 1 + p the norm of parameter p's gradient.
        self.root_rows = None
        self.parameters = []       # the labels ("<name>.grad") of rows 1.., in order
        self._parameter_row = {}   # label -> row of root_rows
        self._plans = {}           # tuple of labels -> _plan(...) of that list of parameters
        self.root = None           # the root's owner (the loss row names it)
        self.watch_norms = True    # off after an internal error there

    @outside_inference_mode
    def _order_in_batch(self, frames, modules, device):
        """Each value's distinct place in time within one batch, [rows, 2] (outputs, gradients),
        and the per-batch stride: the forwards' outputs in the order they returned (from the frames
        of one fold: a layer before the block and the model that contain it; the loss just before
        the root's own outputs; modules with no forward frame there last), then the gradients in
        the backward's order (the reverse), then the parameters' gradient norms, then the total.
        Computed once per set of rows: a model runs its modules in one order."""
        rank = {}
        for f in frames:
            row = f.owner.index
            if f.section == "forward" and 0 <= row < modules and row not in rank:
                if f.owner.is_root:   # the loss (row `modules`) is known as the root returns
                    rank[modules] = len(rank)
                rank[row] = len(rank)
        rank.setdefault(modules, len(rank))
        span = 2 * modules + 2                 # every rank is below it
        params = len(self.parameters)
        order = [[rank.get(row, modules + 1 + row), 2 * span - 1 - rank.get(row, modules + 1 + row)]
                 for row in range(modules)]
        order.append([rank[modules], 2 * span + params])                 # the loss, the total norm
        order += [[2 * span + params + 1 + p, 2 * span + p] for p in range(params)]  # (none), a norm
        return host_to_device(torch.tensor(order, dtype=torch.int64), device), 2 * span + 2 * params + 1

    def _floors(self, modules, device):
        """log of each value's floor, [rows, 2] (NOTE: [spike rule], [gradient norm spikes])."""
        out, grad = math.log(MIN_FACTOR), math.log(MIN_GRADIENT_FACTOR)
        floors = [[out, grad]] * modules + [[out, out]] + [[out, grad]] * len(self.parameters)
        return host_to_device(torch.tensor(floors, dtype=torch.float64), device)

    def _root_rows(self, window, device):
        rows = self.root_rows
        if rows is None or rows.device != device or rows.shape[1] != window:
            rows = self.root_rows = torch.full((1 + len(self.parameters), window, 2), math.nan,
                                               dtype=torch.float64, device=device)
            self._plans.clear()
        return rows

    @outside_inference_mode
    def note_loss(self, output, slot, window, device):
        """Keep |loss| of the batch in history slot `slot` (NOTE: [loss spikes]): the root's
        output when it is a one-element floating tensor, else its ``.loss`` or ``["loss"]``; NaN
        when it has none. One device copy, no host read."""
        rows = self._root_rows(window, device)
        loss = loss_of(output)
        if loss is None:
            rows[:, slot].fill_(math.nan)   # and no gradient norms until a step gives them
            return
        if self.parameters:
            rows[:, slot, 1].fill_(math.nan)
        rows[0, slot, 0].copy_(loss.detach().reshape(()).abs())

    @outside_inference_mode
    def note_gradients(self, labels, grads, slot, window, device):
        """Keep the 2-norm of each parameter gradient an optimizer is about to apply, and their
        total, in history slot `slot` (NOTE: [gradient norm spikes]). Device ops only; what does
        not change from step to step (the rows, which gradients count, their device) is worked out
        once per list of parameters."""
        key = tuple(labels)
        plan = self._plans.get(key)
        if plan is None or self.root_rows is None or self.root_rows.device != device:
            if len(self._plans) >= 64:   # lists that change every step (experts without gradients)
                self._plans.clear()
            plan = self._plans[key] = self._plan(labels, grads, window, device)
        index, keep, on_device = plan
        if index is None:
            return
        if keep is not None:
            grads = [grads[i] for i in keep]
        norms = torch._foreach_norm(grads, 2, dtype=torch.float32)  # float32: fp16 norms overflow
        norms = torch.stack(norms if on_device else [n.to(device, non_blocking=True) for n in norms])
        column = self._root_rows(window, device)[:, slot, 1]
        column.index_copy_(0, index, norms.to(torch.float64))
        column[0].copy_(column[1:].square().nansum().sqrt())

    def _plan(self, labels, grads, window, device):
        """(device index of the gradients' rows, the positions of the gradients that count or None
        for all, whether all are on `device`) for one list of parameters; new rows are added."""
        keep = [i for i, g in enumerate(grads) if g.is_floating_point() and g.numel()]
        fresh = [labels[i] for i in keep if labels[i] not in self._parameter_row]
        if fresh:
            for label in fresh:
                self._parameter_row[label] = 1 + len(self.parameters)
                self.parameters.append(label)
            self._order = None
            old = self.root_rows
            self.root_rows = None
            rows = self._root_rows(window, device)
            if old is not None and old.device == device and old.shape[1] == window:
                rows[:old.shape[0]].copy_(old)
        self._root_rows(window, device)
        if not keep:
            return None, None, True
        index = host_to_device(torch.tensor([self._parameter_row[labels[i]] for i in keep], dtype=torch.int64),
                               device)
        return index, None if len(keep) == len(grads) else keep, all(grads[i].device == device for i in keep)

    def after_fold(self, history, state_buf, frames=()):
        """Test every batch this fold brought in (`frames`: with check_every=N, or a backward whose
        step was skipped, a fold holds several) against the module's other batches, and write the
        first spike in time (earliest batch, then execution order) into `state_buf` unless one is
        already waiting to be read. Device ops only (the execution order is copied to the device
        once, and an index list only when a folded batch left no record, without waiting)."""
        if not frames:
            return
        table = history.table                                  # [modules, window, fields]
        window = table.shape[1]
        lo, hi = sorted((frames[0].batch, frames[-1].batch))
        # A batch whose forward was folded (and tested) by the last fold and whose backward is in
        # this one (the first batch with backward=True) is tested again for its gradients only.
        spanning = lo == self._last_tested
        lo = max(lo, hi - window + 1)
        self._last_tested = hi
        present = {b: slot for slot, b in enumerate(history.slot_batch) if b is not None}
        tested = [b for b in range(lo, hi + 1) if b in present]
        if not tested or len(present) <= ARM:
            return
        device = table.device
        modules = table.shape[0]
        rows = 1 + modules + len(self.parameters)
        if self._order is None or self._order[0].device != device or self._order[0].shape[0] != rows:
            self._order = self._order_in_batch(frames, modules, device)
            self._floor = self._floors(modules, device)
        order_in_batch, per_batch = self._order
        first_batch = tested[0]
        slots = torch.arange(window, device=device)
        offset = (slots - first_batch % window) % window        # [W]: each slot's batch - first_batch
        if len(tested) == tested[-1] - first_batch + 1:         # every batch in the range left records
            is_tested = offset < len(tested)
        else:
            mask = torch.zeros(window, dtype=torch.bool)
            mask[[present[b] for b in tested]] = True
            is_tested = host_to_device(mask, device)
        # A strided slice, not a list index (which would copy an index tensor from the host).
        values = table[:, :, OUT_MAX:GRAD_MAX + 1:GRAD_MAX - OUT_MAX]  # [M, W, 2]: outputs, gradients
        # The root's rows: the loss and the gradient norms (NOTE: [loss spikes], [gradient norm
        # spikes]).
        values = torch.cat([values, self._root_rows(window, device)])
        # The baseline: the batches folded before (a mask, not a boolean index, which would wait
        # for the device).
        valid = (values > 0) & torch.isfinite(values)
        base = valid & ~is_tested.view(1, -1, 1)
        logs = torch.where(valid, values.clamp(min=1e-300).log(), torch.full_like(values, -math.inf))
        base_logs = torch.where(base, logs, torch.full_like(values, math.nan))
        med = base_logs.nanmedian(dim=1).values                  # [M, 2] (NaN: no baseline)
        mad = (base_logs - med.unsqueeze(1)).abs().nanmedian(dim=1).values
        armed = base.sum(dim=1) >= ARM
        margin = torch.maximum(K * MAD_TO_SIGMA * torch.nan_to_num(mad, nan=0.0), self._floor)
        is_tested = is_tested.view(1, -1, 1)
        if spanning and tested[0] == lo:
            outputs = torch.arange(2, device=device) == 0
            is_tested = is_tested & ~((offset == 0).view(1, -1, 1) & outputs.view(1, 1, 2))
        spike = armed.unsqueeze(1) & is_tested & ((logs - med.unsqueeze(1)) > margin.unsqueeze(1))  # [M, W, 2]
        m = spike.shape[0]
        # Order in time: batch by batch; within one, as _order_in_batch gives it.
        order = offset.view(1, -1, 1) * per_batch + order_in_batch.view(m, 1, 2)
        never = window * per_batch
        first_order = torch.where(spike, order, torch.full_like(order, never)).amin()
        hit = first_order < never
        # The one element with that order (orders are distinct): its place in the table, and its
        # code for the host, (batch offset * m + row) * 2 + field.
        at = torch.where(spike & (order == first_order), torch.arange(spike.numel(), device=device).view_as(spike),
                         torch.full_like(order, spike.numel())).amin().clamp(max=spike.numel() - 1)
        row, field = at // (window * 2), at % 2
        code = (offset.gather(0, (at // 2) % window) * m + row) * 2 + field
        # gather, not v[row, field]: indexing with 0-dim tensors reads them on the host
        value = values.reshape(-1).gather(0, at.view(1)).view(())
        baseline = med.reshape(-1).gather(0, (row * 2 + field).view(1)).view(()).exp()
        free = state_buf[SPIKE_CODE] == 0
        word = torch.where(hit & free, code + 1, state_buf[SPIKE_CODE])
        bits = torch.stack([value, baseline]).to(torch.float64).view(torch.int64)
        state_buf[SPIKE_CODE].copy_(word)
        state_buf[SPIKE_VALUE:SPIKE_BASELINE + 1].copy_(torch.where(hit & free, bits, state_buf[SPIKE_VALUE:]))
        self.pending = (first_batch, m, modules)  # parameters may be added before the read

    def read(self, values, owners, rank):
        """The spike a check read (its state words `values`), as a dict, or None."""
        code = values[SPIKE_CODE] if len(values) > SPIKE_CODE else 0
        if not code or self.pending is None:
            return None
        first_batch, m, modules = self.pending
        offset, code = divmod(code - 1, 2 * m)
        row, field = divmod(code, 2)
        value, baseline = struct.unpack("<2d", struct.pack("<2q", *values[SPIKE_VALUE:SPIKE_BASELINE + 1]))
        owner, quantity = self._named(row, field, modules, owners)
        spike = {"module": None if owner is None else owner.name, "class": None if owner is None else owner.cls,
                 "quantity": quantity, "value": value, "baseline": baseline,
                 "factor": value / baseline if baseline > 0 else math.inf, "batch": first_batch + offset,
                 "rank": rank}
        self.found.append(spike)
        return spike

    def _named(self, row, field, modules, owners):
        """The owner and quantity of value (row, field) of a fold's test."""
        if 0 <= row < modules:
            return owners[row] if row < len(owners) else None, QUANTITIES[field]
        if row == modules:
            return self.root, LOSS if field == 0 else GRAD_NORM
        label = self.parameters[row - modules - 1]            # "<module>.<parameter>.grad"
        module, _, parameter = label[:-len(".grad")].rpartition(".")
        owner = next((o for o in owners if o.name == module), None)
        return owner, f"{parameter}.grad norm"


def loss_of(output):
    """The loss in a root's output: a one-element floating tensor, or the ``.loss`` /
    ``["loss"]`` of a model output (Transformers' ModelOutput, a dict); else None."""
    for value in (output, getattr(output, "loss", None),
                  output.get("loss") if isinstance(output, dict) else None):
        if isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point() \
                and type(value) is torch.Tensor:
            return value
    return None


def _times(factor) -> str:
    """A spike's factor as people read it: 23.4x, 1.0e+30x (an exponent flip gives huge ones)."""
    return f"{factor:.1f}x" if factor < 1e4 else f"{factor:.1e}x"


def message(spike) -> str:
    name = spike["module"] or "(root module)"
    rank = "" if spike["rank"] is None else f" on rank {spike['rank']}"
    return (f"numguard: spike{rank} in {name} ({spike['class']}) at batch_number={spike['batch']}: "
            f"{spike['quantity']} {spike['value']:.3e} is {_times(spike['factor'])} its median of the last "
            f"batches ({spike['baseline']:.3e}); a bad batch, an unstable step or a fault on this device "
            f"(NOTE: [spike rule] in numguard/inspector/spikes.py)")
