"""Real float8 tensors (numguard.float8): a float8 dtype (a cast the model made, torch._scaled_mm's
inputs) or a wrapper carrying float8 data and a scale (torchao's float8 training tensor; here
tests/subclass_cases.Float8Like, of the same shape). The NaN/Inf watch records them through their
data and scale, never crashes on them, and quant= gives the real cast its own row."""
from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch
from torch import nn

import numguard
from numguard.errors import InspectorWarning
from numguard.float8 import float8_parts, float8_values, real_quant_stats
from numguard.schema import QUANT_FIELDS

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from subclass_cases import Float8Like, to_float8  # noqa: E402

F = {name: QUANT_FIELDS.index(name) for name in QUANT_FIELDS}
NAN_E4M3 = 0x7F  # e4m3fn's NaN bits


class Cast(nn.Module):
    """Returns its input cast to float8: natively (`x.to(float8)`) or as a Float8Like; `bad` puts a
    NaN into the data."""

    def __init__(self, kind, dtype=torch.float8_e4m3fn):
        super().__init__()
        self.kind, self.dtype, self.bad = kind, dtype, False

    def forward(self, x):
        y = x.to(self.dtype) if self.kind == "native" else to_float8(x, self.dtype)
        if self.bad:
            data = y if self.kind == "native" else y._data
            data.view(torch.uint8).view(-1)[0] = NAN_E4M3 if self.dtype == torch.float8_e4m3fn else 0x7F
        return y


class CastModel(nn.Module):
    def __init__(self, kind, dtype=torch.float8_e4m3fn):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.cast = Cast(kind, dtype)

    def forward(self, x):
        return self.cast(self.lin(x))


def _ours(caught):
    return [str(w.message) for w in caught if issubclass(w.category, InspectorWarning)]


@pytest.mark.parametrize("kind", ["native", "wrapper"])
def test_a_float8_output_is_recorded_and_keeps_quant_on(backend, kind):
    torch.manual_seed(0)
    model = CastModel(kind)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with numguard.watch(model, report_to=None, quant="float8_e4m3fn") as insp:
            for _ in range(3):
                model(torch.randn(4, 8))
            table = insp.quant_table()
            frame = next(f for f in insp._ring.frames if f.owner.name == "cast")
            model.cast.bad = True
            with pytest.raises(numguard.NonFiniteError) as info:
                model(torch.randn(4, 8))
    assert _ours(caught) == []  # quant= did not stop, nothing was left unread
    rows = {(r["module"], r["quantity"]): r for r in table}
    assert ("lin", "output") in rows and rows[("cast", "real output")]["format"] == "float8_e4m3fn"
    assert rows[("cast", "real output")]["mse"] is None and rows[("cast", "real output")]["batches"] == 3
    assert frame.dtypes[-1] == (torch.float8_e4m3fn if kind == "native" else torch.float32)
    assert (info.value.module, info.value.labels) == ("cast", ["output"])


def test_the_real_cast_record_counts_the_data_exactly():
    fmax = 448.0
    values = torch.tensor([0.0, -0.0, 1.0, -fmax, fmax, 2.0 ** -9, 3.0, 416.0])
    data = values.to(torch.float8_e4m3fn)
    scale = torch.tensor(4.0)
    record = real_quant_stats(float8_parts(Float8Like(data, scale, torch.bfloat16)))
    assert record[F["nonfinite"]] == 0 and record[F["nonzero"]] == 8   # every finite element
    assert record[F["underflow"]] == 2 and record[F["saturated"]] == 2  # ±0, ±max
    assert record[F["amax"]] == fmax / 4.0 and torch.isnan(record[F["sq_error"]])
    assert record[F["scale_exp_min"]] == record[F["scale_exp_max"]] == 2  # 4 = 2^2
    assert record[F["saturated_blocks"]] == 1 and record[F["blocks"]] == 1
    data.view(torch.uint8)[0] = NAN_E4M3
    native = real_quant_stats(float8_parts(data))
    assert native[F["nonfinite"]] == 1 and native[F["nonzero"]] == 7 and native[F["underflow"]] == 1
    assert native[F["amax"]] == fmax
    e5m2 = torch.tensor([57344.0, 0.0, float("inf"), 1.0]).to(torch.float8_e5m2)
    record = real_quant_stats(float8_parts(e5m2))
    assert (record[F["nonfinite"]], record[F["saturated"]], record[F["underflow"]]) == (1, 1, 1)


