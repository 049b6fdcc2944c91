"""A small device-side history per watched module, for precision advice (``Inspector.advice()``,
``python -m numguard advise DUMP``).

At each healthy check, the records of the frames that check confirmed are folded into a table
``[modules, window, fields]`` on the ring's device with ONE ``scatter_reduce_`` (amax): no host
sync, no per-module device work, and nothing at all in the module hooks. The host only builds the
index lists (a few list appends per recorded tensor, at the check). The table holds the last
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

import torch

from .. import schema
from .frames import TENSOR
from .ring import outside_inference_mode

WINDOW = 64
FIELDS = ("out_abs_max", "in_abs_max", "min_nonzero", "grad_abs_max", "grad_min_nonzero", "grad_subnormal_share")
OUT_MAX, IN_MAX, MIN_NZ, GRAD_MAX, GRAD_MIN_NZ, GRAD_SUB = range(len(FIELDS))
_NEGATED = (MIN_NZ, GRAD_MIN_NZ)
# What an empty cell holds: maxima start at -inf ("no value"), negated minima too.
_EMPTY = -math.inf
_NCOLS = schema.NUM_STATS


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

    @outside_inference_mode
    def fold(self, frames, ring):
        """Fold the records of `frames` (confirmed healthy, still in `ring`) into the table."""
        src, mult, cells = [], [], []
        nf = len(FIELDS)
        window = self.window
        size = ring.size
        oldest = ring.pos - size
        new_slots = []
        for f in frames:
            section = f.section
            owner = f.owner
            if section == "forward":
                row = owner.index
                if row < 0:
                    continue
                forward = True
            elif section == "backward" and f.labels and f.labels[0].startswith("grad_"):
                row = self.by_name.get(owner.name)
                if row is None:
                    continue
                forward = False
            else:
                continue
            slot = f.batch % window
            if self.slot_batch[slot] != f.batch:
                self.slot_batch[slot] = f.batch
                new_slots.append(slot)
            base = (row * window + slot) * nf
            t = 0
            for label, kind in zip(f.labels, f.kinds):
                if kind & 3 != TENSOR:
                    continue
                p = f.positions[t]
                dtype = f.dtypes[t]
                shape = f.shapes[t]
                t += 1
                if p < oldest or not dtype.is_floating_point:
                    continue
                r = (p % size) * _NCOLS
                if forward:
                    big = OUT_MAX if label.startswith("output") else IN_MAX
                    src += (r + schema.ABS_MAX, r + schema.MIN_NONZERO)
                    mult += (1.0, -1.0)
                    cells += (base + big, base + MIN_NZ)
                    if big == OUT_MAX and row not in self.dtypes:
                        self.dtypes[row] = [str(dtype), None]
                else:
                    numel = math.prod(shape) if shape else 1
                    src += (r + schema.ABS_MAX, r + schema.MIN_NONZERO, r + schema.SUBNORMAL)
                    mult += (1.0, -1.0, 1.0 / numel if numel else 0.0)
                    cells += (base + GRAD_MAX, base + GRAD_MIN_NZ, base + GRAD_SUB)
                    kinds = self.dtypes.setdefault(row, [None, None])
                    if kinds[1] is None:
                        kinds[1] = str(dtype)
        table = self.table
        for slot in new_slots:   # a slot taken by a newer batch starts empty (one fill per batch)
            table[:, slot].fill_(_EMPTY)
        if not src:
            return
        device = table.device
        src_t = _to_device(src, torch.int64, device)
        mult_t = _to_device(mult, torch.float64, device)
        cells_t = _to_device(cells, torch.int64, device)
        values = ring.ring.reshape(-1).index_select(0, src_t).mul_(mult_t)
        # MIN_NONZERO is +inf when a tensor has no non-zero value: -inf after negation, an empty cell.
        table.view(-1).scatter_reduce_(0, cells_t, values, "amax")

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


def _to_device(values, dtype, device):
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        # From pinned memory without waiting: the copy is ordered before the ops that read it.
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)
