"""watch(model, quant=FORMAT): the per-module low-precision what-if (numguard.inspector.quant_watch)."""
from __future__ import annotations

import glob
import json
import os
import warnings

import pytest
import torch

import numguard
from numguard import advice as _advice
from numguard import dump, env, report_types
from numguard.errors import InspectorWarning
from numguard.inspector.quant_watch import QuantWatch
from numguard.schema import QUANT_FIELDS, QUANT_FORMATS
from numguard.testing import SyncCounter

UNDER, NONZERO, SQ = (QUANT_FIELDS.index(f) for f in ("underflow", "nonzero", "sq_error"))


class Outlier(torch.nn.Module):
    """Scales one feature by 1e7: against that amax, float8_e4m3fn's smallest subnormal (2^-9 at
    scale 448 / amax) is far above the other features, which all quantize to zero."""

    def forward(self, x):
        return x * torch.cat([x.new_full((1,), 1e7), x.new_ones(x.shape[-1] - 1)])


class Underflows(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        self.spike = Outlier()

    def forward(self, x):
        return self.spike(self.lin(x))


class Healthy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(32, 64)
        self.act = torch.nn.GELU()
        self.fc2 = torch.nn.Linear(64, 32)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def _by_hand(tensors, fmt="float8_e4m3fn"):
    """Summed quant_stats records of `tensors` at Transformer Engine's current scale fmax / amax
    (float32; one step lower where amax * scale would pass fmax)."""
    fmax = torch.tensor(QUANT_FORMATS[fmt].element_max, dtype=torch.float32)
    total = torch.zeros(len(QUANT_FIELDS), dtype=torch.float64)
    for y in tensors:
        amax = y.abs().amax().float()
        scale = fmax / amax
        if amax * scale > fmax:
            scale = torch.nextafter(scale, torch.tensor(0.0))
        total += numguard.quant_stats(y, fmt, scale=float(scale))
    return total


def _outputs_of(module):
    """A list that gets a copy of each output of `module` (the test's own hook)."""
    seen = []
    module.register_forward_hook(lambda m, a, out: seen.append(out.detach().clone()))
    return seen


def test_the_underflowing_module_is_named_first_with_the_exact_fraction():
    torch.manual_seed(0)
    model = Underflows()
    seen = _outputs_of(model.spike)
    with numguard.watch(model, report_to=None, quant="float8_e4m3fn") as insp:
        for _ in range(3):
            model(torch.randn(8, 16))
        table = insp.quant_table()
    first = table[0]
    assert (first["module"], first["quantity"], first["batches"]) == ("spike", "output", 3)
    total = _by_hand(seen)
    assert first["underflow"] == (total[UNDER] / total[NONZERO]).item()  # the same counts, summed
    assert first["underflow"] > 0.5
    assert first["mse"] == pytest.approx((total[SQ] / sum(y.numel() for y in seen)).item(), rel=1e-6)
    assert set(first) == {"module", "quantity", "underflow", "saturated", "mse", "batches"}
    lin = next(r for r in table if r["module"] == "lin")
    assert lin["underflow"] < 0.05 and lin["saturated"] == 0.0
    keys = [(-r["underflow"], -r["mse"]) for r in table]
    assert keys == sorted(keys)


def test_advice_names_the_module_to_keep_in_bf16():
    torch.manual_seed(0)
    model = Underflows()
    with numguard.watch(model, report_to=None, quant="float8_e4m3fn") as insp:
        model(torch.randn(8, 16))
        advice = insp.advice()
    assert advice.quant_format == "float8_e4m3fn"
    reasons = dict(advice.keep_bf16)
    assert "output 9" in reasons["spike"] and "% underflow" in reasons["spike"]
    # lin's unit-scale outputs underflow nowhere; only the absolute MSE threshold can name it
    assert "underflow" not in reasons.get("lin", "")
    text = str(advice)
    assert "AutoswitchGemm" in text and "5% underflow or 1e-4 MSE" in text
    assert "keep in bf16 rather than float8_e4m3fn: " in text


def test_a_healthy_model_in_a_block_format_gets_small_values():
    torch.manual_seed(0)
    model = Healthy()
    with numguard.watch(model, report_to=None, quant="mxfp8_e4m3", backward=True) as insp:
        for _ in range(4):
            model(torch.randn(16, 32)).pow(2).mean().backward()
        table = insp.quant_table()
    quantities = {(r["module"], r["quantity"]) for r in table}
    assert ("fc1", "output") in quantities and ("fc1", "grad_output") in quantities
    for row in table:
        assert row["batches"] == 4
        # OCP MX scales a block to [256, 512) times its max: e4m3 clamps the few above 448
        assert 0.0 <= row["saturated"] < 0.05
        assert 0.0 <= row["underflow"] < 0.01
        assert 0.0 < row["mse"] < 1e-3


def test_nvfp4_measures_with_its_own_scales():
    torch.manual_seed(0)
    model = Healthy()
    seen = _outputs_of(model.fc1)
    with numguard.watch(model, report_to=None, quant="nvfp4") as insp:
        model(torch.randn(16, 32))
        row = next(r for r in insp.quant_table() if r["module"] == "fc1")
    record = numguard.quant_stats(seen[0], "nvfp4")
    assert row["underflow"] == (record[UNDER] / record[NONZERO]).item()
    assert row["mse"] == pytest.approx((record[SQ] / seen[0].numel()).item(), rel=1e-12)


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "mxfp8_e4m3", "nvfp4"])
def test_quant_adds_no_host_sync(fmt):
    def syncs(quant):
        torch.manual_seed(0)
        model = Healthy()
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        insp = numguard.watch(model, report_to=None, backward=True, quant=quant)
        feature = next((f for f in insp.features if isinstance(f, QuantWatch)), None)
        # with the native kernels, fc1, act and fc2 are measured by the recorder's record_ calls
        # (NOTE: [quant in the stats call])
        assert feature is None or feature.folded == (numguard.backend() == "native")
        counts = []
        for step in range(4):
            counter = SyncCounter()
            with counter():
                opt.zero_grad()
                model(torch.randn(16, 32)).pow(2).mean().backward()
                opt.step()
            if step:
                counts.append(counter.numguard)
        table = insp.quant_table()
        insp.close(check=False)
        return counts, table
    with_quant, table = syncs(fmt)
    assert table and table[0]["batches"] == 4  # it did measure
    assert with_quant == syncs(None)[0]


