"""watch(model, backward=True): gradient frames, parameter gradients checked before the optimizer
steps, GradScaler skips, host syncs, clean-up."""
import pytest
import torch
from torch import nn

import numguard
from numguard import backward as ng_backward
from inspector_helpers import SyncCounter, quiet


class BadGradient(torch.autograd.Function):
    """Identity forward; the backward multiplies the gradient by `value` (NaN or Inf)."""

    @staticmethod
    def forward(ctx, x, value):
        ctx.value = value
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.value, None


class Gate(nn.Module):
    """Passes its input through; when `value` is set its backward alone produces that value."""

    def __init__(self):
        super().__init__()
        self.value = None

    def forward(self, x):
        return x if self.value is None else BadGradient.apply(x, self.value)


class ScaledByBadWeight(nn.Module):
    """x * w where only w's gradient goes bad (x does not require grad)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))
        self.value = None

    def forward(self, x):
        w = self.weight if self.value is None else BadGradient.apply(self.weight, self.value)
        return x * w


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                 reason="no CUDA device"))]


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), Gate(), nn.Linear(8, 2))


def snapshot(model):
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("device", DEVICES)
def test_backward_only_nan_is_named_and_raised_before_the_step(device):
    model = make_model().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(3, 4, device=device)
    with numguard.watch(model, **quiet(backward=True)):
        for step in range(3):
            model[2].value = float("nan") if step == 1 else None
            loss = model(x).pow(2).sum()
            opt.zero_grad()
            loss.backward()
            before = snapshot(model)
            if step < 1:
                opt.step()
                continue
            with pytest.raises(numguard.NonFiniteError) as info:
                opt.step()
            break
    err = info.value
    assert err.module == "2"                      # the Gate, whose backward made the NaN
    assert err.labels == ["grad_input[0]"]
    assert err.batch_number == 1
    assert "backward frames" in err.report
    assert "grad_input[0]" in err.report and "grad_output[0]" in err.report
    # Raised before the optimizer wrote anything: the weights are those of before the step.
    after = snapshot(model)
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert all(torch.isfinite(p).all() for p in after)


def test_parameter_gradient_is_named_with_its_parameter():
    torch.manual_seed(0)
    model = nn.Sequential(ScaledByBadWeight(), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(3, 4)
    model[0].value = float("inf")
    with numguard.watch(model, **quiet(backward=True)):
        loss = model(x).sum()
        loss.backward()
        before = snapshot(model)
        with pytest.raises(numguard.NonFiniteError) as info:
            opt.step()
    assert "0.weight.grad" in info.value.labels
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(model)))


@pytest.mark.parametrize("optimizer", ["SGD", "SparseAdam"])
def test_a_sparse_gradient_is_checked_before_the_optimizer_applies_it(optimizer):
    # nn.Embedding(sparse=True) hands the optimizer a sparse COO gradient: a NaN in its values
    # raises at the step, before any weight is written (it reached the weights one batch early).
    torch.manual_seed(0)
    emb = nn.Embedding(10, 4, sparse=True)
    model = nn.Sequential(emb, nn.Linear(4, 1))
    opt = (torch.optim.SGD(model.parameters(), lr=0.1) if optimizer == "SGD"
           else torch.optim.SparseAdam(list(emb.parameters()), lr=0.1))
    ids = torch.tensor([1, 2, 3, 2])
    with numguard.watch(model, **quiet(backward=True)):
        for _ in range(2):
            opt.zero_grad()
            model(ids).sum().backward()
            opt.step()
        opt.zero_grad()
        model(ids).sum().backward()
        assert emb.weight.grad.is_sparse
        emb.weight.grad._values()[1, 2] = float("nan")
        before = snapshot(model)
        with pytest.raises(numguard.NonFiniteError) as info:
            opt.step()
    assert "0.weight.grad" in info.value.labels and info.value.batch_number == 2
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(model)))


def test_forward_only_watch_ignores_gradients():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model[2].value = float("nan")
    with numguard.watch(model, **quiet()):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()  # backward=False: gradients are not watched
    assert not torch.isfinite(model[0].weight).all()


def _scaler_loop(model, scaler, opt, steps, bad_step, value):
    x = torch.randn(3, 4, device=next(model.parameters()).device)
    weights = []
    for step in range(steps):
        model[2].value = value if step == bad_step else None
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        scaler.scale(loss).backward()
        before = snapshot(model)
        scaler.step(opt)
        scaler.update()
        weights.append((before, snapshot(model)))
    return weights


@pytest.mark.parametrize("device", DEVICES)
def test_gradscaler_skip_is_counted_not_a_trip(caplog, device):
    model = make_model().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler(device, init_scale=1024.0)
    with caplog.at_level("INFO", logger="numguard"):
        with numguard.watch(model, **quiet(backward=True)) as insp:
            weights = _scaler_loop(model, scaler, opt, 4, 1, float("inf"))
            watcher = insp.backward_watcher
            assert watcher.scaler_skipped_steps == 1
    skips = [r.getMessage() for r in caplog.records if "GradScaler skipped" in r.getMessage()]
    assert len(skips) == 1 and "batch_number=1" in skips[0]
    before, after = weights[1]
    assert all(torch.equal(a, b) for a, b in zip(before, after))        # the skipped step
    before, after = weights[2]
    assert not all(torch.equal(a, b) for a, b in zip(before, after))    # later steps apply
    assert scaler.get_scale() == 512.0
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_gradscaler_skip_can_be_a_trip():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    with numguard.watch(model, **quiet(backward=True, scaler_skips="trip")):
        with pytest.raises(numguard.NonFiniteError) as info:
            _scaler_loop(model, scaler, opt, 3, 1, float("inf"))
    assert info.value.module == "2"


def test_gradscaler_does_not_hide_a_forward_nan():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    x = torch.randn(3, 4)
    with numguard.watch(model, **quiet(backward=True)):
        for step in range(3):
            if step == 2:
                with torch.no_grad():
                    model[3].weight[0, 0] = float("nan")
            try:
                loss = model(x).pow(2).mean()
                opt.zero_grad()
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            except numguard.NonFiniteError as exc:
                error = exc
                break
        else:
            pytest.fail("the forward NaN was not reported")
    assert error.module == "3" and error.batch_number == 2


def test_an_evaluation_that_keeps_gradients_on_is_checked_when_it_returns():
    # After training started the forward's check waits for the optimizer step (one read per
    # step); a model in eval() mode takes no step, so its forward is checked at its return.
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with numguard.watch(model, **quiet(backward=True)):
        for _ in range(2):
            sgd_step(model, opt, torch.randn(3, 4))()
        with torch.no_grad():
            model[3].bias[0] = float("nan")
        model.eval()
        with pytest.raises(numguard.NonFiniteError) as info:
            model(torch.randn(3, 4))   # gradients on, as many validation loops leave them
        assert info.value.module == "3" and info.value.batch_number == 2


def sgd_step(model, opt, x):
    def step():
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return step


def test_healthy_backward_steps_read_the_device_at_most_once_per_step():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)  # SGD reads nothing back itself
    step = sgd_step(model, opt, torch.randn(3, 4))

    with numguard.watch(model, **quiet(backward=True)):
        step()  # the first batch also checks at its end (no optimizer seen yet)
        steps = 4
        with SyncCounter()() as counter:
            for _ in range(steps):
                step()
    assert counter.total <= steps, counter.where
    assert counter.numguard >= steps  # the one read per step is there (a real check happens)


def test_a_model_trained_in_eval_mode_reads_the_device_no_more_than_in_train_mode():
    # Frozen BatchNorm / no dropout: a model trained in eval() mode. Its forwards are checked at
    # their return until an optimizer step follows one; from then on once per step, as in train().
    def syncs(mode):
        model = make_model()
        getattr(model, mode)()
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        step = sgd_step(model, opt, torch.randn(3, 4))
        with numguard.watch(model, **quiet(backward=True)):
            with SyncCounter()() as counter:
                for _ in range(5):
                    step()
            model[2].value = float("nan")   # a NaN gradient still raises before the step writes
            before = snapshot(model)
            with pytest.raises(numguard.NonFiniteError):
                step()
            assert all(torch.equal(a, b) for a, b in zip(before, snapshot(model)))
        return counter.numguard
    train, evaluated = syncs("train"), syncs("eval")
    assert 5 <= evaluated <= train, (evaluated, train)


def test_close_removes_every_hook():
    model = make_model()
    counts = [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()]
    original_step = torch.amp.GradScaler.step
    insp = numguard.watch(model, backward=True, report_to=None)
    assert torch.amp.GradScaler.step is not original_step
    insp.close()
    assert [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()] == counts
    assert torch.amp.GradScaler.step is original_step
    assert "check" not in vars(insp)
    assert len(ng_backward._watchers) == 0


def test_gradient_taps_do_not_accumulate_on_reused_tensors():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(3, 4, requires_grad=True)  # a leaf fed to the model every step
    with numguard.watch(model, **quiet(backward=True)):
        for _ in range(3):
            loss = model(x).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
    tap = getattr(x, "_numguard_grad_tap", None)
    assert tap is None or len(tap.entries) <= 2


def test_invalid_scaler_skips():
    model = make_model()
    insp = numguard.watch(model, report_to=None)
    with pytest.raises(ValueError, match="scaler_skips='sometimes'"):
        ng_backward.BackwardWatcher(insp, model, scaler_skips="sometimes")
    insp.close()


def test_async_backward_steps_never_read_the_device():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    step = sgd_step(model, opt, torch.randn(3, 4))

    with numguard.watch(model, **quiet(backward=True, check="async")):
        step()
        step()
        with SyncCounter()() as counter:
            for _ in range(4):
                step()
    assert counter.total == 0, counter.where


def test_async_backward_nan_is_found_at_the_next_check():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(3, 4)
    with numguard.watch(model, **quiet(backward=True, check="async")):
        with pytest.raises(numguard.NonFiniteError) as info:
            for step in range(4):
                model[2].value = float("nan") if step == 1 else None
                loss = model(x).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
    assert info.value.module == "2" and info.value.batch_number == 1


def test_gradient_is_named_after_the_module_that_made_it():
    # The Gate passes its input through unchanged (same tensor): the gradient of that tensor is
    # made by the Linear after it, and is named after that Linear.
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    frames = []
    with numguard.watch(model, **quiet(backward=True)) as insp:
        original = insp.record_frame

        def spy(name, cls, labels, values, section="forward"):
            if section == "backward" and len(labels) == 1:
                frames.append((name, labels[0]))
            return original(name, cls, labels, values, section=section)
        insp.record_frame = spy
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
    assert frames == [("3", "grad_output[0]"), ("3", "grad_input[0]"), ("1", "grad_input[0]")]


def test_an_explicit_check_is_never_deferred():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(3, 4)
    with numguard.watch(model, **quiet(backward=True)) as insp:
        model(x).sum().backward()
        opt.step()
        with torch.no_grad():
            model[3].weight[0, 0] = float("nan")
        model(x).sum().backward()  # grad enabled: the batch-end check waits for the step
        with pytest.raises(numguard.NonFiniteError):
            insp.check()


def test_a_dict_output_is_labelled_the_same_way_in_its_forward_and_its_gradient_frames():
    class Heads(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            h = self.lin(x)
            return {"logits": h * 2, "pair": (h, h + 1)}

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.heads = Heads()

        def forward(self, x):
            out = self.heads(x)
            return out["logits"].sum() + out["pair"][1].sum()

    model = Model()
    with numguard.watch(model, **quiet(backward=True)) as insp:
        model(torch.randn(2, 4)).backward()
        frames = [f for f in insp._ring.frames if f.owner.name == "heads"]
    forward = {label for f in frames if f.section == "forward" for label in f.labels}
    gradients = {label for f in frames if f.section == "backward" for label in f.labels}
    assert {"output.logits", "output.pair[1]"} <= forward
    assert gradients == {"grad_output.logits", "grad_output.pair[1]"}
