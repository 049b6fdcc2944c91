"""numguard.integrations.transformers.NumguardCallback with a real Transformers Trainer on CPU."""
import warnings

import pytest
import torch

pytest.importorskip("transformers")
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

import numguard  # noqa: E402
from numguard.integrations import transformers as ng_transformers  # noqa: E402
from numguard.integrations.transformers import NumguardCallback  # noqa: E402

from integ_models import TinyNet, samples  # noqa: E402


class Seen(TrainerCallback):
    """A callback after numguard's: what the logs looked like when it got them."""

    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs))


def make_trainer(tmp_path, callbacks=(), poison_at=None, mode="train", steps=5, **args):
    torch.manual_seed(0)
    arguments = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, per_device_eval_batch_size=4,
        max_steps=steps, logging_steps=1, report_to=[], use_cpu=True, seed=0, save_strategy="no",
        disable_tqdm=True, **args)
    return Trainer(model=TinyNet(poison_at, mode), args=arguments, train_dataset=samples(),
                   eval_dataset=samples(8, seed=1), callbacks=list(callbacks))


def losses(trainer):
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def test_healthy_run_has_the_unwatched_losses_and_logs_a_summary(tmp_path):
    plain = make_trainer(tmp_path / "plain")
    plain.train()
    callback, seen = NumguardCallback(report_to=None), Seen()
    watched = make_trainer(tmp_path / "watched", [callback, seen])
    watched.train()
    assert losses(watched) == losses(plain) and len(losses(plain)) == 5
    for logs in seen.logs:
        assert logs["numguard/nonfinite"] == 0.0
        assert logs["numguard/skipped_steps"] == 0.0
        assert logs["numguard/worst_headroom"] == 0.0  # float32 model: nothing low precision
    assert "numguard/nonfinite" in watched.state.log_history[0]
    assert callback.inspector is None  # closed at on_train_end
    assert not numguard.inspector.is_watched(watched.model)


def test_nan_at_a_known_step_stops_that_step_naming_module_and_global_step(tmp_path):
    trainer = make_trainer(tmp_path, [NumguardCallback(report_to=None)], poison_at=3)
    with pytest.raises(numguard.NonFiniteError) as info:
        trainer.train()
    err = info.value
    assert err.module == "poison" and err.labels == ["output"] and err.batch_number == 3
    assert "during batch_number=3 (Trainer global_step=3) in poison (Poison)" in str(err)
    assert trainer.state.global_step == 3  # the optimizer never applied the bad step
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_gradient_accumulation_reports_the_optimizer_step(tmp_path):
    # Two batches per optimizer step: batch 5 belongs to global step 2.
    trainer = make_trainer(tmp_path, [NumguardCallback(report_to=None)], poison_at=5,
                           gradient_accumulation_steps=2)
    with pytest.raises(numguard.NonFiniteError, match=r"batch_number=5 \(Trainer global_step=2\)"):
        trainer.train()


def test_debug_underflow_overflow_is_served_by_numguard_alone(tmp_path, monkeypatch):
    monkeypatch.setattr(ng_transformers, "_told", set())
    reports = []
    trainer = make_trainer(tmp_path, [NumguardCallback(report_to=reports.append)], poison_at=2,
                           debug="underflow_overflow")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(numguard.NonFiniteError) as info:
            trainer.train()
    said = [w for w in caught if "underflow_overflow" in str(w.message)]
    assert len(said) == 1 and "served by numguard" in str(said[0].message)
    assert info.value.module == "poison"
    assert len(reports) == 1 and "Detected inf/nan during batch_number=2" in reports[0]
    from transformers.debug_utils import DebugUnderflowOverflow
    hooks = [h for m in trainer.model.modules() for h in m._forward_hooks.values()
             if isinstance(getattr(h, "__self__", None), DebugUnderflowOverflow)]
    assert hooks == []


def _debug_option_run(tmp_path, poison_at):
    """A Trainer with debug="underflow_overflow": (stdout, exception, trainer)."""
    import contextlib
    import io
    trainer = make_trainer(tmp_path, poison_at=poison_at, steps=4, debug="underflow_overflow")
    out, err = io.StringIO(), None
    with contextlib.redirect_stdout(out), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            trainer.train()
        except Exception as exc:  # noqa: BLE001 - compared below, whatever it is
            err = exc
    # The run's timing numbers differ from run to run; every other printed byte must not.
    return "\n".join(line for line in out.getvalue().split("\n") if "train_runtime" not in line), err, trainer


