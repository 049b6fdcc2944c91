"""numguard.testing.faults: exact bit flips of each class, once or at every call, in a module's
output, a matrix product's output, or a weight; and what numguard finds of them."""
from __future__ import annotations

import random
import struct
import warnings

import pytest
import torch
import torch.nn as nn

import numguard
from numguard.inspector.spikes import ARM
from numguard.testing import SyncCounter, faults


def _bits32(v):
    return struct.unpack("<I", struct.pack("<f", v))[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind", faults.BIT_CLASSES)
def test_choose_bit_stays_in_its_class(dtype, kind):
    exp, mant, _ = faults._LAYOUT[dtype]
    rng = random.Random(1)
    bits = {faults.choose_bit(dtype, kind, rng) for _ in range(200)}
    span = {"sign": {exp + mant}, "exponent": set(range(mant + 3, mant + exp)),
            "high_mantissa": set(range(mant - 3, mant)), "low_mantissa": set(range(0, mant // 2))}[kind]
    assert bits <= span and len(bits) == len(span) if kind != "low_mantissa" else bits <= span


def test_flipped_changes_exactly_one_bit_and_keeps_the_graph():
    x = torch.tensor([1.5, -2.0, 0.0, 3.25], requires_grad=True)
    for bit in (0, 22, 23, 30, 31):
        y, before, after = faults.flipped(x * 1.0, 1, bit)
        assert _bits32(float(after)) ^ _bits32(-2.0) == 1 << bit
        assert torch.equal(y[[0, 2, 3]], x.detach()[[0, 2, 3]]) and float(before) == -2.0
    y.sum().backward()
    assert x.grad.tolist() == [1.0, 0.0, 1.0, 1.0]
    with pytest.raises(TypeError, match="int64"):
        faults.choose_bit(torch.int64, "sign", random.Random(0))
    with pytest.raises(ValueError, match="'mantissa'"):
        faults.inject_output(nn.Linear(2, 2), "mantissa")
    with pytest.raises(ValueError, match="at_call=-1"):
        faults.inject_output(nn.Linear(2, 2), at_call=-1)


@pytest.mark.parametrize("persistent", [False, True])
def test_inject_output_fires_once_or_at_every_call_and_is_removed(persistent):
    lin = nn.Linear(4, 4)
    x = torch.randn(3, 4)
    clean = lin(x)
    with faults.inject_output(lin, "sign", persistent=persistent, at_call=1, seed=3) as fault:
        outs = [lin(x) for _ in range(4)]
    assert torch.equal(outs[0], clean)
    changed = [not torch.equal(o, clean) for o in outs]
    assert changed == ([False, True, False, False] if not persistent else [False, True, True, True])
    assert fault.fired == sum(changed)
    rec = fault.records()[0]
    assert rec["after"] == -rec["before"] and rec["where"] == "output" and rec["bit"] == 31
    assert rec["over_amax"] == abs(rec["after"]) / float(clean.detach().abs().amax()) <= 1.0
    assert torch.equal(lin(x), clean)   # removed with the with-block


def test_inject_matmul_flips_a_product_inside_the_module():
    mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(5, 4)
    clean = mlp(x)
    with faults.inject_matmul(mlp, "exponent", at_call=1, bit=30) as fault:
        out = mlp(x)
    assert fault.fired == 1 and fault.records()[0]["where"] in ("addmm", "mm")
    assert not torch.equal(out, clean)
    assert torch.equal(mlp(x), clean)


def test_inject_weight_changes_one_element_and_remove_puts_it_back():
    lin = nn.Linear(4, 4)
    before = lin.weight.detach().clone()
    fault = faults.inject_weight(lin, kind="high_mantissa", seed=2)
    assert int((lin.weight != before).sum()) == 1 and fault.fired == 1
    fault.remove()
    assert torch.equal(lin.weight, before)
    with pytest.raises(ValueError, match="'gamma'"):
        faults.inject_weight(lin, "gamma")


def test_injecting_adds_no_host_sync():
    lin = nn.Linear(4, 4)
    fault = faults.inject_output(lin, "exponent", persistent=True)
    counter = SyncCounter()
    with counter():
        lin(torch.randn(2, 4))
    fault.remove()
    assert counter.total == 0 and fault.fired == 1


def test_an_exponent_flip_up_in_a_module_output_is_found_at_its_batch():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    insp = numguard.watch(model, report_to=None, spikes=True, on_trip="warn")
    # bit 30 (the exponent's top bit) of a value below 2 in magnitude: scaled by 2^128 (finite below
    # 1: a spike; from 1 on: Inf/NaN, a trip)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with faults.inject_output(model[0], "exponent", at_call=ARM + 4, bit=30) as fault:
            for _ in range(ARM + 8):
                model(torch.randn(16, 8))
    insp.close(check=False)
    spikes = [w.message.spike for w in caught if isinstance(w.message, numguard.SpikeWarning)]
    trips = [w.message for w in caught if isinstance(w.message, numguard.errors.NonFiniteWarning)]
    assert fault.fired == 1 and fault.records()[0]["factor"] > 1e30
    if trips:
        assert "batch_number=%d in 0 (Linear)" % (ARM + 4) in str(trips[0])
    else:
        assert spikes and spikes[0]["module"] == "0" and spikes[0]["batch"] == ARM + 4
