"""watch(spikes=...): a module's value far outside its own recent range is named, in execution
order, from the one read per check (NOTE: [spike rule] in numguard/inspector/spikes.py); healthy
runs with warm-up, cosine decay and dropout give no alarm."""
from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn as nn

import numguard
from numguard import env
from numguard.inspector import spikes as _spikes
from numguard.inspector.history import GRAD_MAX, OUT_MAX, WINDOW
from numguard.inspector.spikes import ARM
from numguard.testing import SyncCounter


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.act = nn.GELU()
        self.mid = nn.Linear(16, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        return self.out(self.mid(self.act(self.inp(x))))


def _train(model, steps, backward=True, plant_at=None, plant=None, **watch):
    torch.manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # a planted spike must not change the weights
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        insp = numguard.watch(model, report_to=None, backward=backward, **watch)
        try:
            for step in range(steps):
                if step == plant_at:
                    plant(True)
                out = model(torch.randn(32, 8))
                if step == plant_at:
                    plant(False)
                if backward:
                    opt.zero_grad()
                    out.pow(2).mean().backward()
                    opt.step()
        finally:
            insp.close(check=False)
    return insp, [w for w in caught if issubclass(w.category, numguard.SpikeWarning)]


def _scale_output_of(module, factor):
    state = {"on": False}
    module.register_forward_hook(lambda m, a, out: out * factor if state["on"] else None)
    return lambda on: state.update(on=on)


@pytest.mark.parametrize("backward", [False, True])
def test_a_spike_in_one_module_is_named_there_at_its_batch(backend, backward):
    model = Net()
    plant = _scale_output_of(model.mid, 1000.0)  # registered before watch(): numguard sees the spike
    insp, warned = _train(model, ARM + 10, backward=backward, plant_at=ARM + 4, plant=plant, spikes=True)
    assert len(warned) >= 1
    first = warned[0].message.spike
    assert first["module"] == "mid" and first["class"] == "Linear" and first["quantity"] == "output abs max"
    assert first["batch"] == ARM + 4 and first["factor"] > 100 and first["rank"] is None
    assert "spike in mid (Linear) at batch_number=" in str(warned[0].message)
    assert insp.spikes()[0] == first


@pytest.mark.parametrize("plant_offset", [0, 1, 2])
def test_every_batch_of_a_check_is_tested_with_check_every(plant_offset):
    # check_every=3 folds three batches at once: a spike in any of them is named at its own batch.
    model = Net()
    plant = _scale_output_of(model.mid, 1000.0)
    at = ARM + 6 + plant_offset   # three consecutive batches: the first, middle and last of one check
    insp, warned = _train(model, ARM + 14, backward=False, plant_at=at, plant=plant, spikes=True,
                          check_every=3)
    spikes = [w.message.spike for w in warned]
    assert [(s["module"], s["batch"]) for s in spikes] == [("mid", at)]


def test_a_spike_before_a_skipped_optimizer_step_is_found_with_backward_watching():
    # A step that skips optimizer.step() (a GradScaler skip, gradient accumulation) leaves its batch
    # to be checked with the next one: the spike in the first is still found, at its batch.
    model = Net()
    plant = _scale_output_of(model.mid, 1000.0)
    at = ARM + 4
    torch.manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        insp = numguard.watch(model, report_to=None, backward=True, spikes=True)
        for step in range(ARM + 10):
            plant(step == at)
            opt.zero_grad()
            model(torch.randn(32, 8)).pow(2).mean().backward()
            if step != at:
                opt.step()
        insp.close(check=False)
    spikes = [w.message.spike for w in caught if issubclass(w.category, numguard.SpikeWarning)]
    assert spikes and (spikes[0]["module"], spikes[0]["batch"], spikes[0]["quantity"]) == ("mid", at, "output abs max")
    # Each batch is tested once: the spike is not reported again at a later check.
    assert [(s["module"], s["batch"], s["quantity"]) for s in spikes].count(("mid", at, "output abs max")) == 1


def test_raise_mode_stops_with_a_spike_error():
    model = Net()
    plant = _scale_output_of(model.inp, 1e4)
    with pytest.raises(numguard.SpikeError) as info:
        _train(model, ARM + 10, backward=False, plant_at=ARM + 3, plant=plant, spikes="raise")
    assert info.value.spike["module"] == "inp" and info.value.spike["batch"] == ARM + 3


def test_a_gradient_spike_is_named_with_backward_watching():
    model = Net()
    state = {"on": False}
    model.mid.register_full_backward_hook(
        lambda m, gin, gout: tuple(g * 1e4 for g in gin) if state["on"] else None)
    torch.manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # the spike must not change the weights
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        insp = numguard.watch(model, report_to=None, backward=True, spikes="warn")
        for step in range(ARM + 8):
            state["on"] = step == ARM + 2
            opt.zero_grad()
            model(torch.randn(32, 8)).pow(2).mean().backward()
            opt.step()
        insp.close(check=False)
    spikes = [w.message.spike for w in caught if issubclass(w.category, numguard.SpikeWarning)]
    assert spikes and spikes[0]["quantity"] == "gradient abs max" and spikes[0]["batch"] == ARM + 2
    assert spikes[0]["module"] in ("mid", "act", "inp")  # the gradient mid's backward produced, or upstream


def _gradient_fault_spikes(model, optimizers, at, fault):
    """Train `model` ARM + 8 steps with backward watching and spikes; at step `at`, `fault()` runs
    after the backward and before the optimizers step. The spikes warned, and the inspector."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        insp = numguard.watch(model, report_to=None, backward=True, spikes=True)
        for step in range(ARM + 8):
            for opt in optimizers:
                opt.zero_grad()
            model(torch.randn(32, 8)).pow(2).mean().backward()
            if step == at:
                fault()
            for opt in optimizers:
                opt.step()
        insp.close(check=False)
    return [w.message.spike for w in caught if issubclass(w.category, numguard.SpikeWarning)], insp


@pytest.mark.parametrize("factor, named", [(1e4, ("mid", "Linear", "weight.grad norm")),
                                            (50.0, ("", "Net", "gradient norm"))])
def test_a_fault_in_parameter_gradients_only_is_named_by_their_norms(factor, named):
    # After backward, before the step, one parameter's gradient is scaled (a bad all_reduce, a
    # corrupted bucket): no module's output or activation gradient moves (NOTE: [gradient norm
    # spikes]). 1e4 is past the parameter's floor, so it is named; 50 is not (the floor is 100x),
    # and the total norm (floor 10x; mid.weight holds most of it) names it.
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # the fault must not change the weights
    at = ARM + 5
    warned, insp = _gradient_fault_spikes(model, [opt], at, lambda: model.mid.weight.grad.mul_(factor))
    assert warned, "the gradient fault was not reported"
    first = warned[0]
    assert (first["module"], first["class"], first["quantity"], first["batch"]) == named + (at,), first
    assert first["factor"] > (1000 if factor > 1e3 else 10) and len(warned) == 1
    assert insp.spikes()[0] == first


def test_gradient_norms_of_two_optimizers_are_watched_apart():
    # Two optimizers over two parts of the model: each step's norms land in their parameters'
    # rows, and a fault in the second optimizer's parameters is named there.
    torch.manual_seed(0)
    model = Net()
    first = torch.optim.SGD(list(model.inp.parameters()) + list(model.mid.parameters()), lr=0.0)
    second = torch.optim.SGD(model.out.parameters(), lr=0.0)
    at = ARM + 4
    warned, _ = _gradient_fault_spikes(model, [first, second], at, lambda: model.out.bias.grad.mul_(1e4))
    assert warned and (warned[0]["module"], warned[0]["quantity"], warned[0]["batch"]) == ("out", "bias.grad norm", at)


class Small(nn.Module):
    def __init__(self, dropout):
        super().__init__()
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=dropout, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(16, 16)

    def forward(self, x):
        return self.head(self.encoder(x, mask=nn.Transformer.generate_square_subsequent_mask(x.shape[1])))


class WithLoss(nn.Module):
    """A root that returns its loss (a scalar, or a Transformers-style dict with "loss")."""

    def __init__(self, net, target, as_dict=False):
        super().__init__()
        self.net, self.as_dict = net, as_dict
        self.register_buffer("target", target)

    def forward(self, x, scale=1.0):
        out = self.net(x)
        loss = (out @ self.target).pow(2).mean() * scale
        return {"loss": loss, "logits": out} if self.as_dict else loss


@pytest.mark.parametrize("root_returns", ["output", "loss"])
@pytest.mark.parametrize("schedule", ["warmup", "cosine", "dropout"])
def test_no_false_alarm_on_healthy_300_step_runs(schedule, root_returns):
    torch.manual_seed(1)
    model = Small(dropout=0.1 if schedule == "dropout" else 0.0)
    target = torch.randn(16, 16)
    watched = WithLoss(model, target) if root_returns == "loss" else model
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    steps = 300
    if schedule == "warmup":
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 100))
    else:
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        insp = numguard.watch(watched, report_to=None, backward=True, spikes=True)
        for _ in range(steps):
            x = torch.randn(4, 12, 16)
            loss = watched(x) if root_returns == "loss" else (model(x) @ target).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
        insp.close(check=False)
    spikes = [str(w.message) for w in caught if issubclass(w.category, numguard.SpikeWarning)]
    assert spikes == [] and insp.trips == 0


@pytest.mark.parametrize("as_dict", [False, True])
def test_a_loss_spike_is_named_as_the_loss_at_its_batch(as_dict):
    # The targets of one batch are off by 1000x: no module's output moves, the loss does (NOTE:
    # [loss spikes]). The root's output (the loss itself, or a dict holding it) spikes too, at the
    # same moment: the loss is named.
    torch.manual_seed(0)
    model = WithLoss(Net(), torch.randn(4, 4), as_dict=as_dict)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    at = ARM + 5
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        insp = numguard.watch(model, report_to=None, backward=True, spikes=True)
        for step in range(ARM + 10):
            out = model(torch.randn(32, 8), scale=1e4 if step == at else 1.0)
            opt.zero_grad()
            (out["loss"] if as_dict else out).backward()
            opt.step()
        insp.close(check=False)
    warned = [w.message for w in caught if issubclass(w.category, numguard.SpikeWarning)]
    assert warned, "the loss spike was not reported"
    first = warned[0].spike
    assert (first["quantity"], first["module"], first["class"], first["batch"]) == ("loss", "", "WithLoss", at)
    assert first["factor"] > 1000 and insp.spikes()[0] == first
    assert "spike in (root module) (WithLoss) at batch_number=" in str(warned[0]) and ": loss " in str(warned[0])


def test_spikes_add_no_host_sync():
    def syncs(spikes):
        model = Net()
        counts = []
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        insp = numguard.watch(model, report_to=None, backward=True, spikes=spikes)
        for step in range(ARM + 6):
            counter = SyncCounter()
            with counter():
                opt.zero_grad()
                model(torch.randn(32, 8)).pow(2).mean().backward()
                opt.step()
            if step > ARM:
                counts.append(counter.numguard)
        insp.close(check=False)
        return counts
    assert syncs(True) == syncs(False)


def test_the_option_and_its_variable():
    assert env.validate_watch_options({"spikes": True})["spikes"] == "warn"
    assert env.validate_watch_options({"spikes": 0})["spikes"] is False
    with pytest.raises(env.OptionError, match="spikes"):
        env.validate_watch_options({"spikes": "loud"})
    assert env.settings_from_env({"NUMGUARD_SPIKES": "RAISE"}) == {"spikes": "raise"}
    assert env.settings_from_env({"NUMGUARD_SPIKES": "1"}) == {"spikes": "warn"}
    with pytest.raises(env.EnvironmentSettingError, match="NUMGUARD_SPIKES"):
        env.settings_from_env({"NUMGUARD_SPIKES": "yes"})
    assert math.isfinite(ARM) and ARM <= 16


def test_a_spike_read_after_new_parameters_appear_keeps_its_name():
    # The check that reads a spike can come after a new optimizer added gradient-norm rows: the
    # loss spike found before them is still named as the loss.
    torch.manual_seed(0)
    model = WithLoss(Net(), torch.randn(4, 4))
    first = torch.optim.SGD(list(model.net.inp.parameters()) + list(model.net.mid.parameters()), lr=0.0)
    later = torch.optim.SGD(model.net.out.parameters(), lr=0.0)
    at = ARM + 4
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        insp = numguard.watch(model, report_to=None, backward=True, spikes=True)
        for step in range(ARM + 8):
            first.zero_grad()
            later.zero_grad()
            model(torch.randn(32, 8), scale=1e4 if step == at else 1.0).backward()
            if step > at:
                later.step()   # its parameters' rows appear between the fold and the read
            first.step()
        insp.close(check=False)
    warned = [w.message.spike for w in caught if issubclass(w.category, numguard.SpikeWarning)]
    assert warned and (warned[0]["module"], warned[0]["quantity"], warned[0]["batch"]) == ("", "loss", at), \
        warned[:1]


def test_a_huge_factor_prints_readably():
    spike = {"module": "net.mid", "class": "Linear", "quantity": "output abs max", "value": 3.1e30,
             "baseline": 3.1, "factor": 1e30, "batch": 40, "rank": None}
    text = _spikes.message(spike)
    assert "is 1.0e+30x its median" in text and "000000" not in text
    assert "is 23.4x its median" in _spikes.message(dict(spike, factor=23.4))


def _planted_spikes(model, steps, plants, backward, **watch):
    """Train `model` `steps` steps with its mid layer's output 1000x at the batches in `plants`;
    the spikes warned, and the batches whose check recomputed the baseline."""
    plant = _scale_output_of(model.mid, 1000.0)
    refreshed = []
    baseline_of = _spikes.SpikeDetector._baseline_of

    def spy(self, values, tested_slots):
        refreshed.append(self._last_tested)
        return baseline_of(self, values, tested_slots)
    _spikes.SpikeDetector._baseline_of = spy
    try:
        _, warned = _train_planted(model, steps, backward, plant, plants, spikes=True, **watch)
    finally:
        _spikes.SpikeDetector._baseline_of = baseline_of
    return [w.message.spike for w in warned], refreshed


def _train_planted(model, steps, backward, plant, plants, **watch):
    torch.manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        insp = numguard.watch(model, report_to=None, backward=backward, **watch)
        for step in range(steps):
            plant(step in plants)
            out = model(torch.randn(32, 8))
            plant(False)
            if backward:
                opt.zero_grad()
                out.pow(2).mean().backward()
                opt.step()
        insp.close(check=False)
    return insp, [w for w in caught if issubclass(w.category, numguard.SpikeWarning)]


@pytest.mark.parametrize("backward", [False, True])
def test_a_spike_is_named_at_its_batch_at_every_phase_of_the_baseline(backward):
    # NOTE: [spike baseline]: the baseline is recomputed at every check until the window is full,
    # then every REFRESH batches. A spike is named at its batch wherever it falls: at the first
    # armed batch, while the window fills, right after a recomputation and at each batch after it.
    plants = [ARM, ARM + 20] + [WINDOW + 4 + k * (_spikes.REFRESH + 1) for k in range(_spikes.REFRESH)]
    spikes, refreshed = _planted_spikes(Net(), plants[-1] + 3, set(plants), backward)
    assert [(s["module"], s["batch"], s["quantity"]) for s in spikes] == [("mid", b, "output abs max")
                                                                           for b in plants]
    # The plants after the window filled fell at every distance from the last recomputation.
    assert refreshed and all(b in refreshed for b in range(ARM, WINDOW - 1))
    phases = {b - max(r for r in refreshed if r <= b) for b in plants if b >= WINDOW}
    assert phases == set(range(_spikes.REFRESH)), (phases, refreshed)


def _rule(baseline, values, floor):
    """The spike rule (NOTE: [spike rule]) in float64 on the host: (is it a spike, exp(median)) of
    `values` against the log values of `baseline` (lists of floats; only finite positive ones count)."""
    logs = sorted(math.log(max(v, 1e-300)) for v in baseline if v > 0 and math.isfinite(v))
    if len(logs) < ARM:
        return False, None
    med = logs[(len(logs) - 1) // 2]                   # the lower median, as torch.nanmedian
    dev = sorted(abs(x - med) for x in logs)
    margin = max(_spikes.K * _spikes.MAD_TO_SIGMA * dev[(len(dev) - 1) // 2], math.log(floor))
    return values > 0 and math.isfinite(values) and math.log(max(values, 1e-300)) - med > margin, math.exp(med)


def test_the_device_test_follows_the_rule_on_hostile_values_gaps_and_cached_baselines():
    # The detector alone on a synthetic history: random log-normal rows with NaN, +-inf, -0.0, 0,
    # subnormals, huge and negative values, batches that left no record, several batches per fold,
    # a first fold's batch tested again for its gradients, spikes planted at random; each fold's
    # verdict is the first spike in time the rule gives against the baseline of the last
    # recomputation (every fold until the window is full, then every REFRESH batches).
    from types import SimpleNamespace
    gen = torch.Generator().manual_seed(0)
    modules, window = 4, 32
    owners = [SimpleNamespace(index=i, is_root=False, name=f"m{i}", cls="Lin") for i in range(modules)]
    det = _spikes.SpikeDetector("warn")
    det.root = SimpleNamespace(name="", cls="Root")
    table = torch.full((modules, window, 6), -math.inf, dtype=torch.float64)
    history = SimpleNamespace(table=table, slot_batch=[None] * window)
    root = det._root_rows(window, torch.device("cpu"))
    state = torch.zeros(8, dtype=torch.int64)
    hostile = torch.tensor([math.nan, math.inf, -math.inf, -0.0, 0.0, 5e-324, 1e308, -1.0], dtype=torch.float64)
    fields = (OUT_MAX, GRAD_MAX)
    baseline, since, last, batch = None, 0, None, 0
    found = {"cached": 0, "after a gap": 0, "spanning": 0}
    for fold in range(150):
        lo = batch
        n = int(torch.randint(1, 4, (1,), generator=gen))
        for b in range(batch, batch + n):
            if torch.rand(1, generator=gen) < 0.2 and b > 0:
                continue                                 # a batch that left no record
            slot = b % window
            history.slot_batch[slot] = b
            cells = torch.randn(modules + 1, 2, generator=gen, dtype=torch.float64).mul(0.3).exp()
            odd = torch.rand(modules + 1, 2, generator=gen) < 0.05
            cells[odd] = hostile[torch.randint(0, len(hostile), (int(odd.sum()),), generator=gen)]
            if torch.rand(1, generator=gen) < 0.3:
                cells.view(-1)[int(torch.randint(0, cells.numel(), (1,), generator=gen))] *= 1e4
            table[:, slot, OUT_MAX], table[:, slot, GRAD_MAX] = cells[:modules, 0], cells[:modules, 1]
            root[0, slot] = cells[modules]
        batch += n
        if last is not None and torch.rand(1, generator=gen) < 0.2:
            lo = last                                    # its forward was tested, its backward folds now
        hi = batch - 1
        frames = [SimpleNamespace(owner=o, section="forward", batch=lo) for o in owners]
        frames[-1] = SimpleNamespace(owner=owners[-1], section="forward", batch=hi)
        spanning = lo == last
        det.after_fold(history, state, frames)
        last = hi
        # The rule on the host: which batches are tested, against which baseline.
        tested = [b for b in range(max(lo, hi - window + 1), hi + 1) if history.slot_batch[b % window] == b]
        held = window - history.slot_batch.count(None)
        if not tested or held <= ARM:
            assert not state.any()
            continue
        cell = lambda slot, row, field: float(table[row, slot, fields[field]] if row < modules else root[0, slot, field])
        cached = not (baseline is None or held < window or since >= _spikes.REFRESH)
        if not cached:
            slots = [s for s in range(window) if history.slot_batch[s] is not None and s not in
                     {b % window for b in tested}]
            baseline = {(row, field): [cell(s, row, field) for s in slots] for row in range(modules + 1)
                        for field in (0, 1)}
            since = 0
        since += len(tested)
        order = det._order[0].tolist()
        expected = None
        for b in tested:
            hits = [(order[row][field], row, field) for row in range(modules + 1) for field in (0, 1)
                    if not (spanning and b == lo and field == 0)
                    and _rule(baseline[row, field], cell(b % window, row, field),
                              _spikes.MIN_GRADIENT_FACTOR if field and row < modules else _spikes.MIN_FACTOR)[0]]
            if hits:
                _, row, field = min(hits)
                expected = (b, row, field)
                break
        spike = det.read(state.tolist(), owners, None)
        state.zero_()
        if expected is None:
            assert spike is None, (fold, spike)
            continue
        b, row, field = expected
        found["cached"] += cached
        found["after a gap"] += tested.index(b) != b - tested[0]
        found["spanning"] += spanning
        median = _rule(baseline[row, field], 0.0, 10.0)[1]
        assert spike["batch"] == b and spike["value"] == cell(b % window, row, field), (fold, spike, expected)
        assert (spike["module"], spike["quantity"]) == (("", ("loss", "gradient norm")[field]) if row == modules else
                                                        (f"m{row}", _spikes.QUANTITIES[field])), (fold, spike)
        assert spike["baseline"] == pytest.approx(median, rel=1e-12)
    assert min(found.values()) >= 3, found   # spikes were met in every kind of fold


def test_a_batch_without_a_loss_or_a_step_leaves_no_value_in_its_slot():
    # The root's rows hold each history slot's loss and gradient norms; a batch that returns no
    # loss and takes no optimizer step leaves NaN there, not what the batch a window before left
    # (which would be tested as its own).
    class Sometimes(WithLoss):
        returns_loss = True

        def forward(self, x, scale=1.0):
            return super().forward(x, scale) if self.returns_loss else self.net(x)

    torch.manual_seed(0)
    model = Sometimes(Net(), torch.randn(4, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    insp = numguard.watch(model, report_to=None, backward=True, spikes=True)
    rows = lambda: insp._history.spikes.root_rows[:, :, :]
    for step in range(2 * WINDOW):
        model.returns_loss = step < WINDOW
        opt.zero_grad()
        out = model(torch.randn(32, 8))
        (out if model.returns_loss else out.pow(2).mean()).backward()
        if model.returns_loss:
            opt.step()
        if step == WINDOW - 1:
            assert bool(torch.isfinite(rows()[0, :, 0]).all()) and bool(torch.isfinite(rows()[:, :, 1]).all())
    assert bool(rows().isnan().all()), rows()
    insp.close(check=False)
