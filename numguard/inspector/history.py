"""A small device-side history per watched module, for precision advice (``Inspector.advice()``,
``python -m numguard advise DUMP``).

At each healthy check, the records of the frames that check confirmed are folded into a table
``[modules, window, fields]`` on the ring's device with ONE ``scatter_reduce_`` (amax): no host
sync, no per-module device work, and nothing at all in the module hooks. The host only builds the
index lists (a few array appends per recorded tensor, at the check: about half a millisecond for
the 80 frames of a 14M-parameter GPT-2 batch on a busy CPU). The table holds the last
`window` batches; ``to_dict()`` reads it back (one device->host copy) as plain JSON data, the
"history" of a dump and the input of ``numguard.advice``.

Fields per module and batch: the abs max of the tensors the module returned and received in the
forward, their smallest non-zero magnitude, and the same for the activation gradients its backward
produced (``grad_input`` / ``grad_output`` frames of ``backward=True``), with the share of those
gradient elements that are subnormal in their own dtype. Minimums are kept negated, so that one
amax reduces every field.
"""
from __future__ import annotations

import math
from array import array

import torch

from .. import ops, schema
from ..report_types import HISTORY_SERIES
from .frames import ONE_IN_ONE_OUT_LABELS, TENSOR
from .ring import host_to_device, outside_inference_mode

WINDOW = 64
FIELDS = HISTORY_SERIES  # the columns of the table, named as a report's history has them
OUT_MAX, IN_MAX, MIN_NZ, GRAD_MAX, GRAD_MIN_NZ, GRAD_SUB = range(len(FIELDS))
_NEGATED = (MIN_NZ, GRAD_MIN_NZ)
# What an empty cell holds: maxima start at -inf ("no value"), negated minima too.
_EMPTY = -math.inf
_NCOLS = schema.NUM_STATS
_ABS_MAX, _MIN_NONZERO, _SUBNORMAL = schema.ABS_MAX, schema.MIN_NONZERO, schema.SUBNORMAL
_FLOATING = frozenset(getattr(torch, name) for name in ("float64", "float32", "float16", "bfloat16",
                                                        "float8_e4m3fn", "float8_e5m2") if hasattr(torch, name))


