"""watch(quant=) measured by the recorder's own record_ call (NOTE: [quant in the stats call]):
record_'s quant arguments give quant_watch_'s records bit for bit, and a watched model's
fast-path module calls are measured there, with the same table (no host sync:
test_quant_watch.test_quant_adds_no_host_sync, which counts syncs with the fold on)."""
from __future__ import annotations

import pytest
import torch

import numguard
from numguard import ops
from numguard.inspector.quant_watch import QuantWatch
from numguard.quant import FORMAT_CODES, quant_stats
from numguard.schema import QUANT_FIELDS, QUANT_FORMATS

from test_quant_kernels import half_hostile
from test_quant_stats import hostile

pytestmark = pytest.mark.skipif(numguard.backend() != "native", reason="the native kernels are not loaded")

SQ, AMAX, EXP_MIN, EXP_MAX = (QUANT_FIELDS.index(f) for f in ("sq_error", "amax", "scale_exp_min", "scale_exp_max"))


def _bits(t):
    return [v.hex() for v in t.flatten().tolist()]


def _tensors(dtype):
    """Hostile tensors of `dtype` in several layouts: NaN/Inf/-0.0/subnormals/max, a non-contiguous
    view, an expanded one, a 0-dim one, all zeros, one long enough to be split across threads."""
    big = (torch.randn(300_000, generator=torch.Generator().manual_seed(3))
           * torch.exp2(torch.randint(-12, 12, (300_000,), generator=torch.Generator().manual_seed(4)))).to(dtype)
    out = [hostile(dtype, n=300, seed=1), big.view(600, 500).t(), big[:7].view(7, 1).expand(7, 9),
           torch.tensor(-3.5, dtype=dtype), torch.zeros(33, dtype=dtype), big,
           hostile(dtype, n=90, seed=2)[torch.arange(0, 90, 3)]]
    if dtype != torch.float32:
        out.append(half_hostile(dtype, "float8_e4m3fn"))
    return out


def _fold(xs, fmt, trip=False):
    """record_ of xs with every one measured: (records, sums[1]) and the ring it wrote."""
    ring, state = ops.new_ring(64)
    if trip:
        ops.record_(ring, state, [torch.tensor([float("nan")])], 0)
        assert state[0] != 0 or state.ne(torch.tensor(ops.STATE_INITIAL)).any()
    sums = torch.zeros((3, 6), dtype=torch.float64)
    records = torch.empty((len(xs), len(QUANT_FIELDS)), dtype=torch.float64)
    torch.ops.numguard.record_.default(ring, state, xs, 5, 0.0, 0, sums, 1, FORMAT_CODES[fmt],
                                       list(range(len(xs))), records)
    return records, sums, ring


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", list(QUANT_FORMATS))
def test_record_measures_as_quant_watch_bit_for_bit(fmt, dtype, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        xs = _tensors(dtype)
        records, sums, ring = _fold(xs, fmt)
        want_sums = torch.zeros((3, 6), dtype=torch.float64)
        want = torch.ops.numguard.quant_watch_.default(want_sums, 1, xs, FORMAT_CODES[fmt])
        assert _bits(records) == _bits(want)
        assert _bits(sums) == _bits(want_sums)
        # the stats are record_'s as ever
        plain_ring, plain_state = ops.new_ring(64)
        ops.record_(plain_ring, plain_state, xs, 5)
        assert _bits(ring) == _bits(plain_ring)
        # and the records are quant_stats' at the scale current scaling picks: per-tensor formats
        # measure v = x * scale (one float32 rounding, as quant_watch_) at scale 1, the squares
        # divided back by scale^2 (to float64 rounding)
        for x, record in zip(xs, records):
            if QUANT_FORMATS[fmt].scale != "tensor":
                assert torch.equal(record, quant_stats(x, fmt)), (x, record)
                continue
            finite = x.float()[torch.isfinite(x.float())]
            scale = torch.ones((), dtype=torch.float32)
            if x.numel() == finite.numel() and finite.numel() and finite.abs().amax() > 0:
                fmax = torch.tensor(QUANT_FORMATS[fmt].element_max, dtype=torch.float32)
                amax = finite.abs().amax()
                scale = fmax / amax
                scale = torch.nextafter(scale, torch.zeros(())) if amax * scale > fmax else scale
            ref = quant_stats(x.float() * scale, fmt)
            ref[SQ] /= scale.double() ** 2
            ref[AMAX] = finite.abs().amax().double() if finite.numel() else 0.0
            ref[EXP_MIN] = ref[EXP_MAX] = torch.frexp(scale)[1].double() - 1
            keep = [i for i in range(len(QUANT_FIELDS)) if i != SQ]
            assert torch.equal(record[keep], ref[keep]), (x, record, ref)
            assert record[SQ].item() == pytest.approx(ref[SQ].item(), rel=1e-12, abs=0.0)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "mxfp8_e5m2", "nvfp4"])
def test_a_frozen_ring_still_measures(fmt):
    xs = _tensors(torch.float32)[:3]
    records, sums, ring = _fold(xs, fmt, trip=True)
    want_sums = torch.zeros((3, 6), dtype=torch.float64)
    want = torch.ops.numguard.quant_watch_.default(want_sums, 1, xs, FORMAT_CODES[fmt])
    assert _bits(records) == _bits(want) and _bits(sums) == _bits(want_sums)
    assert torch.equal(ring[5:8], torch.zeros(3, ring.shape[1]))  # frozen: no stats written