def test_the_option_and_its_variable():
    assert env.QUANT_FORMAT_NAMES == tuple(QUANT_FORMATS)
    for name in QUANT_FORMATS:
        assert env.validate_watch_options({"quant": name})["quant"] == name
    for off in (None, False, 0):
        assert env.validate_watch_options({"quant": off})["quant"] is None
    with pytest.raises(env.OptionError, match=r"quant='fp8'.*'float8_e4m3fn'.*'nvfp4'"):
        numguard.watch(Healthy(), quant="fp8")
    with pytest.raises(env.OptionError, match="quant=True"):
        env.validate_watch_options({"quant": True})
    assert env.settings_from_env({"NUMGUARD_QUANT": "NVFP4"}) == {"quant": "nvfp4"}
    assert env.settings_from_env({"NUMGUARD_QUANT": "0"}) == {"quant": None}
    with pytest.raises(env.EnvironmentSettingError, match="NUMGUARD_QUANT.*mxfp8_e5m2"):
        env.settings_from_env({"NUMGUARD_QUANT": "fp8"})


def test_the_variable_turns_it_on(monkeypatch):
    monkeypatch.setenv("NUMGUARD_QUANT", "mxfp8_e5m2")
    model = Healthy()
    with numguard.watch(model, report_to=None) as insp:
        model(torch.randn(4, 32))
        assert insp.quant == "mxfp8_e5m2"
        assert {r["module"] for r in insp.quant_table()} == {"", "fc1", "act", "fc2"}