def test_a_rowwise_scale_and_strided_data_are_read():
    data = torch.tensor([[1.0, 2.0], [448.0, 0.0]]).to(torch.float8_e4m3fn).t()  # non-contiguous
    scale = torch.tensor([[2.0], [8.0]])
    parts = float8_parts(Float8Like(data, scale, torch.float32))
    assert parts.format == "float8_e4m3fn" and parts.scale is scale
    assert torch.equal(float8_values(parts), data.float() / scale)
    record = real_quant_stats(parts)
    assert record[F["amax"]] == 448.0 / 2.0 and record[F["underflow"]] == 1  # data.t() puts 448 in row 0
    assert (record[F["scale_exp_min"]], record[F["scale_exp_max"]]) == (1, 3)


@pytest.mark.parametrize("scale, seen", [(float("inf"), "nan"), (float("nan"), "nan"), (0.0, "inf")])
def test_a_bad_scale_is_a_non_finite_value(backend, scale, seen):
    data = torch.ones(4).to(torch.float8_e4m3fn)
    values = float8_values(float8_parts(Float8Like(data, torch.tensor(scale), torch.float32)))
    stats = numguard.tensor_stats(values)
    assert stats[numguard.STAT_FIELDS.index("nan" if seen == "nan" else "pos_inf")] == 4
    assert real_quant_stats(float8_parts(Float8Like(data, torch.tensor(scale), torch.float32)))[F["nonfinite"]] == 4


def test_what_is_not_real_float8_is_not_read_as_it():
    from torch.testing._internal.two_tensor import TwoTensor

    assert float8_parts(torch.ones(2)) is None
    assert float8_parts(TwoTensor(torch.ones(2), torch.ones(2))) is None
    blocks = Float8Like(torch.ones(4, 64).to(torch.float8_e4m3fn), torch.ones(4, 2), torch.float32)
    assert float8_parts(blocks) is None  # a block scale does not broadcast: read as any wrapper


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_quant_gives_the_real_cast_its_exact_fractions(backend, dtype):
    torch.manual_seed(0)
    model = CastModel("wrapper", dtype)
    with torch.no_grad():  # the cast sees the input as it is
        model.lin.weight.copy_(torch.eye(8))
        model.lin.bias.zero_()
    seen = []
    model.cast.register_forward_hook(lambda m, a, out: seen.append(out))
    with numguard.watch(model, report_to=None, quant="mxfp8_e4m3") as insp:
        for _ in range(2):
            model(torch.randn(4, 8) * torch.tensor([1.0] * 7 + [1e9]))  # one huge feature: the rest underflow
        row = next(r for r in insp.quant_table() if (r["module"], r["quantity"]) == ("cast", "real output"))
    zeros = sum(int((y._data.float() == 0).sum()) for y in seen)
    at_max = sum(int((y._data.float().abs() == torch.finfo(dtype).max).sum()) for y in seen)
    assert row["format"] == str(dtype).split(".")[-1]
    assert row["underflow"] == zeros / 64 and row["saturated"] == at_max / 64
    assert zeros > 0


def test_scaled_mm_inputs_under_operation_mode(backend):
    class ScaledMM(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.randn(8, 16).to(torch.float8_e4m3fn).t()  # [16, 8] column-major, as _scaled_mm takes it
            self.bad = False

        def forward(self, x):
            a = x.to(torch.float8_e4m3fn)
            if self.bad:
                a.view(torch.uint8).view(-1)[0] = NAN_E4M3
            one = torch.ones((), dtype=torch.float32)
            return torch._scaled_mm(a, self.w, one, one, out_dtype=torch.float32)

    model = nn.Sequential(nn.Linear(16, 16), ScaledMM())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with numguard.watch(model, report_to=None, ops=True, quant="float8_e4m3fn") as insp:
            model(torch.randn(4, 16))
            model[1].bad = True
            with pytest.raises(numguard.NonFiniteError) as info:
                model(torch.randn(4, 16))
    assert _ours(caught) == []
    assert info.value.module == "1"
    assert "_scaled_mm" in info.value.report or "_to_copy" in info.value.report or "view" in info.value.report
    assert insp.quant_table()


def test_torchao_float8_training_tensor_if_installed():
    hp = pytest.importorskip("torchao.float8.float8_training_tensor")
    make = getattr(hp, "hp_tensor_and_scale_to_float8", None)
    if make is None:
        pytest.skip("this torchao has no hp_tensor_and_scale_to_float8")
    x = torch.randn(4, 8)
    scale = torch.tensor(448.0) / x.abs().amax()
    t = make(x, scale, torch.float8_e4m3fn)
    parts = float8_parts(t)
    assert parts is not None and parts.format == "float8_e4m3fn"
    assert torch.allclose(float8_values(parts), x, rtol=0.07, atol=1e-3)
