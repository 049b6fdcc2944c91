"""Inspector.batch(step=...): a batch begun and ended by the caller (a training loop, a framework's
own batch hooks) instead of by the root module's forward."""
import warnings

import pytest
import torch
from torch import nn

import numguard
from numguard.testing import SyncCounter


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        return self.head(self.encoder(x))


def quiet(**kw):
    kw.setdefault("report_to", None)
    return kw


def step_through_children(model, x):
    """A training step that calls the submodules directly (the root's forward never runs)."""
    return model.head(torch.relu(model.encoder(x))).pow(2).mean()


def test_a_bracket_is_one_batch_whatever_runs_inside(backend):
    model, x = Net(), torch.randn(3, 4)
    with numguard.watch(model, **quiet()) as insp:
        for step in range(3):
            with insp.batch(step=10 + step):
                assert insp.in_forward and insp.batch_number == step
                step_through_children(model, x)
                model(x)  # a root call inside continues the bracket's batch
                model(x)
            assert insp.batches_finished == step + 1
        assert insp.batch_number == 2 and insp.trips == 0


def test_a_nan_inside_names_its_module_batch_and_step(backend):
    model, x = Net(), torch.randn(3, 4)
    insp = numguard.watch(model, **quiet())
    with insp.batch(step=5):
        step_through_children(model, x)
    with torch.no_grad():
        model.head.bias.fill_(float("nan"))
    with pytest.raises(numguard.NonFiniteError) as info:
        with insp.batch(step=6, label="my step"):
            step_through_children(model, x)
    err = info.value
    assert err.module == "head" and err.batch_number == 1
    assert "during batch_number=1 (my step=6) in head (Linear)" in str(err)
    assert insp.last_report["framework_step"] == {"name": "my step", "value": 6}
    insp.close()


def test_end_checks_the_batch_result_as_the_root_output(backend):
    # A loss made NaN outside every module: no module frame holds it, the bracket's end does.
    model, x = Net(), torch.randn(3, 4)
    insp = numguard.watch(model, **quiet())
    bracket = insp.batch(step=0, inputs=(x,)).begin()
    loss = model(x).mean() * float("nan")
    with pytest.raises(numguard.NonFiniteError) as info:
        bracket.end(loss)
    assert info.value.module == "" and info.value.labels == ["output"]
    insp.close()
    # Without a result to check it is silent: the modules' outputs were finite.
    insp = numguard.watch(model, **quiet())
    with insp.batch(step=0):
        loss = model(x).mean() * float("nan")
    assert insp.trips == 0
    insp.close()


