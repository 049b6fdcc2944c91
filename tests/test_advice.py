"""Precision advice: the per-module device history (numguard.inspector.history), Inspector.advice()
and `python -m numguard advise DUMP` (numguard.advice)."""
import glob
import json
import math
import os

import pytest
import torch
from torch import nn

import numguard
from numguard import advice as _advice
from numguard import cli
from numguard.inspector import history as _history
from inspector_helpers import quiet, watched_training_syncs


class Growing(nn.Module):
    """Three float16 Linears; the middle one's weight doubles at every step (a diverging layer),
    followed by a ReLU that only passes its values on."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(8, 8)
        self.grows = nn.Linear(8, 8)
        self.act = nn.ReLU()
        self.last = nn.Linear(8, 1)

    def forward(self, x):
        return self.last(self.act(self.grows(self.first(x))))


def _train_growing(steps, **options):
    model = Growing().to(torch.float16)
    with torch.no_grad():
        model.grows.weight.abs_()
        model.grows.bias.zero_()   # so that its output doubles exactly
    x = torch.full((4, 8), 1.0, dtype=torch.float16)
    insp = numguard.watch(model, **quiet(**options))
    for _ in range(steps):
        out = model(x)
        if options.get("backward"):
            out.float().sum().backward()
            model.zero_grad(set_to_none=True)
        with torch.no_grad():
            model.grows.weight.mul_(2)
    return model, insp


def test_demo_advice_names_the_diverging_module_first(capsys):
    from numguard import demo
    assert demo.main(["--steps", "40"]) == 0
    out = capsys.readouterr().out
    advice = out.split("numguard precision advice")[1].splitlines()
    assert advice[1].startswith("module ")
    first = advice[2]
    assert first.startswith("transformer.h.1.mlp.c_fc ") and "keep fp32/bf16: overflows fp16" in first
    assert "x2.00" in first   # the weight doubles at every step


def test_inspector_advice_ranks_the_growing_layer_first_and_projects_its_overflow():
    model, insp = _train_growing(6)
    result = insp.advice()
    insp.close()
    first = result.modules[0]
    assert first.name == "grows" and first.keep
    assert first.growth == pytest.approx(2.0, rel=1e-3)
    # 6 batches recorded, abs max doubling: the projection is log2(65504 / last abs max).
    assert first.batches_to_overflow == pytest.approx(math.log2(65504 / first.last_abs_max), rel=1e-6)
    # The ReLU after it holds the same values but only passes them on: ranked after the maker.
    names = [m.name for m in result.modules]
    assert names.index("act") > names.index("grows")
    assert result.batches == list(range(6))
    assert "grows" in result.keep_wider and "first" not in result.keep_wider
    text = str(result)
    assert text.splitlines()[2].startswith("grows ")


def test_history_values_are_the_recorded_abs_max_per_batch():
    model, insp = _train_growing(3)
    data = insp.history()
    insp.close()
    grows = next(m for m in data["modules"] if m["name"] == "grows")
    x = torch.full((4, 8), 1.0, dtype=torch.float16)
    with torch.no_grad():
        w = model.grows.weight.detach().clone()
        expected = []
        for step in range(3):
            w_then = w / (2 ** (3 - step))
            h = model.first(x)
            expected.append(float((h @ w_then.t() + model.grows.bias).abs().max()))
    assert grows["out_abs_max"] == pytest.approx(expected, rel=1e-3)
    assert grows["dtype"] == "torch.float16" and grows["grad_dtype"] is None
    assert data["loss_scale"] is None and data["loss_scale_source"] == "assumed"


def test_history_is_bounded_to_its_window():
    model = nn.Sequential(nn.Linear(2, 2))
    with numguard.watch(model, **quiet()) as insp:
        for _ in range(_history.WINDOW + 10):
            model(torch.randn(1, 2))
        data = insp.history()
    assert data["batches"] == list(range(10, _history.WINDOW + 10))
    assert all(len(m["out_abs_max"]) == _history.WINDOW for m in data["modules"])


def test_gradients_and_the_loss_scale_of_a_grad_scaler():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    with numguard.watch(model, **quiet(backward=True)) as insp:
        for _ in range(3):
            loss = model(torch.randn(16, 4)).pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
        result = insp.advice()
        data = insp.history()
    assert data["loss_scale_source"] == "GradScaler" and data["loss_scale"] == scaler.get_scale()
    assert result.loss_scale == scaler.get_scale() and result.loss_scale_source == "GradScaler"
    lin = next(m for m in result.modules if m.name == "2")
    assert lin.grad_abs_max is not None and lin.grad_dtype == "torch.float32"
    # The scale range follows from the gradients seen, taken back to scale 1.
    gmax = max(m.grad_abs_max for m in result.modules if m.grad_abs_max) / result.loss_scale
    gmin = min(m.grad_min_nonzero for m in result.modules if m.grad_min_nonzero) / result.loss_scale
    lo, hi = result.scale_range
    assert lo == 2.0 ** math.ceil(math.log2(6.103515625e-05 / gmin))
    assert hi == 2.0 ** math.floor(math.log2(65504.0 / gmax))
    assert "from GradScaler" in str(result)


def _history_of(gmax, gmin, scale=None, share=0.0, grad_dtype="torch.float32"):
    return {"window": 4, "batches": [0], "loss_scale": scale, "loss_scale_source": "GradScaler" if scale else "assumed",
            "modules": [{"name": "a", "class": "Linear", "dtype": "torch.float16", "grad_dtype": grad_dtype,
                         "out_abs_max": [1.0], "in_abs_max": [1.0], "min_nonzero": [0.5],
                         "grad_abs_max": [gmax], "grad_min_nonzero": [gmin], "grad_subnormal_share": [share]}]}


@pytest.mark.parametrize("scale", [None, 1024.0])
def test_scale_range_from_known_gradients(scale):
    s = scale or 1.0
    result = _advice.advise(_history_of(1.0 * s, 1e-6 * s, scale))
    assert result.scale_range == (64.0, 32768.0)   # 6.1e-5 / 1e-6 -> 2^6; 65504 / 1 -> 2^15
    assert result.loss_scale == s
    assert ("assumed" in str(result)) == (scale is None)


def test_gradients_wider_than_fp16_have_no_scale_and_are_kept_wide():
    result = _advice.advise(_history_of(10.0, 1e-12))
    assert result.scale_range is None
    assert result.keep_wider == ["a"] and "more than fp16's range" in result.modules[0].reasons[0]
    assert "no loss scale keeps every non-zero gradient" in str(result)


def test_float16_gradient_underflow_share_is_a_note_not_a_keep():
    result = _advice.advise(_history_of(1e-3, 5.96e-08, share=0.4, grad_dtype="torch.float16"))
    m = result.modules[0]
    assert m.underflow_share == 0.4 and not m.keep
    assert "40% of gradients subnormal at loss scale 1" in str(result)


def test_no_history_is_a_clear_error():
    with pytest.raises(_advice.AdviceError, match="no module history"):
        _advice.advise(None)
    with pytest.raises(_advice.AdviceError):
        _advice.advise({"modules": "x", "batches": []})


MALFORMED = [
    (("modules", 0, "out_abs_max"), ["abc"], r"modules\[0\]\.out_abs_max\[0\]: expected a finite number >= 0 or null, got 'abc'"),
    (("modules", 0, "out_abs_max"), [True], r"modules\[0\]\.out_abs_max\[0\]: .* got True"),
    (("modules", 0, "grad_min_nonzero"), [float("nan")], r"modules\[0\]\.grad_min_nonzero\[0\]: .* got nan"),
    (("modules", 0, "grad_abs_max"), [-1.0], r"modules\[0\]\.grad_abs_max\[0\]: .* got -1\.0"),
    (("modules", 0, "in_abs_max"), [float("inf")], r"modules\[0\]\.in_abs_max\[0\]: .* got inf"),
    (("modules", 0, "grad_subnormal_share"), [1.5], r"grad_subnormal_share\[0\]: expected .* <= 1 or null"),
    (("modules", 0, "min_nonzero"), [0.5, 0.5], r"modules\[0\]\.min_nonzero: expected a list of 1 values"),
    (("modules", 0, "min_nonzero"), 0.5, r"modules\[0\]\.min_nonzero: expected a list"),
    (("modules", 0, "name"), 3, r"modules\[0\]\.name: expected a string, got 3"),
    (("modules", 0, "grad_dtype"), 16, r"modules\[0\]\.grad_dtype: expected a dtype name or null"),
    (("modules", 0), "a", r"modules\[0\]: expected an object, got 'a'"),
    (("batches",), [1, 0], r"batches\[1\]: expected whole numbers >= 0 in increasing order, got 0"),
    (("batches",), ["0"], r"batches\[0\]: .* got '0'"),
    (("loss_scale",), -2.0, r"loss_scale: expected a finite number > 0 or null, got -2\.0"),
    (("loss_scale",), "1024", r"loss_scale: .* got '1024'"),
]


@pytest.mark.parametrize("path, value, message", MALFORMED, ids=[m[2][:40] for m in MALFORMED])
def test_a_malformed_history_is_an_error_naming_the_field(path, value, message):
    h = _history_of(1.0, 1e-6)
    target = h
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    with pytest.raises(_advice.AdviceError, match=message):
        _advice.advise(h)
    with pytest.raises(_advice.AdviceError, match=r"advise\(loss_scale=0\)"):
        _advice.advise(_history_of(1.0, 1e-6), loss_scale=0)


def test_gradient_minimum_without_maximum_and_subnormal_minimum():
    only_min = _advice.advise(_history_of(None, 1e-6))
    assert only_min.scale_range is None and "minimums but no maximums" in only_min.scale_note
    assert only_min.keep_wider == [] and "minimums but no maximums" in str(only_min)
    # A float64 gradient of 1e-320 (subnormal): 325 decades below 1.0, wider than any fp16 scale.
    subnormal = _advice.advise(_history_of(1.0, 1e-320, grad_dtype="torch.float64"))
    assert subnormal.scale_range is None
    assert subnormal.modules[0].reasons == ["gradients span more than fp16's range"]
    assert "span 320.0 decades" in str(subnormal)
    # Alone, it asks for a loss scale beyond what a (float32) GradScaler can hold: none.
    alone = _advice.advise(_history_of(1e-320, 1e-320, grad_dtype="torch.float64"))
    assert alone.scale_range is None and "largest safe scale is 2^127" in alone.scale_note
    # Growth past float64's range still projects the overflow (now, from a subnormal start).
    h = _history_of(1.0, 1e-6)
    h["batches"] = [0, 1]
    for key, value in h["modules"][0].items():
        if isinstance(value, list):
            h["modules"][0][key] = value * 2
    h["modules"][0]["out_abs_max"] = [1e-320, 1e300]
    grown = _advice.advise(h)
    assert grown.modules[0].growth == math.inf and grown.modules[0].batches_to_overflow == 0.0
    assert grown.modules[0].keep


# Values a well-formed history may hold: float64's extremes, fp16's limits, subnormals, nothing.
_EDGES = [None, 0.0, 5e-324, 1e-320, 2.2250738585072014e-308, 1e-300, 2.0 ** -24, 6.103515625e-05, 1e-3, 0.5,
          1.0, 65504.0, 65520.0, 1e38, 3.4028234663852886e38, 1e300, 1.7976931348623157e308]
_SCALES = [None, 5e-324, 1e-300, 2.0 ** -126, 0.5, 1.0, 1024.0, 2.0 ** 127, 1e300, 1.7976931348623157e308]


def _random_history(rng):
    n = rng.randint(0, 7)
    batches = sorted(rng.sample(range(0, 200), n))
    modules = []
    for i in range(rng.randint(0, 4)):
        m = {"name": rng.choice(["", f"m{i}", "block.0.attn"]), "class": "Linear",
             "dtype": rng.choice([None, "torch.float16", "torch.float32"]),
             "grad_dtype": rng.choice([None, "torch.float16", "torch.float64"])}
        for field in _advice._SERIES:
            if rng.random() < 0.1:
                continue  # left out, as an older writer may
            if field == "grad_subnormal_share":
                m[field] = [rng.choice([None, 0.0, 5e-324, 0.01, 0.5, 1.0]) for _ in batches]
            else:
                m[field] = [rng.choice(_EDGES) if rng.random() < 0.7 else 10.0 ** rng.uniform(-323, 308)
                            for _ in batches]
        modules.append(m)
    return {"window": 64, "batches": batches, "modules": modules, "loss_scale": rng.choice(_SCALES),
            "loss_scale_source": rng.choice(["GradScaler", "assumed", None])}


def test_every_well_formed_history_gets_advice():
    """A seeded sweep over well-formed histories built from edge values: advice never raises, its
    numbers are finite (growth may be inf: beyond float64), its loss scales are powers of two a
    GradScaler can hold, and the table renders."""
    import random
    rng = random.Random(7)
    for case in range(600):
        h = _random_history(rng)
        try:
            result = _advice.advise(h)
            text = str(result)
        except Exception as exc:  # pragma: no cover - the failure message names the history
            raise AssertionError(f"case {case}: {type(exc).__name__}: {exc}\n{h!r}") from exc
        assert text.startswith("numguard precision advice")
        assert len(result.modules) == len(h["modules"])
        assert result.keep_wider == [r.name for r in result.modules if r.keep]
        for r in result.modules:
            for field in ("abs_max", "fp16_fraction", "batches_to_overflow", "grad_abs_max", "grad_min_nonzero",
                          "min_nonzero", "underflow_share"):
                v = getattr(r, field)
                assert v is None or (math.isfinite(v) and v >= 0), (case, field, v)
            assert r.growth is None or r.growth > 1.0
        if result.scale_range is not None:
            lo, hi = result.scale_range
            assert 2.0 ** -126 <= lo <= hi <= 2.0 ** 127
            assert math.log2(lo).is_integer() and math.log2(hi).is_integer()


def test_advise_command_on_edge_and_malformed_histories(tmp_path, capsys):
    dump = {"format": "numguard-report", "version": 1, "batch_number": 0,
            "frames": [{"name": "", "class": "M", "labels": [], "kinds": [], "records": []}]}
    path = tmp_path / "edge.json"
    dump["history"] = _history_of(None, 1e-320, grad_dtype="torch.float64")
    path.write_text(json.dumps(dump))
    assert cli.main(["advise", str(path)]) == 0
    assert "minimums but no maximums" in capsys.readouterr().out
    dump["history"]["modules"][0]["grad_min_nonzero"] = ["tiny"]
    path.write_text(json.dumps(dump))
    assert cli.main(["advise", str(path)]) == 2
    err = capsys.readouterr().err
    assert "modules[0].grad_min_nonzero[0]" in err and "'tiny'" in err and "Traceback" not in err


def test_history_folds_without_host_syncs_in_hooks():
    steps = 3
    insp, counter = watched_training_syncs(steps, backward=True)
    data = insp.history()
    insp.close()
    assert counter.in_hooks == 0, counter.where
    assert counter.numguard <= steps, counter.where   # the one check read per step, nothing more
    assert len(data["batches"]) == steps + 1
    assert any(m["grad_abs_max"][-1] for m in data["modules"])


def test_advise_command_on_a_dump(tmp_path, capsys):
    model, insp = _train_growing(5, on_trip="dump", dump_dir=str(tmp_path))
    with pytest.warns(numguard.errors.NonFiniteWarning):
        for _ in range(30):
            model(torch.full((4, 8), 1.0, dtype=torch.float16))
            if insp.trips:
                break
            with torch.no_grad():
                model.grows.weight.mul_(2)
    insp.close(check=False)
    (path,) = glob.glob(os.path.join(tmp_path, "*.json"))
    with open(path) as f:
        assert "history" in json.load(f)
    capsys.readouterr()
    assert cli.main(["advise", path, "--plot", str(tmp_path / "advice.png")]) == 0
    out = capsys.readouterr().out
    rows = out.splitlines()
    assert rows[0].startswith("numguard precision advice (float16)")
    assert rows[2].startswith("grows ") and "keep fp32/bf16" in rows[2]
    assert os.path.getsize(tmp_path / "advice.png") > 1000
    # The report command still renders the same dump.
    assert cli.main(["report", path]) == 0


def test_advise_command_errors(tmp_path, capsys):
    assert cli.main(["advise", str(tmp_path / "missing.json")]) == 2
    assert "is not a file" in capsys.readouterr().err
    old = {"format": "numguard-report", "version": 1, "batch_number": 0,
           "frames": [{"name": "", "class": "M", "labels": [], "kinds": [], "records": []}]}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    assert cli.main(["advise", str(path)]) == 2
    assert "no module history" in capsys.readouterr().err


class _Mixed(nn.Module):
    """Frames of every shape the fold walks: one tensor in and out, keyword inputs, a tuple
    output, a None line, an integer tensor, and (with backward=True) gradient frames."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.pair = _Pair()
        self.out = nn.Linear(4, 1)

    def forward(self, x):
        a, b = self.pair(self.lin(x), scale=torch.tensor(2.0), mask=None, ids=torch.arange(3))
        return self.out(a + b)


