"""A model spread over devices records each tensor on its own device, into that device's ring
(NOTE: [one ring per device] in numguard/inspector/ring.py), and reports exactly what it would on
one device.

A CPU-only machine has no second device, so these tests route tensors to a stand-in one: float64
tensors (the middle stage runs in float64, entered and left by a cast as a pipeline stage is by a
.to(device)) go to a side ring of their own, and float64 parameters form the weight table's second
device group. The same model unrouted is the single-device reference."""
from __future__ import annotations

import math
import warnings

import pytest
import torch

import numguard
from numguard.inspector import ring as ring_module
from numguard.inspector import weights as weights_module
from inspector_helpers import SyncCounter, quiet

SIDE = "stand-in device"


def route(x):
    return SIDE if x.dtype == torch.float64 else None


class Head(torch.nn.Module):
    """Takes the middle stage's float64 output (a frame across both devices)."""

    def __init__(self, d, clean):
        super().__init__()
        self.lin = torch.nn.Linear(d, d)
        self.clean = clean

    def forward(self, h):
        h = h.float()
        return self.lin(torch.nan_to_num(h) if self.clean else h)


class Staged(torch.nn.Module):
    """a (main device) -> mid, a stack of float64 layers (the other device) -> head (main)."""

    def __init__(self, d=8, layers=12, clean_head=False):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(d, d)
        self.mid = torch.nn.Sequential(*[torch.nn.Linear(d, d) for _ in range(layers)]).double()
        self.head = Head(d, clean_head)

    def forward(self, x):
        return self.head(self.mid(self.a(x).double()))


def _watch(model, routed, monkeypatch, **options):
    if routed:
        monkeypatch.setattr(weights_module, "stats_device",
                            lambda p: SIDE if p.dtype == torch.float64 else p.device)
    insp = numguard.watch(model, **quiet(max_frames_to_save=5, **options))
    if routed:
        insp._ring.set_route(route)
    return insp


def _report(make, plant, routed, monkeypatch, **options):
    """The report of the batch that trips once `plant(model)` made a value non-finite, after a
    healthy one."""
    model = make()
    x = torch.ones(2, 8)
    insp = _watch(model, routed, monkeypatch, **options)
    try:
        with torch.no_grad():
            model(x)
            plant(model)
            with pytest.raises(numguard.NonFiniteError) as info:
                model(x)
                insp.check_now("batch end")  # the async check reports at the next check
        return info.value, insp
    finally:
        insp.close()
        monkeypatch.undo()


def _spy_sanitize(monkeypatch):
    calls = []
    original = ring_module.FrameRing.sanitize

    def sanitize(self, xs):
        calls.append(len(xs))
        return original(self, xs)

    monkeypatch.setattr(ring_module.FrameRing, "sanitize", sanitize)
    return calls


@pytest.mark.parametrize("options", [{}, {"check": "async"}, {"ops": True}], ids=["sync", "async", "ops"])
def test_nan_on_the_second_device_is_reported_as_on_one_device(backend, monkeypatch, options):
    def plant(model):
        model.mid[7].weight[0, 0] = math.nan

    expected, _ = _report(Staged, plant, False, monkeypatch, **options)
    calls = _spy_sanitize(monkeypatch)
    got, insp = _report(Staged, plant, True, monkeypatch, **options)
    assert insp._ring.sides and insp._ring.sides[0].key == SIDE  # the stage had a ring of its own
    assert calls == []  # nothing was copied to the main device
    assert got.module == expected.module == "mid.7"
    assert "mid.7 Linear" in got.report and "nan" in got.report
    assert got.report == expected.report


def test_first_trip_across_devices_is_reported(backend, monkeypatch):
    def side_first(model):  # the main device trips after it (the inf flows on into head)
        model.mid[3].bias.fill_(math.inf)

    expected, _ = _report(Staged, side_first, False, monkeypatch)
    got, _ = _report(Staged, side_first, True, monkeypatch)
    assert got.module == expected.module == "mid.3"
    assert got.report == expected.report

    def main_first(model):  # the other device trips after it
        model.a.bias[0] = math.nan

    expected, _ = _report(Staged, main_first, False, monkeypatch)
    got, _ = _report(Staged, main_first, True, monkeypatch)
    assert got.module == expected.module == "a"
    assert got.report == expected.report


def test_trip_only_on_the_second_device_is_seen_by_the_check(backend, monkeypatch):
    def make():
        return Staged(clean_head=True)  # head drops the NaN: the main device never trips

    def plant(model):
        model.mid[11].bias[1] = math.nan

    expected, _ = _report(make, plant, False, monkeypatch)
    got, insp = _report(make, plant, True, monkeypatch)
    assert got.module == expected.module == "mid.11"
    assert got.report == expected.report