def test_an_exception_inside_is_a_raised_forward_and_the_next_batch_runs(backend):
    model, x = Net(), torch.randn(3, 4)
    insp = numguard.watch(model, **quiet())
    with pytest.raises(KeyError):
        with insp.batch(step=0):
            model(x)
            raise KeyError("data")
    assert not insp.in_forward
    with insp.batch(step=1):
        model(x)
    assert insp.batches_finished == 1 and insp.trips == 0
    # A NaN recorded before the exception is reported as a warning while the exception goes on.
    with torch.no_grad():
        model.encoder.weight.fill_(float("inf"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(KeyError):
            with insp.batch(step=2):
                model(x)
                raise KeyError("data")
    assert any(isinstance(w.message, numguard.errors.NonFiniteWarning) for w in caught)
    insp.close()


def test_a_bracket_is_used_once_and_does_nothing_after_close(backend):
    model, x = Net(), torch.randn(3, 4)
    insp = numguard.watch(model, **quiet())
    bracket = insp.batch()
    with bracket:
        model(x)
    bracket.end()  # idempotent
    with pytest.raises(RuntimeError, match="make a new one"):
        bracket.begin()
    late = insp.batch(step=3).begin()
    insp.close()
    late.end(torch.tensor(float("nan")))  # closed: nothing to check, nothing raised
    assert insp.batches_finished == 1


def test_the_bracket_adds_no_host_sync(backend):
    model, x = Net(), torch.randn(3, 4)
    insp = numguard.watch(model, **quiet())
    with insp.batch(step=0):
        step_through_children(model, x)
    steps = 4
    with SyncCounter()() as counter:
        for step in range(steps):
            with insp.batch(step=step) as bracket:
                loss = step_through_children(model, x)
                bracket.end(loss)
    insp.close()
    assert counter.in_hooks == 0, counter.where
    assert counter.numguard == steps, counter.where  # the batch-end check's one read each


def test_lightning_step_calling_submodules_and_a_nan_loss_outside_them():
    pl = pytest.importorskip("pytorch_lightning")
    from numguard.integrations.lightning import NumguardCallback

    class Lit(pl.LightningModule):
        def __init__(self, bad_step):
            super().__init__()
            self.net = Net()
            self.bad_step = bad_step

        def training_step(self, batch, batch_idx):
            loss = self.net.head(self.net.encoder(batch)).pow(2).mean()  # the root's forward never runs
            return loss * float("nan") if batch_idx == self.bad_step else loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    data = torch.utils.data.DataLoader(torch.randn(24, 4), batch_size=4)
    for backward in (True, False):
        model = Lit(bad_step=2)
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=5, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False,
                             callbacks=[NumguardCallback(report_to=None, backward=backward)])
        with pytest.raises(numguard.NonFiniteError) as info:
            trainer.fit(model, data)
        assert info.value.module == "" and info.value.batch_number == 2, (backward, str(info.value))
        assert "(Lightning global_step=2)" in str(info.value)
        assert trainer.global_step == 2  # stopped before the optimizer wrote the bad step
        assert "training_step" not in model.__dict__ and "forward" not in model.__dict__


@pytest.mark.parametrize("root_called", [True, False])
def test_rerun_of_a_bracketed_batch_says_why_it_gives_no_verdict(root_called):
    # A rerun reruns one root call; a bracketed batch's inputs are not kept. The reason said they
    # were "no longer kept (they are kept until the check after their batch)", which was not why.
    model, x = Net(), torch.randn(3, 4)
    insp = numguard.watch(model, **quiet(rerun=True))
    for step in range(2):
        with insp.batch(step=step):
            model(x) if root_called else step_through_children(model, x)
    bad = x.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(numguard.NonFiniteError) as info:
        with insp.batch(step=2):
            model(bad) if root_called else step_through_children(model, bad)
    insp.close(check=False)
    assert info.value.module == "encoder" and info.value.attribution is None
    rerun = insp.last_report["rerun"]
    assert rerun["verdict"] is None and "bracketed by inspector.batch()" in rerun["reason"], rerun
    assert "numguard.rerun_step" in rerun["reason"] and "no longer kept" not in rerun["reason"]


def test_rerun_of_a_root_call_after_brackets_still_gives_its_verdict():
    model, x = Net(), torch.randn(3, 4)
    insp = numguard.watch(model, **quiet(rerun=True))
    with insp.batch(step=0):
        model(x)
    bad = x.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(numguard.NonFiniteError) as info:
        model(bad)   # a batch of its own: kept, rerun
    insp.close(check=False)
    assert info.value.attribution is not None and info.value.attribution.verdict == "reproducible"


def test_rerun_reason_of_a_bracketed_batch_checked_after_a_later_one():
    # backward=True with gradient accumulation: the check at the optimizer step comes after the
    # next bracket began; the reason of the earlier batch was forgotten ("no longer kept").
    model, x = Net(), torch.randn(3, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    insp = numguard.watch(model, **quiet(rerun=True, backward=True))
    with insp.batch(step=0):   # a first step: from now on the optimizer step checks the batches
        loss = model(x).sum()
    loss.backward()
    opt.step()
    bad = x.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(numguard.NonFiniteError) as info:
        for inputs in (bad, x):   # two accumulated batches, then one optimizer step
            with insp.batch(step=1):   # as Lightning brackets a step: it ends before the backward
                loss = model(inputs).sum()
            loss.backward()
        opt.step()
    insp.close(check=False)
    assert info.value.batch_number == 1
    rerun = insp.last_report["rerun"]
    assert rerun["batch"] == 1 and "bracketed by inspector.batch()" in rerun["reason"], rerun