def test_off_by_default():
    assert env.WATCH_DEFAULTS["quant"] is None
    model = Healthy()
    with numguard.watch(model, report_to=None) as insp:
        model(torch.randn(4, 32))
        assert insp.quant is None and insp.quant_table() == []
        assert not any(isinstance(f, QuantWatch) for f in insp.features)
        assert "quant" not in insp.history()
        assert insp.advice().quant_format is None


def test_its_own_failure_warns_once_and_stops_only_the_feature(monkeypatch):
    def broken(self, *args, **kwargs):
        raise RuntimeError("boom")
    # every measured call is counted by _count, whether the recorder's record_ call or
    # QuantWatch.measure measured it (NOTE: [quant in the stats call])
    monkeypatch.setattr(QuantWatch, "_count", broken)
    model = Healthy()
    with numguard.watch(model, report_to=None, quant="float8_e5m2") as insp:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                model(torch.randn(4, 32))
        ours = [w for w in caught if issubclass(w.category, InspectorWarning) and "quant=" in str(w.message)]
        assert len(ours) == 1 and "boom" in str(ours[0].message)
        assert insp.quant_table() == [] and insp.batches_finished == 3
        with pytest.raises(numguard.NonFiniteError):  # the NaN watch goes on
            model(torch.full((4, 32), float("nan")))


def test_the_dump_carries_the_table_and_advise_reads_it(tmp_path):
    torch.manual_seed(0)
    model = Underflows()
    with numguard.watch(model, report_to=None, quant="float8_e4m3fn", on_trip="dump",
                        dump_dir=str(tmp_path)) as insp:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model(torch.randn(8, 16))
            model(torch.full((8, 16), float("nan")))
        table = insp.quant_table()
    (path,) = glob.glob(os.path.join(str(tmp_path), "*.json"))
    data = dump.load(path)
    quant = data["history"]["quant"]
    spike = next(r for r in quant["rows"] if r["module"] == "spike")
    assert quant["format"] == "float8_e4m3fn" and spike["underflow"] > 0.5
    assert quant["rows"][0]["underflow"] > 0.5 and table[0]["underflow"] > 0.5
    typed = report_types.Report.from_json(data)
    assert json.dumps(typed.to_json(), sort_keys=True) == json.dumps(data, sort_keys=True)
    advice = _advice.advise(data["history"])
    assert "spike" in [name for name, _ in advice.keep_bf16]
    bad = dict(data["history"], quant={"format": "float8_e4m3fn", "rows": [dict(quant["rows"][0], mse="x")]})
    with pytest.raises(_advice.AdviceError, match=r"quant.rows\[0\].mse"):
        _advice.advise(bad)


def test_each_batch_has_its_own_underflow_and_advise_draws_the_heatmap(tmp_path, capsys):
    from numguard import cli

    torch.manual_seed(0)
    model = Underflows()
    seen = _outputs_of(model.spike)
    gains = [1.0, 1e-7, 1.0]   # the middle batch has no outlier: nothing underflows in it
    with numguard.watch(model, report_to=None, quant="float8_e4m3fn", on_trip="dump",
                        dump_dir=str(tmp_path)) as insp:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for gain in gains:
                model.spike.forward = lambda x, g=gain: Outlier.forward(model.spike, x) * torch.cat(
                    [x.new_full((1,), g), x.new_ones(x.shape[-1] - 1)])
                model(torch.randn(8, 16))
            model(torch.full((8, 16), float("nan")))
    (path,) = glob.glob(os.path.join(str(tmp_path), "*.json"))
    quant = dump.load(path)["history"]["quant"]
    assert quant["batches"] == [0, 1, 2, 3]
    row = next(r for r in quant["rows"] if (r["module"], r["quantity"]) == ("spike", "output"))
    for batch, y in enumerate(seen[:3]):
        total = _by_hand([y])
        assert row["series"][batch] == (total[UNDER] / total[NONZERO]).item()
    assert row["series"][0] > 0.5 and row["series"][1] == 0.0 and row["series"][3] is None  # all NaN
    out = tmp_path / "quant.png"
    capsys.readouterr()
    assert cli.main(["advise", path, "--quant-plot", str(out)]) == 0
    assert f"numguard: plot written to {out}" in capsys.readouterr().out
    assert out.stat().st_size > 1000
    bad = json.loads(open(path).read())
    bad["history"]["quant"]["rows"][0]["series"] = [0.5]
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    assert cli.main(["advise", str(tmp_path / "bad.json")]) == 2
    assert "quant.rows[0].series: expected a list of 4 fractions" in capsys.readouterr().err


