"""numguard.integrations.accelerate.watch with a real Accelerator on CPU."""
import pytest
import torch

pytest.importorskip("accelerate")
from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState  # noqa: E402

import numguard  # noqa: E402
from numguard.integrations.accelerate import numerics_summary, watch  # noqa: E402

from integ_models import TinyNet, loader  # noqa: E402


def train(watched, poison_at=None, steps=5, mixed_precision="no", **options):
    """Accelerate's usual loop; returns (losses, inspector or None, model)."""
    torch.manual_seed(0)
    AcceleratorState._reset_state(reset_partial_state=True)  # each run picks its own precision
    accelerator = Accelerator(cpu=True, mixed_precision=mixed_precision)
    model = TinyNet(poison_at)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer, data = accelerator.prepare(model, optimizer, loader())
    inspector = watch(accelerator, model, report_to=None, **options) if watched else None
    losses = []
    try:
        for step, batch in enumerate(data):
            if step == steps:
                break
            loss = model(batch["x"], labels=batch["labels"])["loss"]
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss.detach()))
    finally:
        if inspector is not None:
            inspector.close(check=False)
    return losses, inspector, accelerator.unwrap_model(model)


def test_healthy_run_has_the_unwatched_losses():
    plain, _, _ = train(False)
    watched, inspector, _ = train(True)
    assert watched == plain and len(plain) == 5
    summary = numerics_summary(inspector)
    assert summary["numguard/nonfinite"] == 0.0 and summary["numguard/skipped_steps"] == 0.0


def test_nan_at_a_known_step_stops_that_step_naming_the_module():
    with pytest.raises(numguard.NonFiniteError) as info:
        train(True, poison_at=2)
    err = info.value
    assert err.module == "poison" and err.labels == ["output"] and err.batch_number == 2
    assert "during batch_number=2 in poison (Poison)" in str(err)


def test_model_names_come_from_the_unwrapped_model():
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(TinyNet())
    with watch(accelerator, model, report_to=None) as inspector:
        names = set(inspector.module_names.values())
    assert {"fc1", "poison", "fc2"} <= names


def test_bf16_mixed_precision_has_the_unwatched_losses():
    try:
        plain, _, _ = train(False, mixed_precision="bf16")
    except (ValueError, RuntimeError) as exc:
        pytest.skip(f"bf16 mixed precision is not available on this CPU: {exc}")
    watched, inspector, _ = train(True, mixed_precision="bf16")
    assert watched == plain
    assert 0.0 < numerics_summary(inspector)["numguard/worst_headroom"] < 1.0  # bf16 activations seen


def test_bf16_mixed_precision_nan_is_caught():
    with pytest.raises(numguard.NonFiniteError) as info:
        train(True, poison_at=1, mixed_precision="bf16")
    assert info.value.module == "poison" and info.value.batch_number == 1


@pytest.mark.timeout(200)
def test_dist_check_covers_accelerate_operations_instead_of_debug_mode():
    from integ_workers import run_ranks

    results = run_ranks("accelerate_ops", world=2, timeout=150,
                        env={"NUMGUARD_DIST_CHECK": "1", "ACCELERATE_DEBUG_MODE": "1",
                             "NUMGUARD_DIST_TIMEOUT": "30"})
    for res in results:
        assert res["processes"] == 2, res
        assert res["debug_before"] is True and res["debug_after"] is False, res
        for op in ("gather", "reduce", "broadcast", "pad_across_processes", "gather_for_metrics"):
            assert res[op].get("exc") == "DistributedOperationException", (op, res[op])
        assert res["pad_uneven"] == {"ok": [6, 3]}, res
        assert res["gather_ok"] == {"ok": [4, 3]}, res
        # each operation's first collective checks the operation's whole container
        assert {"accelerate.utils.operations.gather", "accelerate.utils.operations.reduce",
                "accelerate.utils.operations.broadcast",
                "accelerate.utils.operations.pad_across_processes"} <= set(res["checked_ops"]), \
            res["checked_ops"]
    assert "both set" in results[0]["log"]


