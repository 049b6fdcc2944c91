"""The per-batch weight table: one multi-tensor stats launch per batch for every watched
parameter, and a 0-dim flag per module (NaN when one of its own weights is non-finite) that rides
along in the module's first frame of the batch, so the ring trips at the first frame that uses a
non-finite weight, exactly where Transformers would."""
from __future__ import annotations

import math

import torch
from torch.nn.parameter import is_lazy

from .. import ops, schema
from .frames import plain_values
from .ring import WEIGHT_HEADROOM, outside_inference_mode

# Largest finite value of each dtype whose headroom numguard watches (numguard.schema).
LOW_PRECISION_MAX = {getattr(torch, name): float(schema.DTYPES[name].max)
                     for name in schema.LOW_PRECISION_DTYPES if hasattr(torch, name)}


def stats_device(p):
    """The device whose launch computes `p`'s stats: its own. (Tests route some CPU parameters to a
    stand-in key here to exercise the multi-device path on a machine without a second device.)"""
    return p.device


def _watchable(p):
    # A lazy module's parameter (nn.LazyLinear) has no shape before its first forward: it is
    # watched from the batch after (WeightTable.lazy).
    return p.device.type != "meta" and not is_lazy(p) and not p.is_complex() and p.layout == torch.strided


def _unique_params(params, on_unchecked=None):
    """Every watched parameter once (tied weights once), in module order. A tensor subclass whose
    values cannot be read (NOTE: [tensor subclasses]) is left out and told to `on_unchecked`."""
    unique = []
    seen = set()
    for owner, own in params:
        for name, p in own:
            if id(p) in seen:
                continue
            seen.add(id(p))
            if type(p) not in _PLAIN and plain_values(p) is None:
                if on_unchecked is not None:
                    on_unchecked(owner, name, p)
                continue
            if _watchable(p):
                unique.append(p)
    return unique


_PLAIN = (torch.Tensor, torch.nn.Parameter)