@pytest.mark.parametrize("poison_at", [2, None])
def test_serve_debug_option_prints_and_raises_what_transformers_does(tmp_path, monkeypatch, poison_at):
    # What NUMGUARD=1 jobs get: the Trainer's own DebugUnderflowOverflow call makes numguard's drop-in.
    import transformers.trainer
    monkeypatch.setattr(transformers.trainer, "DebugUnderflowOverflow", transformers.trainer.DebugUnderflowOverflow)
    monkeypatch.setattr(ng_transformers, "_told", set())
    hf_out, hf_err, _ = _debug_option_run(tmp_path / "hf", poison_at)
    ng_transformers.serve_debug_option()
    ng_transformers.serve_debug_option()  # idempotent
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(tmp_path / "once", steps=1, debug="underflow_overflow").train()
    assert sum("served by numguard's drop-in" in str(w.message) for w in caught) == 1
    ng_out, ng_err, trainer = _debug_option_run(tmp_path / "ng", poison_at)
    assert ng_out == hf_out
    assert type(ng_err) is type(hf_err)
    if poison_at is not None:
        assert "Detected inf/nan during batch_number=2" in hf_out
        assert type(ng_err) is ValueError and str(ng_err) == str(hf_err)
        assert isinstance(ng_err.__context__, numguard.NonFiniteError) and ng_err.__suppress_context__
        assert ng_err.__context__.module == "poison"
    assert numguard.inspector.is_watched(trainer.model)
    # A NumguardCallback on the same model takes over from the drop-in: one detector.
    assert ng_transformers.remove_debug_underflow_overflow(trainer.model) > 0
    assert not numguard.inspector.is_watched(trainer.model)
    assert all(not m._forward_hooks for m in trainer.model.modules())


def test_on_trip_warn_counts_trips_in_the_logs(tmp_path):
    seen = Seen()
    trainer = make_trainer(tmp_path, [NumguardCallback(report_to=None, on_trip="warn"), seen], poison_at=1,
                           steps=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()  # training goes on after each trip
    counts = [logs["numguard/nonfinite"] for logs in seen.logs if "loss" in logs]
    assert counts[0] == 0.0 and counts[1] >= 1.0 and counts == sorted(counts)


def test_evaluation_is_watched_and_checked_on_its_own(tmp_path):
    # Training is healthy; the second evaluation batch holds the NaN.
    trainer = make_trainer(tmp_path, [NumguardCallback(report_to=None)], poison_at=1, mode="eval",
                           eval_strategy="steps", eval_steps=2)
    with pytest.raises(numguard.NonFiniteError) as info:
        trainer.train()
    assert info.value.module == "poison"
    assert trainer.state.global_step == 2


def test_numguard_values_reach_reporting_callbacks_that_run_before_user_callbacks(tmp_path):
    class Reporter(TrainerCallback):  # stands for TensorBoard / W&B: the Trainer puts them first
        __module__ = "transformers.integrations.stand_in"

        def __init__(self):
            self.logs = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logs.append(dict(logs))

    reporter = Reporter()
    trainer = make_trainer(tmp_path, [reporter, NumguardCallback(report_to=None)], steps=2)
    trainer.train()
    assert reporter.logs and all("numguard/nonfinite" in logs for logs in reporter.logs)


def test_invalid_option_fails_at_construction():
    with pytest.raises(ValueError, match="on_trip"):
        NumguardCallback(on_trip="explode")


@pytest.mark.timeout(200)
def test_ddp_two_processes_evaluate_and_stop_in_the_same_step():
    from integ_workers import run_ranks

    results = run_ranks("transformers_ddp", world=2, timeout=150)
    for res in results:
        assert res["parallel"] == "ParallelMode.DISTRIBUTED", res
        # Evaluation batches (every 2 steps) are checked on their own rank; training goes on.
        assert res["healthy"] == {"ok": 4} and len(res["eval_losses"]) == 2, res
        assert res["poisoned"].get("exc") == "NonFiniteError" and res["poisoned_step"] == 2, res
        assert "(Trainer global_step=2)" in res["poisoned"]["msg"] and res["poisoned"]["ranks"] == [0, 1]
    assert results[0]["poisoned"]["module"] == "poison"  # rank 0 made the NaN in its forward