def test_record_names_bad_quant_arguments():
    ring, state = ops.new_ring(8)
    x = torch.randn(4)
    sums = torch.zeros((2, 6), dtype=torch.float64)
    op = torch.ops.numguard.record_.default
    with pytest.raises(ValueError, match=r"quant_xs\[0\] = 3 is not an index of xs \(1 tensors\)"):
        op(ring, state, [x], 0, 0.0, 0, sums, 0, 0, [3], None)
    with pytest.raises(ValueError, match="unknown quant format code 9"):
        op(ring, state, [x], 0, 0.0, 0, sums, 0, 9, [0], None)
    with pytest.raises(ValueError, match="row 2 is outside"):
        op(ring, state, [x], 0, 0.0, 0, sums, 2, 0, [0], None)
    with pytest.raises(ValueError, match=r"quant_records must be .* shape \[1, 10\]"):
        op(ring, state, [x], 0, 0.0, 0, sums, 0, 0, [0], torch.empty(2, 10, dtype=torch.float64))
    with pytest.raises(ValueError, match="Long"):
        op(ring, state, [torch.arange(4)], 0, 0.0, 0, sums, 0, 0, [0], None)
    assert torch.equal(sums, torch.zeros_like(sums))


def test_the_fake_implementation_takes_the_quant_arguments():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        ring, state = ops.new_ring(8)
        sums = torch.zeros((2, 6), dtype=torch.float64)
        out = torch.empty((1, 10), dtype=torch.float64)
        torch.ops.numguard.record_.default(ring, state, [torch.randn(4)], 0, 0.0, 0, sums, 1, 0, [0], out)


class Outlier(torch.nn.Module):
    def forward(self, x):
        return x * torch.cat([x.new_full((1,), 1e7), x.new_ones(x.shape[-1] - 1)])


class Model(torch.nn.Module):
    """Fast-path calls (Linear, GELU, Dropout, LayerNorm, a module returning its input), one that
    is not (a tuple out), NaN-free values that underflow float8."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(32, 64)
        self.act = torch.nn.GELU()
        self.spike = Outlier()
        self.drop = torch.nn.Dropout(0.0)
        self.same = torch.nn.Identity()
        self.norm = torch.nn.LayerNorm(64)
        self.fc2 = torch.nn.Linear(64, 32)

    def forward(self, x):
        h = self.same(self.drop(self.spike(self.act(self.fc1(x)))))
        return self.fc2(self.norm(h)), h.sum()


def _table(fmt, fold, dtype=torch.float32, backward=False, monkeypatch=None, steps=3):
    torch.manual_seed(0)
    model = Model().to(dtype)
    calls = []
    if not fold:
        monkeypatch.setattr(QuantWatch, "_start_fold", lambda self: None)
    measure = QuantWatch.measure
    monkeypatch.setattr(QuantWatch, "measure", lambda self, ts, into=None: calls.append(len(ts)) or measure(self, ts, into))
    insp = numguard.watch(model, report_to=None, quant=fmt, backward=backward)
    feature = next(f for f in insp.features if isinstance(f, QuantWatch))
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        out, total = model(torch.randn(16, 32, generator=gen).to(dtype))
        if backward:
            (out.float().pow(2).mean() + total.float() * 0).backward()
    sums = {device: s.clone() for device, s in feature.sums.items()}
    rows = {(r.module, r.quantity): (r.elements, r.batches) for r in feature.rows.values() if r.batches}
    table = insp.quant_table()
    folded = feature.folded
    insp.close(check=False)
    by_row = {}
    for r in feature.rows.values():
        if r.batches:
            by_row[(r.module, r.quantity)] = _bits(sums[torch.device("cpu")][r.index])
    return table, by_row, rows, calls, folded


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "mxfp8_e4m3", "nvfp4"])
def test_watch_measures_fast_path_calls_in_the_record_call_with_the_same_sums(fmt, dtype, monkeypatch):
    table, sums, rows, calls, folded = _table(fmt, True, dtype, monkeypatch=monkeypatch)
    monkeypatch.undo()
    table_apart, sums_apart, rows_apart, calls_apart, folded_apart = _table(fmt, False, dtype,
                                                                            monkeypatch=monkeypatch)
    assert folded and not folded_apart
    assert sums == sums_apart and rows == rows_apart and table == table_apart
    assert table and table[0]["module"] in ("spike", "drop", "same") and table[0]["underflow"] > 0.4
    # apart: a quant_watch_ call per module call with a tensor not measured before in the batch
    # (Dropout(0) and Identity return the tensor they were given); folded: the root's only (a
    # tuple out), the rest are measured by the record_ calls
    assert len(calls_apart) == 3 * 6, calls_apart
    assert len(calls) == 3, calls


def test_backward_gradients_and_the_fold_together(monkeypatch):
    table, sums, rows, _, folded = _table("float8_e4m3fn", True, backward=True, monkeypatch=monkeypatch)
    monkeypatch.undo()
    table_apart, sums_apart, rows_apart, _, _ = _table("float8_e4m3fn", False, backward=True, monkeypatch=monkeypatch)
    assert folded and sums == sums_apart and rows == rows_apart and table == table_apart
    assert any(r["quantity"] == "grad_output" for r in table)
