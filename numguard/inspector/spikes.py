"""Spikes: a module's value far outside its own recent range, found on the device at each healthy
check (``watch(model, spikes=True)``; NUMGUARD_SPIKES).

NOTE: [spike rule]
What is watched is what the per-module history (numguard.inspector.history) already holds for
every batch: the abs max of each module's outputs and, with ``backward=True``, of the gradients
its backward produced. After each fold, every batch it brought in (one per check; several with
check_every=N or when a step skipped its optimizer step) is tested: its value v of each module is
compared with the module's own baseline, the batches folded before it (up to 63; NOTE: [spike
baseline]):

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

NOTE: [spike baseline]
The baseline of each value (its median and the margin above) is not recomputed at every check: it
is computed on the device as one threshold per value, exp(median + margin) of the log rule above
(+inf where the value is not armed), and each batch is then tested with one comparison against the
threshold in hand, and the first spike in time taken with one min. It is recomputed at every
check until the window is full, so that a value arms at the batch where it holds ARM values and a
young baseline follows its first batches, then once every REFRESH = 8 batches tested. Why this
keeps the rule: a batch is never part of the baseline it is tested against (the baseline holds
only batches tested before it), and the only change is its age, at most REFRESH - 1 batches more
than a fresh one. The window's median already stands about 32 batches behind the newest batch, so
a value on a trend meets a median at most a quarter further behind; and a trend that moves the
median by d over the window spreads the window by as much, which raises the margin of 6 robust
sigmas (the MAD of a steady trend over 63 batches is a quarter of its range, 6 * 1.4826 / 4 = 2.2
times the range as margin) well above any lag of a few batches. A jump (a new learning rate, a
spike) meets the old median either way: a fresh median of 63 batches moves only after about 32
batches of the new level. Healthy 300-step runs with warm-up, cosine decay and dropout stay silent
(tests/test_spikes.py, benchmarks/bench_faults.py), and a spike is named at its batch at every
distance from a recomputation (tests). What it saves: the two medians over the window (sorts),
about half the check's work, at 7 of 8 checks.

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
REFRESH = 8  # batches tested against one baseline once the window is full (NOTE: [spike baseline])
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
        self._baseline = None      # device (threshold, median) [rows, 2] each (NOTE: [spike baseline])
        self._since_baseline = 0   # batches tested since the baseline was computed
        self._keys = {}            # (batch offsets, outputs skipped) -> device int64[n, rows, 2] places in time
        self._scratch = None       # _Scratch of the fold's test
        # Device float64[1 + P, window, 2] of each history slot (NaN: none): row 0 holds |loss| and
        # the total parameter-gradient norm, row 1 + p the norm of parameter p's gradient.
        self.root_rows = None
        self._holding = set()      # history slots whose root rows may hold values (else all NaN)
        self.parameters = []       # the labels ("<name>.grad") of rows 1.., in order
        self._parameter_row = {}   # label -> row of root_rows
        self._plans = {}           # tuple of labels -> _plan(...) of that list of parameters
        self.root = None           # the root's owner (the loss row names it)
        self.watch_norms = True    # off after an internal error there
        self._views, self._views_of = {}, None   # slot -> _slot_views(...) of the root rows `_views_of`
        self._finite_norms = None  # the parameters' norms with NaN as 0 (the total norm's input)

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
            self._holding = set()
        return rows

    def _slot_views(self, rows, slot):
        """(|loss|, the gradient norms' column, its parameters' part, a buffer of that part's size)
        of history slot `slot` of the root rows `rows`: made once per slot, as each slice is a
        dispatch."""
        if self._views_of is not rows:
            self._views, self._views_of = {}, rows
            self._finite_norms = torch.empty(rows.shape[0] - 1, dtype=rows.dtype, device=rows.device)
        views = self._views.get(slot)
        if views is None:
            column = rows[:, slot, 1]
            views = self._views[slot] = (rows[0, slot, 0], column, column[1:])
        return views

    @outside_inference_mode
    def note_loss(self, output, slot, window, device):
        """Keep |loss| of the batch in history slot `slot` (NOTE: [loss spikes]): the root's
        output when it is a one-element floating tensor, else its ``.loss`` or ``["loss"]``; NaN
        when it has none. One device copy, no host read."""
        rows = self._root_rows(window, device)
        loss = loss_of(output)
        held = slot in self._holding   # an earlier batch in this slot left a loss or norms there
        if loss is None:
            if held:
                rows[:, slot].fill_(math.nan)   # and no gradient norms until a step gives them
                self._holding.discard(slot)
            return
        loss_cell, norms, _ = self._slot_views(rows, slot)
        if self.parameters and held:
            norms.fill_(math.nan)
        loss_cell.copy_(loss.detach().reshape(())).abs_()
        self._holding.add(slot)

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
        index, keep, on_device, first_row = plan
        if index is None:
            return
        if keep is not None:
            grads = [grads[i] for i in keep]
        norms = torch._foreach_norm(grads, 2, dtype=torch.float32)  # float32: fp16 norms overflow
        _, column, parameter_norms = self._slot_views(self._root_rows(window, device), slot)
        if first_row is not None and on_device:   # rows in order: copied into them, one op
            column.narrow(0, first_row, len(norms)).copy_(torch.stack(norms))
        else:
            norms = torch.stack(norms if on_device else [n.to(device, non_blocking=True) for n in norms])
            column.index_copy_(0, index, norms.to(torch.float64))
        # over every optimizer's rows
        torch.linalg.vector_norm(torch.nan_to_num(parameter_norms, nan=0.0, out=self._finite_norms), out=column[0])
        self._holding.add(slot)

    def _plan(self, labels, grads, window, device):
        """(device index of the gradients' rows, the positions of the gradients that count or None
        for all, whether all are on `device`, their first row where their rows follow each other in
        order or None) for one list of parameters; new rows are added."""
        keep = [i for i, g in enumerate(grads) if g.is_floating_point() and g.numel()]
        fresh = [labels[i] for i in keep if labels[i] not in self._parameter_row]
        if fresh:
            for label in fresh:
                self._parameter_row[label] = 1 + len(self.parameters)
                self.parameters.append(label)
            self._order = None
            old, holding = self.root_rows, self._holding
            self.root_rows = None
            rows = self._root_rows(window, device)
            if old is not None and old.device == device and old.shape[1] == window:
                rows[:old.shape[0]].copy_(old)
                self._holding = holding
        self._root_rows(window, device)
        if not keep:
            return None, None, True, None
        places = [self._parameter_row[labels[i]] for i in keep]
        index = host_to_device(torch.tensor(places, dtype=torch.int64), device)
        in_order = places == list(range(places[0], places[0] + len(places)))
        return (index, None if len(keep) == len(grads) else keep, all(grads[i].device == device for i in keep),
                places[0] if in_order else None)

    def after_fold(self, history, state_buf, frames=()):
        """Test every batch this fold brought in (`frames`: with check_every=N, or a backward whose
        step was skipped, a fold holds several) against the baseline in hand (NOTE: [spike
        baseline]), and write the first spike in time (earliest batch, then execution order) into
        `state_buf` unless one is already waiting to be read. Device ops only, and no copy from the
        host but an offset list where a folded batch left no record."""
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
        slot_batch = history.slot_batch
        tested = [b for b in range(lo, hi + 1) if slot_batch[b % window] == b]
        held = window - slot_batch.count(None)
        if not tested or held <= ARM:
            return
        device = table.device
        modules = table.shape[0]
        rows = 1 + modules + len(self.parameters)
        if self._order is None or self._order[0].device != device or self._order[0].shape[0] != rows:
            self._order = self._order_in_batch(frames, modules, device)
            self._floor = self._floors(modules, device)
            self._keys.clear()
            self._baseline = None
        scratch = self._scratch
        if scratch is None or not scratch.fits(table, state_buf, rows):
            scratch = self._scratch = _Scratch.made(table, state_buf, modules, rows)
        values = scratch.values   # [M, W, 2]: outputs, gradients
        # The root's rows: the loss and the gradient norms (NOTE: [loss spikes], [gradient norm spikes]).
        root_rows = self._root_rows(window, device)
        slots = [b % window for b in tested]
        if self._baseline is None or held < window or self._since_baseline >= REFRESH:
            self._baseline = self._baseline_of(torch.cat([values, root_rows]), slots)
            self._since_baseline = 0
        self._since_baseline += len(tested)
        upper, baseline = self._baseline
        first_batch = tested[0]
        offsets = tuple(b - first_batch for b in tested)
        skip_outputs = spanning and first_batch == lo
        order, never = self._keys_for(offsets, skip_outputs, device, window)
        if len(slots) == 1:   # one check per batch: no allocation, one gather (NOTE: [spike test cost])
            scratch.test_one_batch(root_rows, slots[0], upper, baseline, order, never)
            self.pending = (first_batch, rows, modules)
            return
        # The tested batches, batch by batch: [n, rows, 2], so that an element's flat index is the
        # spike's code, (batch offset * rows + row) * 2 + field, where the offsets are 0, 1, ...
        runs = [self._slots(values, root_rows, s, n) for s, n in _runs(slots)]
        seen = runs[0] if len(runs) == 1 else torch.cat(runs)
        # A value above its threshold (+inf where the row is not armed), and finite, is a spike; its
        # key is its place in time, the smallest key the first spike.
        key = torch.where(seen.nan_to_num(posinf=0.0) > upper, order, never)
        first, at = key.view(-1).min(0, keepdim=True)                  # [1] each
        if offsets == tuple(range(len(offsets))):
            code, row_field = at, at.remainder(2 * rows)
        else:   # a batch between left no record: its offset from the key
            row_field = at.remainder(2 * rows)
            code = first.div(self._order[1], rounding_mode="floor") * (2 * rows) + row_field
        scratch.write(seen, at, row_field, code, first, never, baseline)
        self.pending = (first_batch, rows, modules)  # parameters may be added before the read

    @staticmethod
    def _slots(values, root_rows, start, n):
        """The values of `n` consecutive history slots from `start`, batch by batch: [n, rows, 2]."""
        if n == 1:
            return torch.cat([values[:, start], root_rows[:, start]]).unsqueeze(0)
        return torch.cat([values.narrow(1, start, n).transpose(0, 1), root_rows.narrow(1, start, n).transpose(0, 1)],
                         dim=1)

    def _keys_for(self, offsets, skip_outputs, device, window):
        """(each tested value's place in time, [n, rows, 2] ([rows, 2] for one batch), from the
        batches' `offsets` and the order within a batch; the key of no spike, above every place),
        kept per list of offsets. `skip_outputs`: the first batch's outputs were tested by the last
        fold (never a spike)."""
        order_in_batch, per_batch = self._order
        never = window * per_batch
        if offsets == (0,) and not skip_outputs:
            return order_in_batch, never
        cache_key = (offsets, skip_outputs)
        order = self._keys.get(cache_key)
        if order is None:
            if len(self._keys) >= 16:   # offsets that change at every check (batches without records)
                self._keys.clear()
            if offsets == tuple(range(len(offsets))):
                steps = torch.arange(len(offsets), device=device)
            else:
                steps = host_to_device(torch.tensor(offsets, dtype=torch.int64), device)
            order = order_in_batch.unsqueeze(0) + (steps * per_batch).view(-1, 1, 1)
            if skip_outputs:
                order[0, :, 0] = never
            self._keys[cache_key] = order = order[0] if len(offsets) == 1 else order
        return order, never

    def _baseline_of(self, values, tested_slots):
        """The baseline of each value (NOTE: [spike rule]) from the history slots but `tested_slots`:
        (the threshold exp(median + margin) of the log values, +inf where fewer than ARM are held;
        the median, exp(median), flat: [rows * 2]). values: [rows, window, 2]."""
        valid = (values > 0) & torch.isfinite(values)
        for slot in tested_slots:   # a mask, not a boolean index, which would wait for the device
            valid[:, slot] = False
        logs = torch.where(valid, values.clamp(min=1e-300).log(), math.nan)
        med = logs.nanmedian(dim=1).values                      # [rows, 2] (NaN: no baseline)
        mad = (logs - med.unsqueeze(1)).abs().nanmedian(dim=1).values
        margin = torch.maximum(K * MAD_TO_SIGMA * mad.nan_to_num(nan=0.0), self._floor)
        armed = valid.sum(dim=1) >= ARM
        return torch.where(armed, (med + margin).exp(), math.inf), med.exp().view(-1)

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


class _Scratch:
    """Views and small device buffers of a fold's test, made once per history table, state buffer
    and number of rows: each slice is a dispatch, and a torch.cat costs several.

    NOTE: [spike test cost]
    A check of one batch (the usual case) tests it with ten device ops writing into these buffers
    and no allocation: the batch's values are copied out of the history with their +inf set to 0
    (an infinite value is a trip, not a spike; the copy and that are one op), compared with the
    thresholds, keyed by their place in time, and the smallest key taken. The spike's value and
    its baseline sit side by side (`pair`: the batch's values, then the medians of the baseline),
    so that one gather takes both, and the state words are written only where a spike was found
    and none waits to be read, one add and one compare: first + code_word * never < never."""

    def __init__(self, table, state_buf, modules, rows):
        self.table, self.state_buf, self.rows = table, state_buf, rows
        device = table.device
        # A strided slice, not a list index (which would copy an index tensor from the host).
        self.values = table[:, :, OUT_MAX:GRAD_MAX + 1:GRAD_MAX - OUT_MAX]   # [M, W, 2]: outputs, gradients
        self.words, self.code_word = state_buf[SPIKE_WORDS], state_buf[SPIKE_CODE]
        self.pair = torch.empty((2, rows * 2), dtype=torch.float64, device=device)   # values, medians
        self.seen = self.pair[0].view(rows, 2)   # one batch's values
        self.seen_modules, self.seen_root = self.seen[:modules], self.seen[modules:]
        self.medians, self.medians_of = self.pair[1], None   # the baseline whose medians `pair` holds
        self.above = torch.empty((rows, 2), dtype=torch.bool, device=device)
        self.key = torch.empty((rows, 2), dtype=torch.int64, device=device)
        self.first, self.at, self.guard = (torch.empty(1, dtype=torch.int64, device=device) for _ in range(3))
        self.free = torch.empty(1, dtype=torch.bool, device=device)
        self.never = None          # (never, the same as a 0-dim device tensor)
        self.slot_views = {}       # slot -> (the history's values, the root rows' values) of the slot
        self.views_of = None       # the root rows `slot_views` are views of
        self.verdict = torch.zeros(3, dtype=torch.int64, device=device)   # the spike words to write
        found = self.verdict[1:].view(torch.float64)
        self.code, self.value, self.baseline = self.verdict[0:1], found[0:1], found[1:2]
        self.found = found.view(2, 1)   # value, baseline: one gather's output

    @classmethod
    @outside_inference_mode
    def made(cls, table, state_buf, modules, rows):
        return cls(table, state_buf, modules, rows)

    def fits(self, table, state_buf, rows):
        return self.table is table and self.state_buf is state_buf and self.rows == rows

    def _slot(self, root_rows, slot):
        if self.views_of is not root_rows:
            self.slot_views, self.views_of = {}, root_rows
        views = self.slot_views.get(slot)
        if views is None:
            views = self.slot_views[slot] = (self.values[:, slot], root_rows[:, slot])
        return views

    def _never(self, never):
        if self.never is None or self.never[0] != never:
            self.never = (never, torch.tensor(never, dtype=torch.int64, device=self.table.device))
        return self.never[1]

    def test_one_batch(self, root_rows, slot, upper, baseline, order, never):
        """Test the batch in history slot `slot` against the thresholds `upper` and write its first
        spike in time (`order`: each value's key; `never`: the key of none) into the state words
        (NOTE: [spike test cost]). `baseline`: the medians of the thresholds' baseline, flat."""
        if self.medians_of is not baseline:
            self.medians.copy_(baseline)
            self.medians_of = baseline
        modules_now, root_now = self._slot(root_rows, slot)
        torch.nan_to_num(modules_now, posinf=0.0, out=self.seen_modules)
        torch.nan_to_num(root_now, posinf=0.0, out=self.seen_root)
        torch.gt(self.seen, upper, out=self.above)
        torch.where(self.above, order, self._never(never), out=self.key)
        torch.min(self.key.view(-1), 0, keepdim=True, out=(self.first, self.at))
        # gather, not v[at]: indexing with tensors reads them on the host
        torch.gather(self.pair, 1, self.at.expand(2, 1), out=self.found)
        torch.add(self.at, 1, out=self.code)
        self._write_if_free(never)

    def write(self, seen, at, row_field, code, first, never, baseline):
        """Write the spike at flat index `at` of `seen` into the state words (its code, value and
        baseline), unless none was found (`first` is `never`) or one is waiting to be read."""
        torch.gather(seen.reshape(-1), 0, at, out=self.value)
        torch.gather(baseline, 0, row_field, out=self.baseline)
        torch.add(code, 1, out=self.code)
        self.first.copy_(first)
        self._write_if_free(never)

    def _write_if_free(self, never):
        """The state words := the verdict, where a spike was found (`first` below `never`) and
        the code word is 0 (none waits to be read): first + code_word * never < never."""
        torch.add(self.first, self.code_word, alpha=never, out=self.guard)
        torch.lt(self.guard, never, out=self.free)
        torch.where(self.free, self.verdict, self.words, out=self.words)


def _runs(slots):
    """(first slot, length) of each run of consecutive slots in `slots`, in order."""
    runs = []
    for slot in slots:
        if runs and slot == runs[-1][0] + runs[-1][1]:
            runs[-1][1] += 1
        else:
            runs.append([slot, 1])
    return runs


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