class WeightTable:
    """Per-batch stats of every parameter of the watched modules, kept on the device.

    `tables[batch] = (stats [W, 8], layout)`; layout rows are parameters, each owner knows its
    rows (`owner.widx`) and names (`owner.wnames`)."""

    def __init__(self, owners, headroom, on_unchecked=None):
        self.owners = owners
        self.on_unchecked = on_unchecked  # (owner, parameter name, tensor): a weight not checked
        self.headroom = headroom
        self.tables = {}
        self.layout = None
        self._cache = None           # (parameter ids, layout, positions of the watched ones, dtypes, any subclass)
        self.limits_inv = None       # 1 / dtype max per row (0 for wide dtypes), for headroom
        self._groups = None          # (device per row, rows per device, inverse order on the table's device)
        self.lazy = []               # parameters of lazy modules not yet made: the layout is rebuilt once they are
        walk = getattr(ops.native_module(), "ParameterWalk", None)
        self._walk = walk() if walk is not None else None  # the steady-state batch (csrc/weights.cpp)

    def _current_params(self):
        params = []
        for owner in self.owners:
            module = owner.ref()
            if module is None:
                continue
            own = []
            seen = set()
            for name, p in module._parameters.items():
                if p is None or id(p) in seen:
                    continue
                seen.add(id(p))
                own.append((name, p))
            params.append((owner, own))
        return params

    @outside_inference_mode
    def record(self, batch, ring, move_to):
        """Compute batch `batch`'s table (one launch) and the owners' weight flags. Every batch
        recomputes it: parameter version counters cannot be trusted to skip it, since writes
        through `.data` do not bump them. `move_to(device)` is called when the model moved."""
        if self.lazy and not any(map(is_lazy, self.lazy)):
            self.lazy = []
            self._cache = None   # a lazy module made its parameters (same objects): a new layout
        cache = self._cache
        stats = None
        if self._walk is not None and cache is not None and cache[1] is self.layout and not self.lazy:
            stats = self._walk.stats(self.owners)
        if stats is None:
            stats = self._record_stats(ring, move_to)
            if stats is None:
                return
        layout = self.layout
        self.tables[batch] = (stats, layout)
        bad = (stats[:, schema.NAN] + stats[:, schema.POS_INF] + stats[:, schema.NEG_INF]) > 0
        per_ref = torch.where(bad, math.nan, 0.0).to(torch.float32).index_select(0, layout["wi"])
        flags = layout["flags"]
        flags.zero_()
        flags.index_add_(0, layout["mi"], per_ref)
        if self.limits_inv is not None:
            over = (stats[:, schema.ABS_MAX] * self.limits_inv > self.headroom).any()
            flag = ring.state_buf[WEIGHT_HEADROOM:WEIGHT_HEADROOM + 1]
            torch.maximum(flag, over.view(1).to(torch.int64), out=flag)

    def _record_stats(self, ring, move_to):
        """The stats of every watched parameter after a walk in Python (the layout is rebuilt when
        the parameters changed), or None when there is none."""
        current = [p for o in self.owners if (m := o.ref()) is not None for p in m._parameters.values()]
        fingerprint = tuple(map(id, current))
        cache = self._cache
        unique = None
        if cache is not None and cache[0] == fingerprint and cache[1] is self.layout:
            # The same parameter objects as last batch: pick the watched ones by position.
            unique = [current[i] for i in cache[2]]
            if [p.dtype for p in unique] != cache[3]:
                unique = None
        if unique is None:
            unique = self._build_layout()
            index = {id(p): i for i, p in reversed(list(enumerate(current)))}
            self._cache = (fingerprint, self.layout, [index[id(p)] for p in unique], [p.dtype for p in unique],
                           any(type(p) not in _PLAIN for p in unique))
        layout = self.layout
        if not layout["tensors_n"]:
            return None
        if unique[0].device != ring.device:
            # The model moved (e.g. .to(device) after watch()): start over on the new device.
            move_to(unique[0].device)
            unique = self._build_layout()
            self._cache = None
            layout = self.layout
        with torch.no_grad():
            # Subclasses (DTensor: this rank's shard; wrappers: their inner tensors) through their values.
            tensors = [plain_values(p) for p in unique] if self._cache is None or self._cache[4] else unique
            stats = ops.multi_tensor_stats(tensors, checked=True) if layout["one_device"] else \
                self._stats_by_device(tensors, layout["flags"].device)
        if self._walk is not None:
            cache = self._cache
            if cache is not None and layout["one_device"] and not cache[4] and unique[0].device == ring.device:
                # From the next batch on, the same parameters are picked natively.
                self._walk.remember(self.owners, cache[2])
            else:
                self._walk.forget()
        return stats

    def _stats_by_device(self, tensors, dev):
        """[W, 8] on `dev` for parameters spread over devices: one multi-tensor launch per device,
        on that device, then one copy of each device's small stats block to `dev` (never a copy
        of a weight, nor one copy per weight)."""
        keys = tuple(map(stats_device, tensors))
        groups = self._groups
        if groups is None or groups[0] != keys:
            rows = {}
            for i, key in enumerate(keys):
                rows.setdefault(key, []).append(i)
            order = [i for idx in rows.values() for i in idx]
            inverse = [0] * len(order)
            for j, i in enumerate(order):
                inverse[i] = j
            groups = self._groups = (keys, list(rows.values()), torch.tensor(inverse, dtype=torch.int64).to(dev))
        # A copy to the CPU stays blocking: a non-blocking one could be read before it lands.
        blocks = [ops.multi_tensor_stats([tensors[i] for i in idx], checked=True).to(
            dev, non_blocking=dev.type == "cuda") for idx in groups[1]]
        return torch.cat(blocks).index_select(0, groups[2])

    def _build_layout(self):
        params = self._current_params()
        unique = _unique_params(params, self.on_unchecked)
        self.lazy = [p for _, own in params for _, p in own if is_lazy(p)]
        index = {id(p): i for i, p in enumerate(unique)}
        wi, mi = [], []
        one_device = all(stats_device(p) == stats_device(unique[0]) for p in unique)
        owners_with = []
        rows = {}   # id(owner) -> (names, rows) in this layout (a report of an older batch reads its own)
        for owner in self.owners:
            owner.flag = None
        for owner, own in params:
            names, widx = [], []
            for name, p in own:
                if id(p) not in index:
                    continue
                names.append(name)
                widx.append(index[id(p)])
            owner.wnames = tuple(names)
            owner.widx = tuple(widx)
            rows[id(owner)] = (owner.wnames, owner.widx)
            if widx:
                owners_with.append(owner)
                for w in widx:
                    wi.append(w)
                    mi.append(len(owners_with) - 1)
        if not unique:
            self.layout = {"tensors_n": 0}
            self.limits_inv = None
            return unique
        dev = unique[0].device
        flags = torch.zeros(len(owners_with), dtype=torch.float32, device=dev)
        for i, owner in enumerate(owners_with):
            owner.flag = flags[i]
        self.layout = {
            "tensors_n": len(unique),
            "one_device": one_device,
            "wi": torch.tensor(wi, dtype=torch.int64).to(dev),
            "mi": torch.tensor(mi, dtype=torch.int64).to(dev),
            "flags": flags,
            "dtypes": [str(p.dtype) for p in unique],
            "rows": rows,
            "shapes": [list(p.shape) for p in unique],
        }
        limits = [(1.0 / LOW_PRECISION_MAX[p.dtype]) if p.dtype in LOW_PRECISION_MAX else 0.0 for p in unique]
        if self.headroom > 0 and any(limits):
            self.limits_inv = torch.tensor(limits, dtype=torch.float64).to(dev)
        else:
            self.limits_inv = None
        return unique

    def record_or_stop(self, batch, ring, move_to, warn_once):
        """record(), or stop watching weights after an internal error (`warn_once(key, text)`
        says so once): the weights are lost, never the job."""
        try:
            self.record(batch, ring, move_to)
        except Exception as exc:
            warn_once(("weights",), f"numguard: could not record weight stats ({type(exc).__name__}: "
                                    f"{exc}); weights are not watched from now on")
            self.disable()

    def disable(self):
        """Stop watching weights (after an internal error)."""
        for owner in self.owners:
            owner.flag = None
        self.layout = None
        if self._walk is not None:
            self._walk.forget()

    def forget(self):
        """Drop every table and the cached layout (the model moved to another device)."""
        self.tables.clear()
        self._cache = None
        self._groups = None
        if self._walk is not None:
            self._walk.forget()

    def drop_before(self, batch):
        """Forget the tables of batches before `batch` (no held frame refers to them)."""
        for b in [b for b in self.tables if b < batch]:
            del self.tables[b]

    def host_tables(self, batches):
        """The tables of `batches` on the host: batch -> (numpy stats, layout)."""
        out = {}
        for b in batches:
            entry = self.tables.get(b)
            if entry is not None:
                out[b] = (entry[0].cpu().numpy(), entry[1])
        return out

    def over_headroom(self, limit):
        """(owner, parameter name, abs max, dtype) for each weight past `limit` of its dtype's
        largest value, once per weight (host read; only after the headroom flag is up)."""
        if self.limits_inv is None:
            return []
        found = []
        tables = {b: t for b, t in self.host_tables(list(self.tables)).items() if t[1] is self.layout}
        limits = self.limits_inv.cpu().tolist()
        for owner in self.owners:
            for name, w in zip(owner.wnames, owner.widx):
                if w >= len(limits) or limits[w] == 0.0:
                    continue
                for stats, layout in tables.values():
                    if w < len(stats) and stats[w][schema.ABS_MAX] * limits[w] > limit:
                        dtype = getattr(torch, layout["dtypes"][w].replace("torch.", ""))
                        found.append((owner, name, float(stats[w][schema.ABS_MAX]), dtype))
                        limits[w] = 0.0
                        break
        with torch.inference_mode(False):
            self.limits_inv = torch.tensor(limits, dtype=torch.float64).to(self.limits_inv.device) \
                if any(limits) else None
        return found