class ModuleHistory:
    """The per-module table. `owners`: the inspector's module owners (index = row)."""

    def __init__(self, owners, device, window=WINDOW):
        self.owners = owners
        self.window = window
        self.by_name = {}                 # module name -> row (record_frame owners carry names only)
        for owner in owners:
            self.by_name.setdefault(owner.name, owner.index)
        self.slot_batch = [None] * window  # the batch each slot holds (host side)
        self.dtypes = {}                   # row -> (forward dtype, gradient dtype) as str
        self._allocate(device)

    @outside_inference_mode
    def _allocate(self, device):
        self.device = device
        self.table = torch.full((len(self.owners), self.window, len(FIELDS)), _EMPTY, dtype=torch.float64,
                                device=device)
        self.slot_batch = [None] * self.window

    def move_to(self, device):
        """Start over on another device (the model moved)."""
        self._allocate(device)

    def fold(self, ring, lo, hi):
        """Fold the records of frames [lo, hi) of `ring` (confirmed healthy) into the table."""
        if torch.is_inference_mode_enabled():
            with torch.inference_mode(False):
                return self._fold(ring, lo, hi)
        return self._fold(ring, lo, hi)

    def _fold(self, ring, lo, hi):
        if _native_fold is not None:
            index_t, mult_t, new_slots = _native_fold(
                ring.frames, lo, hi, ring.size, ring.pos - ring.size, self.window, len(FIELDS), self.slot_batch,
                self.by_name, self.dtypes, _FLOATING, ONE_IN_ONE_OUT_LABELS, _FOLD_LAYOUT)
        else:
            index_t, mult_t, new_slots = self._fold_lines(ring.frames[lo:hi], ring)
        table = self.table
        for slot in new_slots:   # a slot taken by a newer batch starts empty (one fill per batch)
            table[:, slot].fill_(_EMPTY)
        n = mult_t.numel()
        if not n:
            return
        device = table.device
        index_t = host_to_device(index_t, device)
        mult_t = host_to_device(mult_t, device)
        values = ring.ring.reshape(-1).index_select(0, index_t[:n]).mul_(mult_t)
        # MIN_NONZERO is +inf when a tensor has no non-zero value: -inf after negation, an empty cell.
        table.view(-1).scatter_reduce_(0, index_t[n:], values, "amax")

    def _fold_lines(self, frames, ring):
        """The host work of a fold, a few appends per tensor line (csrc/history.cpp's fold_lines
        does the same in one native call, with the native kernels): ring element indexes then table cells (int64[2n], on the CPU), their
        multipliers (float64[n]) and the slots newly taken by a batch. Updates `slot_batch` and
        `dtypes`."""
        index, mult = array("q"), array("d")   # index: ring element positions, then table cells
        cells = array("q")
        add_index, add_mult, add_cell = index.append, mult.append, cells.append
        nf = len(FIELDS)
        window = self.window
        size = ring.size
        oldest = ring.pos - size
        slot_batch = self.slot_batch
        by_name = self.by_name
        dtypes = self.dtypes
        new_slots = []
        for f in frames:
            section = f.section
            if section == "forward":
                row = f.owner.index
                if row < 0:
                    continue
                forward = True
            elif section == "backward" and f.labels and f.labels[0].startswith("grad_"):
                row = by_name.get(f.owner.name)
                if row is None:
                    continue
                forward = False
            else:
                continue
            batch = f.batch
            slot = batch % window
            if slot_batch[slot] != batch:
                slot_batch[slot] = batch
                new_slots.append(slot)
            base = (row * window + slot) * nf
            positions = f.positions
            f_dtypes = f.dtypes
            if f.labels is ONE_IN_ONE_OUT_LABELS:
                lines = ((0, False), (1, True))      # input[0], output
            else:
                lines = []
                t = 0
                for label, kind in zip(f.labels, f.kinds):
                    if kind & schema.LINE_KIND_MASK == TENSOR:
                        lines.append((t, label.startswith("output")))
                        t += 1
            for t, is_output in lines:
                p = positions[t]
                dtype = f_dtypes[t]
                if p < oldest or dtype not in _FLOATING:
                    continue
                r = (p % size) * _NCOLS
                if forward:
                    add_index(r + _ABS_MAX)
                    add_index(r + _MIN_NONZERO)
                    add_mult(1.0)
                    add_mult(-1.0)
                    add_cell(base + (OUT_MAX if is_output else IN_MAX))
                    add_cell(base + MIN_NZ)
                    if is_output and row not in dtypes:
                        dtypes[row] = [str(dtype), None]
                else:
                    shape = f.shapes[t]
                    numel = math.prod(shape) if shape else 1
                    add_index(r + _ABS_MAX)
                    add_index(r + _MIN_NONZERO)
                    add_index(r + _SUBNORMAL)
                    add_mult(1.0)
                    add_mult(-1.0)
                    add_mult(1.0 / numel if numel else 0.0)
                    add_cell(base + GRAD_MAX)
                    add_cell(base + GRAD_MIN_NZ)
                    add_cell(base + GRAD_SUB)
                    kinds = dtypes.setdefault(row, [None, None])
                    if kinds[1] is None:
                        kinds[1] = str(dtype)
        index += cells
        return (torch.frombuffer(index, dtype=torch.int64) if index else torch.empty(0, dtype=torch.int64),
                torch.frombuffer(mult, dtype=torch.float64) if mult else torch.empty(0, dtype=torch.float64),
                new_slots)

    def to_dict(self) -> dict:
        """The history as plain data (one device->host copy): batches oldest first, and per module
        with any value, each field as a list over those batches (None where it has none)."""
        order = sorted((b, s) for s, b in enumerate(self.slot_batch) if b is not None)
        host = self.table.cpu()
        modules = []
        slots = [s for _, s in order]
        for owner in self.owners:
            rows = host[owner.index][slots] if slots else host[owner.index][:0]
            if not bool((rows > _EMPTY).any()):
                continue
            entry = {"name": owner.name, "class": owner.cls}
            dtypes = self.dtypes.get(owner.index, [None, None])
            entry["dtype"], entry["grad_dtype"] = dtypes
            for i, field in enumerate(FIELDS):
                column = rows[:, i].tolist()
                sign = -1.0 if i in _NEGATED else 1.0
                entry[field] = [None if (v == _EMPTY or not math.isfinite(v)) else sign * v for v in column]
            modules.append(entry)
        return {"window": self.window, "batches": [b for b, _ in order], "modules": modules}


_native_fold = getattr(ops.native_module(), "fold_lines", None)
_FOLD_LAYOUT = [_NCOLS, _ABS_MAX, _MIN_NONZERO, _SUBNORMAL, OUT_MAX, IN_MAX, MIN_NZ, GRAD_MAX, GRAD_MIN_NZ, GRAD_SUB]