def test_start_up_turns_accelerate_debug_mode_off_when_numguard_checks_collectives(monkeypatch):
    import numguard.distributed as ngd
    from numguard.integrations import accelerate as ng_accelerate

    monkeypatch.setattr(ng_accelerate, "_told", set())
    monkeypatch.setenv("ACCELERATE_DEBUG_MODE", "1")
    monkeypatch.setenv("NUMGUARD_DIST_CHECK", "0")
    assert ng_accelerate.prefer_numguard_collective_check() is False  # numguard's check is off: leave it
    import os
    assert os.environ["ACCELERATE_DEBUG_MODE"] == "1"
    monkeypatch.setenv("NUMGUARD_DIST_CHECK", "1")
    try:
        with pytest.warns(UserWarning, match="both set"):
            assert ng_accelerate.prefer_numguard_collective_check() is True
        assert os.environ["ACCELERATE_DEBUG_MODE"] == "0"
        assert ngd.guard.installed_guard() is not None
    finally:
        ngd.unguard_collectives()


def _same_everywhere(results, key):
    outcomes = [res[key] for res in results]
    assert all(o.get("exc") == "DistributedOperationException" for o in outcomes), outcomes
    assert outcomes[0]["msg"] == outcomes[1]["msg"], outcomes
    return outcomes[0]["msg"]


@pytest.mark.timeout(250)
@pytest.mark.parametrize("how", ["NUMGUARD_DIST_CHECK", "guard_collectives before", "guard_collectives after"])
def test_accelerate_containers_are_checked_as_a_whole(how):
    from integ_workers import run_ranks

    env = {"NUMGUARD_DIST_TIMEOUT": "30"}
    env.update({"NUMGUARD_DIST_CHECK": "1"} if how == "NUMGUARD_DIST_CHECK" else
               {"NUMGUARD_DIST_CHECK": "0", "NG_EXPLICIT_GUARD": how.split()[1]})
    results = run_ranks("accelerate_containers", world=2, timeout=200, env=env)
    assert all(res["processes"] == 2 for res in results)
    gather_op = "Operation: `accelerate.utils.operations.gather`"

    msg = _same_everywhere(results, "keys_differ")  # before: rank 0 got rank 1's "c" under "b"
    assert gather_op in msg
    assert "Input shapes:\n  - Process 0: {'a': [2], 'b': [2]}\n  - Process 1: {'a': [2], 'c': [2]}\n" in msg
    assert "keys of input are ['a', 'c'] instead of ['a', 'b'] (missing 'b'; extra 'c')" in msg
    assert "integ_workers.py" in msg.split("Call sites:")[1]  # the caller's line, not Accelerate's

    # before: rank 0's extra collective waited for rank 1 ("ranks that never arrived")
    msg = _same_everywhere(results, "extra_key")
    assert "never arrived" not in msg
    assert ("structure (2 leaves instead of 3: keys of input are ['a', 'b'] instead of "
            "['a', 'b', 'c'] (missing 'c'))") in msg

    # Accelerate pairs a dict's values by position: the same keys in another order is a mismatch
    msg = _same_everywhere(results, "key_order")
    assert "keys of input are in another order: ['b', 'a'] instead of ['a', 'b']" in msg

    msg = _same_everywhere(results, "nested_keys")
    assert "keys of input['out'] are ['logits', 'aux'] instead of ['logits', 'loss']" in msg
    msg = _same_everywhere(results, "list_length")
    assert "input['xs'] is a list of 3 instead of 2" in msg
    msg = _same_everywhere(results, "tensor_vs_scalar")  # before: TypeError on rank 1 alone
    assert "Operation: `accelerate.utils.operations.reduce`" in msg
    assert "input['x'] is float instead of a tensor" in msg
    for key, op in (("reduce_keys", "reduce"), ("broadcast_keys", "broadcast"),
                    ("pad_keys", "pad_across_processes"), ("gather_for_metrics_keys", "gather")):
        msg = _same_everywhere(results, key)
        assert f"Operation: `accelerate.utils.operations.{op}`" in msg
        assert "(missing 'b'; extra 'c')" in msg

    for rank, res in enumerate(results):
        assert res["healthy_gather"] == {"ok": {"a": [0.0, 0.0, 1.0, 1.0],
                                                "b": [[10.0, 11.0], [20.0, 21.0]]}}, res
        # one numguard exchange per tensor, as before: the container's check adds none
        assert res["healthy_gather_exchanges"] == ["all_reduce"] * 3, res["healthy_gather_exchanges"]
        assert res["healthy_reduce"] == {"ok": [1.0, 1.0]}
        assert res["healthy_pad"] == {"ok": {"a": [3, 3], "b": [1]}}
        assert res["healthy_broadcast"] == {"ok": [1.0, 1.0]}