class _Pair(nn.Module):
    def forward(self, x, scale=None, mask=None, ids=None):
        return x * scale, torch.tanh(x)


@pytest.mark.skipif(_history._native_fold is None, reason="needs the native kernels")
def test_the_native_fold_walks_frames_exactly_like_the_python_fold(monkeypatch):
    compared = []
    original = _history.ModuleHistory._fold

    def both(self, ring, lo, hi):
        frames = ring.frames[lo:hi]
        slot_batch, dtypes = list(self.slot_batch), {k: list(v) for k, v in self.dtypes.items()}
        want_index, want_mult, want_slots = self._fold_lines(frames, ring)
        want_state = (self.slot_batch, self.dtypes)
        self.slot_batch, self.dtypes = slot_batch, dtypes
        got_index, got_mult, got_slots = _history._native_fold(
            ring.frames, lo, hi, ring.size, ring.pos - ring.size, self.window, len(_history.FIELDS),
            self.slot_batch, self.by_name, self.dtypes, _history._FLOATING, _history.ONE_IN_ONE_OUT_LABELS,
            _history._FOLD_LAYOUT)
        assert torch.equal(got_index, want_index) and torch.equal(got_mult, want_mult)
        assert got_slots == want_slots and (self.slot_batch, self.dtypes) == want_state
        compared.append((len(frames), want_mult.numel(), any(f.section == "backward" for f in frames)))
        return original(self, ring, lo, hi)

    monkeypatch.setattr(_history.ModuleHistory, "_fold", both)
    torch.manual_seed(0)
    model = _Mixed()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with numguard.watch(model, **quiet(backward=True)) as insp:
        for _ in range(70):  # past the window: slots are taken again by newer batches
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        result = insp.advice()
    assert len(compared) >= 70 and all(n and lines for n, lines, _ in compared)
    assert any(backward for _, _, backward in compared)
    pair = next(m for m in result.modules if m.name == "pair")
    assert pair.abs_max is not None and pair.grad_abs_max is not None


