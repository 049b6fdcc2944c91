"""numguard.integrations.lightning.NumguardCallback with a real Lightning Trainer on CPU."""
import pytest
import torch

pl = pytest.importorskip("pytorch_lightning")

import numguard  # noqa: E402
from numguard.integrations.lightning import NumguardCallback  # noqa: E402

from integ_models import lightning_module_class, loader  # noqa: E402

LitNet = lightning_module_class(pl)


def fit(callbacks=(), poison_at=None, mode="train", precision="32-true", steps=5, **options):
    pl.seed_everything(0, verbose=False)
    model = LitNet(poison_at, mode)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         precision=precision, callbacks=list(callbacks), log_every_n_steps=1, **options)
    return model, trainer


def test_healthy_run_has_the_unwatched_losses_and_logs_a_summary():
    plain, trainer = fit()
    trainer.fit(plain, loader())
    callback = NumguardCallback(report_to=None)
    watched, trainer = fit([callback])
    trainer.fit(watched, loader())
    assert watched.losses == plain.losses and len(plain.losses) == 5
    assert trainer.callback_metrics["numguard/nonfinite"] == 0.0
    assert trainer.callback_metrics["numguard/skipped_steps"] == 0.0
    assert callback.inspector is None  # closed at teardown
    assert not numguard.inspector.is_watched(watched)
    assert "training_step" not in watched.__dict__  # the step routing is undone


def test_nan_at_a_known_step_stops_that_step_naming_the_module():
    model, trainer = fit([NumguardCallback(report_to=None)], poison_at=3)
    with pytest.raises(numguard.NonFiniteError) as info:
        trainer.fit(model, loader())
    err = info.value
    assert err.module == "net.poison" and err.labels == ["output"] and err.batch_number == 3
    assert "(Lightning global_step=3) in net.poison (Poison)" in str(err)
    assert trainer.global_step == 3
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert not numguard.inspector.is_watched(model) and "training_step" not in model.__dict__


def test_validation_nan_is_caught():
    model, trainer = fit([NumguardCallback(report_to=None)], poison_at=1, mode="eval",
                         val_check_interval=2, num_sanity_val_steps=0)
    with pytest.raises(numguard.NonFiniteError) as info:
        trainer.fit(model, loader(), loader(8, seed=1))
    assert info.value.module == "net.poison"
    assert trainer.global_step == 2


def test_bf16_mixed_has_the_unwatched_losses_and_reports_headroom():
    plain, trainer = fit(precision="bf16-mixed")
    trainer.fit(plain, loader())
    callback = NumguardCallback(report_to=None)
    watched, trainer = fit([callback], precision="bf16-mixed")
    trainer.fit(watched, loader())
    assert watched.losses == plain.losses
    assert 0.0 < callback.last_summary["numguard/worst_headroom"] < 1.0  # bf16 activations were seen


def test_bf16_mixed_nan_is_caught():
    model, trainer = fit([NumguardCallback(report_to=None)], poison_at=2, precision="bf16-mixed")
    with pytest.raises(numguard.NonFiniteError) as info:
        trainer.fit(model, loader())
    assert info.value.module == "net.poison" and trainer.global_step == 2


def test_16_mixed():
    try:
        model, trainer = fit([NumguardCallback(report_to=None)], precision="16-mixed")
    except Exception as exc:  # Lightning refuses fp16 AMP on CPU
        pytest.skip(f"precision='16-mixed' is not supported on this CPU: {exc}")
    if trainer.precision != "16-mixed":  # Lightning falls back to bf16-mixed on CPU
        pytest.skip(f"Lightning runs precision='16-mixed' as {trainer.precision!r} on CPU (no fp16 AMP there)")
    trainer.fit(model, loader())
    assert len(model.losses) == 5


@pytest.mark.timeout(200)
def test_ddp_two_processes_stop_in_the_same_step():
    from integ_workers import run_ranks

    results = run_ranks("lightning_ddp", world=2, timeout=150)
    for rank, res in enumerate(results):
        assert res.get("exc") == "NonFiniteError", res
        assert res["global_step"] == 2 and res["steps_run"] == 3, res
        assert res["ranks"] == [0, 1] or res["ranks"] == [0], res
    # Rank 0 made the NaN in its forward; rank 1 saw it arrive in DDP's averaged gradients.
    assert results[0]["module"] == "net.poison"
    assert "Lightning global_step=2" in results[1]["msg"]