@pytest.mark.skipif(numguard.backend() != "native", reason="the native kernels are not loaded")
@pytest.mark.parametrize("fmt", list(QUANT_FORMATS))
def test_the_native_measurement_equals_the_torch_operations(fmt):
    """One module call's tensors go through one native call (quant_watch_): its records and the
    row it adds equal the torch-operations path's (sq_error to float64 rounding), on hostile
    tensors of several dtypes and layouts."""
    from test_quant_stats import hostile
    torch.manual_seed(0)
    model = Healthy()
    insp = numguard.watch(model, report_to=None, quant=fmt)
    feature = next(f for f in insp.features if isinstance(f, QuantWatch))
    big = torch.randn(70_000) * torch.exp2(torch.randint(-12, 12, (70_000,))).float()
    tensors = [hostile(torch.float32, n=300, seed=4), big.view(350, 200).t(), big.bfloat16()[:1000],
               torch.randn(33), torch.zeros(5), hostile(torch.float16, n=90, seed=6)]
    assert feature._native(tensors, tensors[0].device)
    sums = torch.zeros((2, 6), dtype=torch.float64)
    native = feature.measure(tensors, into=(sums, 1))
    torch_path = feature._measure_with_torch([t.detach() for t in tensors], tensors[0].device)
    keep = [i for i in range(len(QUANT_FIELDS)) if i != SQ]
    assert torch.equal(native[:, keep], torch_path[:, keep]), (native, torch_path)
    assert torch.allclose(native[:, SQ], torch_path[:, SQ], rtol=1e-12, atol=0)
    assert torch.equal(sums[0], torch.zeros(6))
    assert torch.allclose(sums[1], native[:, :6].sum(dim=0), rtol=1e-12, atol=0)
    insp.close(check=False)



@pytest.mark.skipif(numguard.backend() != "native", reason="the native kernels are not loaded")
@pytest.mark.parametrize("fmt", list(QUANT_FORMATS))
def test_the_native_measurement_reads_half_tensors_as_their_float32_copies(fmt):
    """quant_watch_ reads bfloat16 / float16 outputs as they are (no float32 copy): the records
    and the row it adds are those of the float32 copies bit for bit, for every path of the
    kernel (the amax pass, the current scale, zeros, NaN in one tensor)."""
    from test_quant_kernels import half_hostile
    torch.manual_seed(1)
    insp = numguard.watch(Healthy(), report_to=None, quant=fmt)
    feature = next(f for f in insp.features if isinstance(f, QuantWatch))
    relu = torch.relu(torch.randn(3000)) * 100
    for dtype in (torch.bfloat16, torch.float16):
        tensors = [relu.to(dtype), (torch.randn(5000) * 1e-3).to(dtype), half_hostile(dtype, "float8_e4m3fn")]
        sums = torch.zeros((2, 6), dtype=torch.float64)
        sums_f32 = torch.zeros((2, 6), dtype=torch.float64)
        native = feature.measure(tensors, into=(sums, 0))
        copies = feature.measure([t.float() for t in tensors], into=(sums_f32, 0))
        assert [v.hex() for v in native.flatten().tolist()] == [v.hex() for v in copies.flatten().tolist()], dtype
        assert torch.equal(sums, sums_f32)
    insp.close(check=False)