def test_a_failing_history_warns_once_and_training_goes_on(monkeypatch):
    def broken(self, ring, lo, hi):
        raise RuntimeError("fold failed")
    monkeypatch.setattr(_history.ModuleHistory, "fold", broken)
    model = nn.Sequential(nn.Linear(2, 2))
    with pytest.warns(numguard.errors.InspectorWarning, match="history stopped.*fold failed") as caught:
        with numguard.watch(model, **quiet()) as insp:
            for _ in range(3):
                model(torch.randn(1, 2))
            result = insp.advice()
    assert sum("history stopped" in str(w.message) for w in caught) == 1
    assert result.modules == [] and insp.batches_finished == 3


def _delayed_history(series, fmt):
    batches = list(range(len(series)))
    row = {"module": "a", "quantity": "output", "underflow": 0.0, "saturated": 0.0, "mse": 0.0, "batches": len(series)}
    return {"window": 64, "batches": batches, "loss_scale": None, "loss_scale_source": "assumed",
            "modules": [{"name": "a", "class": "Linear", "dtype": "torch.float32", "grad_dtype": None,
                         "out_abs_max": series, "in_abs_max": [1.0] * len(series),
                         "min_nonzero": [0.5] * len(series), "grad_abs_max": [None] * len(series),
                         "grad_min_nonzero": [None] * len(series), "grad_subnormal_share": [None] * len(series)}],
            "quant": {"format": fmt, "rows": [row]}}