def test_records_stay_on_their_device_until_a_check(backend, monkeypatch):
    model = Staged()
    insp = _watch(model, True, monkeypatch)
    ring = insp._ring
    seen = {}

    def before_head(module, args):  # mid has run on the other device; no check yet
        f = [f for f in ring.frames if f.owner.name == "mid.5" and f.section == "forward"][-1]
        rows = [p % ring.size for p in f.positions[:2]]  # input[0], output (then the weight flag)
        seen["rows"] = rows
        seen["side"] = ring.sides[0].ring[rows].clone()
        seen["main"] = ring.ring[rows].clone()

    model.head.register_forward_pre_hook(before_head)
    with torch.no_grad():
        model(torch.ones(2, 8))
    merged = ring.ring[seen["rows"]].clone()
    insp.close()
    # Written on the other device only; the main ring got them at the check.
    assert float(seen["side"][:, numguard.schema.ABS_MAX].abs().sum()) > 0
    assert not torch.equal(seen["main"], seen["side"])
    assert torch.equal(merged, seen["side"])


def test_one_state_read_per_check_and_no_copies(backend, monkeypatch):
    model = Staged()
    x = torch.ones(2, 8)
    insp = _watch(model, True, monkeypatch)
    calls = _spy_sanitize(monkeypatch)
    launches = []
    original = weights_module.ops.multi_tensor_stats

    def multi_tensor_stats(xs, checked=False):
        launches.append(len(list(xs)))
        return original(xs, checked)

    monkeypatch.setattr(weights_module.ops, "multi_tensor_stats", multi_tensor_stats)
    monkeypatch.setattr(weights_module.ops, "tensor_stats", None)  # never one launch per weight
    with torch.no_grad():
        model(x)
        launches.clear()
        batches = 3
        with SyncCounter()() as counter:
            for _ in range(batches):
                model(x)
    insp.close()
    assert counter.in_hooks == 0, counter.where
    assert counter.numguard == batches, counter.where  # one state read per check, both devices
    assert calls == []
    # One weight-table launch per device per batch: a and head.lin's 4 weights, mid's 24.
    assert sorted(launches) == sorted([4, 24] * batches)


def test_weight_table_matches_one_device(backend, monkeypatch):
    model = Staged()
    with torch.no_grad():
        model.mid[2].weight[1, 1] = math.inf
    tables = []
    for routed in (False, True):
        insp = _watch(model, routed, monkeypatch)
        insp._weights.record(0, insp._ring, insp._move_to)
        stats, layout = insp._weights.tables[0]
        tables.append((stats.clone(), layout["one_device"]))
        insp.close()
        monkeypatch.undo()
    (single, one), (spread, many) = tables
    assert one and not many
    assert torch.equal(single, spread)


def test_warn_resets_every_device_and_goes_on(backend, monkeypatch):
    model = Staged()
    insp = _watch(model, True, monkeypatch, on_trip="warn")
    bias = model.mid[6].bias
    with torch.no_grad():
        model(torch.ones(2, 8))
        bias[0] = math.nan
        with pytest.warns(numguard.errors.NonFiniteWarning, match="mid.6"):
            model(torch.ones(2, 8))
        bias[0] = 0.0
        model(torch.ones(2, 8))  # healthy again: no second warning
        state = [int(v) for v in insp._ring.sides[0].state.tolist()]
    insp.close()
    assert state == list(numguard.schema.STATE_INITIAL)


def test_growth_keeps_every_device_in_step(backend, monkeypatch):
    def make():
        return Staged(layers=40)  # more records in one batch than the first ring holds

    def plant(model):
        model.mid[39].weight[0, 0] = math.nan

    expected, _ = _report(make, plant, False, monkeypatch)
    got, insp = _report(make, plant, True, monkeypatch)
    assert insp._ring.sides[0].ring.shape == insp._ring.ring.shape
    assert insp._ring.size > 64
    assert got.report == expected.report


@pytest.mark.parametrize("main, side, merged", [
    ((0, -1, 0, -1), (1, 7, 0, -1), (1, 7, 0, -1)),
    ((1, 9, 0, -1), (1, 7, 0, -1), (1, 7, 0, -1)),
    ((1, 5, 1, 3), (1, 7, 1, 2), (1, 5, 1, 2)),
    ((1, 5, 0, -1), (0, -1, 0, -1), (1, 5, 0, -1)),
])
def test_states_combine_to_the_earliest_trip_and_headroom(main, side, merged):
    into = torch.tensor(main)
    ring_module._combine_state(into, torch.tensor(side))
    assert into.tolist() == list(merged)
    ring_module._combine_state(into, torch.tensor(side))  # a second merge changes nothing
    assert into.tolist() == list(merged)


class _Big(torch.nn.Module):
    def forward(self, x):
        return x * 0.7 * 65504


class _HalfStage(torch.nn.Module):
    """A float32 module (main device), then a float16 one (the other device)."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Identity()
        self.big = _Big()

    def forward(self, x):
        return self.big(self.a(x).half())


def test_headroom_on_the_second_device_warns_as_on_one_device(backend, monkeypatch):
    messages = []
    for routed in (False, True):
        model = _HalfStage()
        insp = numguard.watch(model, **quiet())
        if routed:
            insp._ring.set_route(lambda x: SIDE if x.dtype == torch.float16 else None)
        with pytest.warns(numguard.errors.HeadroomWarning) as caught:
            model(torch.ones(4))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # re-armed on every device: no warning again
            for _ in range(3):
                model(torch.ones(4))
        assert insp.trips == 0
        assert bool(insp._ring.sides) == routed
        insp.close()
        messages.append([str(w.message) for w in caught])
    assert "big (_Big) output reached abs max" in messages[0][0]
    assert messages[1] == messages[0]
