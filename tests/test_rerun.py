"""watch(rerun=True): after a trip the batch's forward runs again on the same inputs and device,
and the verdict (NOTE: [rerun verdict] in numguard/inspector/rerun.py) travels on the error or the
warning as a numguard.Attribution; a transient fault found at the root's return is recovered."""
from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.nn as nn

import numguard
from numguard import env
from numguard.inspector.spikes import ARM
from numguard.testing import SyncCounter, faults


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.norm = nn.BatchNorm1d(16)
        self.drop = nn.Dropout(0.5)
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        return self.out(self.drop(torch.relu(self.norm(self.inp(x)))))


def _once_inf(module):
    """A hook (before numguard's) that makes the module's output +inf at one element, once."""
    state = {"armed": False}

    def hook(mod, args, out):
        if state["armed"]:
            state["armed"] = False
            out = out.clone()
            out.view(-1)[3] = float("inf")
            return out
        return None
    module.register_forward_hook(hook, prepend=True)
    return lambda: state.update(armed=True)


def _warnings_of(category, fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn()
    return result, [w.message for w in caught if isinstance(w.message, category)]


def test_a_transient_fault_at_the_root_return_is_recovered_and_training_goes_on():
    torch.manual_seed(0)
    model = Net()
    arm = _once_inf(model.inp)
    insp = numguard.watch(model, rerun=True, report_to=None)
    x = torch.randn(32, 8)
    model(x).sum().backward()
    arm()
    torch.manual_seed(5)
    out, warned = _warnings_of(numguard.errors.NonFiniteWarning, lambda: model(x))
    assert len(warned) == 1
    att = warned[0].attribution
    assert isinstance(att, numguard.Attribution)
    assert att.verdict == "transient" and att.batch_number == 1 and att.device == "cpu" and att.rank is None
    assert "returned in place of the corrupted one" in att.detail and "rerun verdict: transient" in str(warned[0])
    assert bool(torch.isfinite(out).all()) and out.grad_fn is not None
    # The recovered output is the same computation: dropout drew the same mask (random state restored).
    torch.manual_seed(5)
    with torch.no_grad():
        model.norm.eval()
        model.norm.train()
    out.sum().backward()  # its autograd graph works
    assert insp.attributions() == [att]
    assert insp.last_report["rerun"]["verdict"] == "transient" and insp.last_report["rerun"]["recovered"]
    model(x)  # the next batch is watched as before
    insp.close()


def test_the_recovered_output_equals_a_clean_forward_and_buffers_count_once():
    torch.manual_seed(0)
    model = Net()
    clean = Net()
    clean.load_state_dict(model.state_dict())
    arm = _once_inf(model.inp)
    insp = numguard.watch(model, rerun=True, report_to=None)
    x = torch.randn(32, 8)
    arm()
    torch.manual_seed(7)
    out, warned = _warnings_of(numguard.errors.NonFiniteWarning, lambda: model(x))
    torch.manual_seed(7)
    expected = clean(x)
    assert warned and torch.equal(out, expected)
    # BatchNorm's running statistics moved once (the rerun's update was put back), as in the clean model.
    assert torch.equal(model.norm.running_mean, clean.norm.running_mean)
    assert int(model.norm.num_batches_tracked) == int(clean.norm.num_batches_tracked) == 1
    insp.close()


class Ema(nn.Module):
    """A forward that updates an average of its hidden values, once the root has that buffer."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        h = self.inp(x)
        if hasattr(self, "ema"):
            self.ema.mul_(0.9).add_(h.detach().mean(0) * 0.1)
        return self.out(h)


def test_a_buffer_registered_after_watch_is_put_back_and_updated_once_by_a_recovery():
    # The model's buffers are listed once, and again after any registration: an average the
    # forward updates, registered after watch(), is copied at the next calls, so a recovery starts
    # from its clean value and keeps the rerun's update, as a clean run does (not the corrupted one).
    torch.manual_seed(0)
    model, clean = Ema(), Ema()
    clean.load_state_dict(model.state_dict())
    arm = _once_inf(model.inp)
    insp = numguard.watch(model, rerun=True, report_to=None)
    xs = [torch.randn(32, 8) for _ in range(3)]
    for m in (model, clean):
        m(xs[0])
        m.register_buffer("ema", torch.zeros(16))
        m(xs[1])
    arm()
    out, warned = _warnings_of(numguard.errors.NonFiniteWarning, lambda: model(xs[2]))
    expected = clean(xs[2])
    assert warned and warned[0].attribution.verdict == "transient", warned
    assert "returned in place of the corrupted one" in warned[0].attribution.detail
    assert torch.equal(out, expected) and torch.equal(model.ema, clean.ema)
    insp.close()


def test_a_fault_that_repeats_is_reproducible_and_raises_with_the_attribution():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    insp = numguard.watch(model, rerun=True, report_to=None)
    with torch.no_grad():
        model[0].bias.fill_(float("nan"))
    with pytest.raises(numguard.NonFiniteError) as info:
        model(torch.randn(2, 4))
    att = info.value.attribution
    assert att.verdict == "reproducible" and att.batch_number == 0
    assert "0 (Linear)" in att.detail and "bit for bit" in att.detail
    assert "rerun verdict: reproducible" in str(info.value)
    insp.close(check=False)


@pytest.mark.parametrize("cause", ["data", "once"])
def test_a_running_statistics_trip_is_rerun_and_judged(cause):
    # One huge value makes BatchNorm's running_var +Inf with every output finite (NOTE: [running
    # statistics]): the rerun of the forward judges it by the statistics it writes again.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    state = {"armed": False}

    def once_huge(mod, args, out):
        if state["armed"]:
            state["armed"] = False
            out = out.clone()
            out[0, 0] = 1e20
            return out
        return None
    model[0].register_forward_hook(once_huge, prepend=True)
    insp = numguard.watch(model, rerun=True, report_to=None)
    for _ in range(2):
        model(torch.randn(8, 4))
    x = torch.randn(8, 4)
    if cause == "data":
        x[0] = 1e20
        with pytest.raises(numguard.NonFiniteError) as info:
            model(x)
        att = info.value.attribution
        assert att.verdict == "reproducible" and att.batch_number == 2
        assert "running statistics of 1 (BatchNorm1d)" in att.detail
        assert insp.last_report["rerun"]["module"] == "1"
    else:
        state["armed"] = True
        _, warned = _warnings_of(numguard.errors.NonFiniteWarning, lambda: model(x))
        att = warned[0].attribution
        assert att.verdict == "transient" and "buffers it updated were kept" in att.detail
        # The statistics are the clean rerun's, counted once.
        assert bool(torch.isfinite(model[1].running_var).all()) and int(model[1].num_batches_tracked) == 3
    assert "backward" not in att.detail
    insp.close(check=False)


@pytest.mark.parametrize("why", ["recover_off", "async"])
def test_without_recovery_a_transient_fault_still_trips_with_its_verdict(why):
    torch.manual_seed(0)
    model = Net()
    arm = _once_inf(model.inp)
    opts = {"recover": False} if why == "recover_off" else {"check": "async"}
    insp = numguard.watch(model, rerun=True, report_to=None, **opts)
    x = torch.randn(32, 8)
    arm()
    with pytest.raises(numguard.NonFiniteError) as info:
        model(x)
        model(x)  # async: the trip of batch 0 is read at batch 1's check
    att = info.value.attribution
    assert att.verdict == "transient" and att.batch_number == 0
    assert "returned in place" not in att.detail
    insp.close(check=False)


def test_inputs_changed_in_place_give_no_verdict_and_say_why():
    model = nn.Linear(4, 4)
    insp = numguard.watch(model, rerun=True, report_to=None, check="async")
    x = torch.randn(2, 4)
    with torch.no_grad():
        model.bias.fill_(float("inf"))
    model(x)
    x.add_(1)  # the batch's input changed before its (async) check
    with pytest.raises(numguard.NonFiniteError) as info:
        model(torch.randn(2, 4))
    assert info.value.attribution is None
    assert "changed in place" in insp.last_report["rerun"]["reason"]
    assert "no verdict" in str(info.value)
    insp.close(check=False)


def test_the_dump_holds_the_rerun(tmp_path):
    model = nn.Linear(4, 4)
    insp = numguard.watch(model, rerun=True, report_to=None, on_trip="dump", dump_dir=tmp_path)
    with torch.no_grad():
        model.bias.fill_(float("nan"))
    _, warned = _warnings_of(numguard.errors.NonFiniteWarning, lambda: model(torch.randn(2, 4)))
    assert warned and warned[0].attribution.verdict == "reproducible"
    (path,) = tmp_path.glob("*.json")
    data = numguard.dump.load(path)
    assert data["rerun"]["verdict"] == "reproducible"
    assert "rerun verdict: reproducible" in numguard.dump.render_file(path) or json.loads(path.read_text())["rerun"]
    insp.close(check=False)


def _train_with_spike(fault_kwargs, steps=ARM + 8):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaled = {"on": False, "always": fault_kwargs["persistent"]}

    def scale(mod, args, out):
        if scaled["on"]:
            scaled["on"] = scaled["always"]
            return out * 1000.0
        return None
    model[2].register_forward_hook(scale, prepend=True)
    insp = numguard.watch(model, report_to=None, spikes=True, rerun=True)

    def run():
        for step in range(steps):
            if step == ARM + 3:
                scaled["on"] = True
            out = model(torch.randn(32, 8))
            if step == ARM + 3:
                scaled["on"] = scaled["always"] = False if not fault_kwargs["persistent"] else True
            opt.zero_grad()
            out.pow(2).mean().backward()
            opt.step()
            if step == ARM + 4:
                scaled["always"] = scaled["on"] = False
    _, warned = _warnings_of(numguard.SpikeWarning, run)
    insp.close(check=False)
    return warned


@pytest.mark.parametrize("persistent,verdict", [(False, "transient"), (True, "reproducible")])
def test_a_spike_is_rerun_and_judged(persistent, verdict):
    warned = _train_with_spike({"persistent": persistent})
    assert warned
    first = warned[0]
    assert first.spike["module"] == "2" and first.attribution is not None
    assert first.attribution.verdict == verdict and first.attribution.batch_number == ARM + 3
    assert f"rerun verdict: {verdict}" in str(first)


def test_rerun_adds_no_host_sync_on_healthy_steps():
    def syncs(rerun):
        torch.manual_seed(0)
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        insp = numguard.watch(model, report_to=None, rerun=rerun)
        counts = []
        for step in range(6):
            counter = SyncCounter()
            with counter():
                opt.zero_grad()
                model(torch.randn(32, 8)).pow(2).mean().backward()
                opt.step()
            counts.append(counter.numguard)
        insp.close(check=False)
        return counts
    assert syncs(True) == syncs(False)


def test_inputs_are_kept_only_until_their_check():
    model = nn.Linear(4, 4)
    insp = numguard.watch(model, rerun=True, report_to=None)
    for _ in range(5):
        model(torch.randn(2, 4))
    assert len(insp._rerun.calls) <= 1
    insp.close()
    assert not insp._rerun.calls


def test_the_option_and_its_variable(monkeypatch):
    assert env.validate_watch_options({"rerun": True})["rerun"] is True
    with pytest.raises(env.OptionError, match="rerun"):
        env.validate_watch_options({"rerun": "yes"})
    monkeypatch.setenv("NUMGUARD_RERUN", "1")
    insp = numguard.watch(nn.Linear(2, 2), report_to=None)
    assert insp.rerun is True and insp.options.recover is True
    insp.close()
    with pytest.raises(ValueError, match="verdict"):
        numguard.Attribution("maybe", None, "h", "cpu", 0, "")


def test_an_injected_exponent_flip_once_is_transient_and_persistent_is_reproducible():
    results = {}
    for persistent in (False, True):
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
        with torch.no_grad():   # every output of the first layer is 1.5: exponent 127, all ones
            model[0].weight.zero_()
            model[0].bias.fill_(1.5)
        insp = numguard.watch(model, rerun=True, report_to=None, on_trip="warn")
        # the exponent's top bit: 1.5 -> exponent 255 with a non-zero mantissa: NaN
        with faults.inject_output(model[0], "exponent", persistent=persistent, bit=30) as fault:
            _, warned = _warnings_of(numguard.errors.NonFiniteWarning, lambda: model(torch.randn(2, 8)))
        assert fault.fired == (1 if not persistent else 2)   # persistent: the rerun fails too
        results[persistent] = warned[0].attribution.verdict
        insp.close(check=False)
    assert results == {False: "transient", True: "reproducible"}


def _grad_nan_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    return model


@pytest.mark.parametrize("persistent", [False, True])
def test_rerun_step_judges_a_fault_in_the_backward(persistent):
    model = _grad_nan_model()
    insp = numguard.watch(model, backward=True, report_to=None)
    state = {"left": 0}

    def poison(grad):   # a fault in the backward: the gradient of the last layer's output
        if state["left"] > 0:
            state["left"] -= 1
            return grad * float("inf")
        return grad

    calls = []

    @numguard.rerun_step
    def step(x):
        calls.append(1)
        out = model(x)
        out.register_hook(poison)
        out.sum().backward()
        return out

    x = torch.randn(3, 4)
    step(x)   # a healthy step
    model.zero_grad(set_to_none=False)
    with torch.no_grad():
        for p in model.parameters():
            p.grad.fill_(0.25)   # accumulated gradients the rerun must start from again
    before = [p.grad.clone() for p in model.parameters()]
    clean = _grad_nan_model()
    clean.load_state_dict(model.state_dict())
    clean(x).sum().backward()
    batch = insp.batch_number + 1
    state["left"] = 1 if not persistent else 99
    if persistent:
        with pytest.raises(numguard.NonFiniteError) as info:
            step(x)
        assert info.value.attribution.verdict == "reproducible"
        assert info.value.attribution.batch_number == batch
    else:
        out, warned = _warnings_of(numguard.errors.NonFiniteWarning, lambda: step(x))
        assert warned and warned[0].attribution.verdict == "transient"
        assert bool(torch.isfinite(out).all())
        # the gradients are the accumulated ones plus one clean backward, not two
        for p, b, c in zip(model.parameters(), before, clean.parameters()):
            assert torch.allclose(p.grad, b + c.grad)
        assert insp.batch_number == batch   # the rerun did not count a batch
    assert len(calls) == 3
    insp.close(check=False)


def test_rerun_step_restores_buffers_so_a_recovered_step_leaves_batchnorm_clean():
    # A one-time NaN in the forward reaches BatchNorm's running statistics before the step's check
    # finds it; the recovered step must leave them (and the batch count) as one clean step would.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    clean = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    clean.load_state_dict(model.state_dict())
    glitch = {"left": 0}

    def corrupt(mod, args, out):
        if glitch["left"]:
            glitch["left"] -= 1
            out = out.clone()
            out[0, 0] = float("nan")
        return out
    model[0].register_forward_hook(corrupt)
    insp = numguard.watch(model, backward=True, report_to=None)

    @numguard.rerun_step
    def step(x):
        loss = model(x).pow(2).mean()
        loss.backward()
        return loss

    xs = [torch.randn(8, 4) for _ in range(3)]
    for i, x in enumerate(xs):
        glitch["left"] = 1 if i == 2 else 0
        if i < 2:
            step(x)
        else:
            _, warned = _warnings_of(numguard.errors.NonFiniteWarning, lambda: step(x))
            assert warned and warned[0].attribution.verdict == "transient"
        clean(x).pow(2).mean().backward()
    bn, want = model[1], clean[1]
    assert torch.equal(bn.running_mean, want.running_mean) and torch.equal(bn.running_var, want.running_var)
    assert int(bn.num_batches_tracked) == int(want.num_batches_tracked) == 3
    assert [a.verdict for a in insp.attributions()] == ["transient"]
    insp.close(check=False)


def test_rerun_step_checks_its_argument_and_passes_other_errors():
    with pytest.raises(TypeError, match="not callable"):
        numguard.rerun_step(3)

    @numguard.rerun_step(recover=False)
    def bad():
        raise KeyError("x")
    with pytest.raises(KeyError):
        bad()


def test_a_transient_fault_found_at_the_step_check_says_why_it_was_not_recovered():
    # With backward=True the forward's check waits for the optimizer step: the backward has used
    # the corrupted output by then, so the verdict says so and names the way to recover.
    torch.manual_seed(0)
    model = Net()
    arm = _once_inf(model.inp)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    insp = numguard.watch(model, rerun=True, backward=True, report_to=None)
    for step in range(3):
        if step == 2:
            arm()
        opt.zero_grad()
        model(torch.randn(32, 8)).pow(2).mean().backward()
        if step < 2:
            opt.step()
    with pytest.raises(numguard.NonFiniteError) as info:
        opt.step()
    assert info.value.attribution.verdict == "transient"
    assert "not recovered: with backward=True" in info.value.attribution.detail
    assert "@numguard.rerun_step" in info.value.attribution.detail
    insp.close(check=False)


@pytest.mark.parametrize("write", ["copy_", "numpy"])
def test_a_spike_in_a_reused_input_buffer_gets_no_verdict_and_says_why(write):
    # Spikes are judged one check later; by then a reused input buffer holds the next batch. A
    # write the version counter shows (copy_) and one it does not (numpy) are both named, never
    # judged on the wrong values.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    insp = numguard.watch(model, spikes="warn", rerun=True, report_to=None)
    buf = torch.empty(16, 8)
    data = [torch.randn(16, 8) for _ in range(ARM + 10)]
    data[ARM + 5] *= 1000

    def run():
        for x in data:
            if write == "copy_":
                buf.copy_(x)
            else:
                buf.numpy()[:] = x.numpy()
            model(buf)
    _, warned = _warnings_of(numguard.SpikeWarning, run)
    insp.close(check=False)
    assert warned and warned[0].spike["batch"] == ARM + 5
    assert warned[0].attribution is None and insp.attributions() == []
    why = "changed in place after the call" if write == "copy_" else "overwritten since the call"
    assert "no rerun verdict: " in str(warned[0]) and why in str(warned[0])


@pytest.mark.parametrize("cause, verdict", [("data", "reproducible"), ("glitch", "transient")])
def test_a_loss_spike_is_rerun_and_judged_by_the_loss(cause, verdict):
    # The loss of one batch is 1e4 times too large: from its inputs (the rerun repeats it) or
    # from a one-time corruption inside the forward (the rerun does not).
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    state = {"glitch": False}

    class WithLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = net

        def forward(self, x, scale=1.0):
            loss = self.net(x).pow(2).mean() * scale
            if state["glitch"]:
                state["glitch"] = False
                loss = loss * 1e4
            return loss

    model = WithLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    at = ARM + 5

    def run():
        for step in range(ARM + 10):
            state["glitch"] = cause == "glitch" and step == at
            loss = model(torch.randn(32, 8), scale=1e4 if cause == "data" and step == at else 1.0)
            opt.zero_grad()
            loss.backward()
            opt.step()
    insp = numguard.watch(model, backward=True, spikes=True, rerun=True, report_to=None)
    _, warned = _warnings_of(numguard.SpikeWarning, run)
    insp.close(check=False)
    assert warned and (warned[0].spike["quantity"], warned[0].spike["batch"]) == ("loss", at)
    assert warned[0].attribution.verdict == verdict and "a loss of" in warned[0].attribution.detail


class WritesItsInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        x.mul_(2)   # the model changes its own input during the call
        return self.lin(x)


@pytest.mark.parametrize("at", [0, 2])
def test_a_model_that_writes_its_own_input_is_rerun_from_a_copy(at):
    # NOTE: [inputs the model writes]: the batch that shows it gets no verdict and says "during the
    # call"; from the next call on the inputs are copied, and a later trip gets its verdict.
    model = WritesItsInput()
    insp = numguard.watch(model, rerun=True, report_to=None)
    for _ in range(at):
        model(torch.randn(2, 4))
    with torch.no_grad():
        model.lin.weight[0, 0] = float("inf")
    x = torch.randn(2, 4)
    with pytest.raises(numguard.NonFiniteError) as info:
        model(x)
    rerun = insp.last_report["rerun"]
    if at == 0:
        assert info.value.attribution is None
        assert "input[0] was changed in place during the call" in rerun["reason"]
        assert "after the call" not in rerun["reason"]
    else:
        assert info.value.attribution.verdict == "reproducible" and rerun["module"] == "lin"
        assert rerun["identical"] is True   # the rerun saw what the model saw
    insp.close(check=False)


@pytest.mark.parametrize("overwritten", [False, True])
def test_inference_mode_inputs_are_rerun_and_an_overwrite_is_seen(overwritten):
    # Inference tensors have no version counter: kept as they are, the fingerprint tells a change.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    insp = numguard.watch(model, rerun=True, report_to=None, check="async" if overwritten else "sync")
    with torch.inference_mode():
        model(torch.randn(2, 4))
        x = torch.randn(2, 4)
        x[0, 0] = float("inf")
        with pytest.raises(numguard.NonFiniteError) as info:
            model(x)
            if overwritten:
                x.fill_(1.0)   # before the async check reads batch 1
                model(torch.randn(2, 4))
    rerun = insp.last_report["rerun"]
    if overwritten:
        assert info.value.attribution is None and "overwritten since the call" in rerun["reason"]
    else:
        assert info.value.attribution.verdict == "reproducible" and rerun["module"] == "0"
    assert "no longer kept" not in rerun["reason"]
    insp.close(check=False)


@pytest.mark.parametrize("at", [0, 2])
def test_a_lazy_model_is_rerun_once_its_modules_are_made(at):
    # The first forward of a lazy module makes its weights: that call cannot be rerun, and says so.
    torch.manual_seed(0)
    model = nn.Sequential(nn.LazyLinear(4), nn.LazyBatchNorm1d(), nn.Linear(4, 1))
    insp = numguard.watch(model, rerun=True, report_to=None)
    for _ in range(at):
        model(torch.randn(8, 3))
    x = torch.randn(8, 3)
    x[0] = 1e20   # running_var +Inf
    with pytest.raises(numguard.NonFiniteError) as info:
        model(x)
    rerun = insp.last_report["rerun"]
    if at == 0:
        assert info.value.attribution is None and "lazy modules made their parameters" in rerun["reason"]
    else:
        assert info.value.attribution.verdict == "reproducible" and rerun["module"] == "1"
    insp.close(check=False)