def test_delayed_scaling_saturation_is_named_at_the_batches_above_their_window():
    # Flat at 1, one batch at 4x and one at 2x: each is above the largest of the 16 batches before
    # it (the second one too: the 4x is in its window only if it came within 16 batches).
    series = [1.0] * 20 + [4.0] + [1.0] * 20 + [2.0]
    result = _advice.advise(_delayed_history(series, "float8_e4m3fn"))
    [row] = result.delayed_overflow
    assert (row.module, row.quantity, row.batches, row.tested) == ("a", "output", [20, 41], len(series) - 16)
    assert row.worst == 4.0
    text = str(result)
    assert "with delayed scaling (16 batches of amax history) as float8_e4m3fn" in text
    assert "a                                        output   2 of 26 batches (up to 4.00x" in text


def test_delayed_scaling_is_silent_on_a_flat_history_and_absent_for_block_formats():
    flat = _advice.advise(_delayed_history([1.0] * 30, "float8_e5m2"))
    assert flat.delayed_overflow == [] and "no batch would saturate" in str(flat)
    spiky = [1.0] * 20 + [4.0]
    block = _advice.advise(_delayed_history(spiky, "mxfp8_e4m3"))
    assert block.delayed_overflow == [] and "delayed scaling" not in str(block)
    short = _advice.advise(_delayed_history([1.0] * 10 + [4.0], "float8_e4m3fn"))
    assert "not judged: the history holds 11 batches" in str(short)


@pytest.mark.parametrize("field, value, named", [
    ("underflow", 1.5, "quant.rows[0].underflow: expected a fraction from 0 to 1, got 1.5"),
    ("underflow", -0.25, "quant.rows[0].underflow: expected a fraction from 0 to 1, got -0.25"),
    ("saturated", float("nan"), "quant.rows[0].saturated: expected a fraction from 0 to 1, got nan"),
    ("mse", float("inf"), "quant.rows[0].mse: expected a finite number >= 0, got inf"),
    ("mse", None, "quant.rows[0].mse: expected a finite number >= 0, got None"),
    ("format", "float7", "quant.rows[0].format: expected one of float8_e4m3fn, float8_e5m2"),
    ("table format", "fp8", "quant.format: expected one of float8_e4m3fn"),
])
def test_advise_command_refuses_impossible_quant_values_naming_them(tmp_path, capsys, field, value, named):
    history = _delayed_history([1.0] * 3, "float8_e4m3fn")
    if field == "table format":
        history["quant"]["format"] = value
    else:
        history["quant"]["rows"][0][field] = value
    dump = {"format": "numguard-report", "version": 1, "batch_number": 0,
            "frames": [{"name": "", "class": "M", "labels": [], "kinds": [], "records": []}], "history": history}
    path = tmp_path / "quant.json"
    path.write_text(json.dumps(dump))
    assert cli.main(["advise", str(path)]) == 2
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err, err


def test_a_real_float8_row_has_no_mse_and_is_not_advice_to_keep_bf16():
    history = _delayed_history([1.0] * 3, "float8_e4m3fn")
    history["quant"]["rows"] = [{"module": "cast", "quantity": "real output", "underflow": 0.5, "saturated": 0.01,
                                 "mse": None, "batches": 3, "format": "float8_e5m2"}]
    result = _advice.advise(history)
    assert result.keep_bf16 == []
    text = str(result)
    assert "real output" in text and "real float8_e5m2" in text and "MSE is unknown" in text
