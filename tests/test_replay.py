"""Replay on trip (watch(model, replay=True) / NUMGUARD_REPLAY=1): after a trip the first bad module
is re-run on its last inputs in operation mode, and the report names the operation, or says that
the replay could not be trusted or did not reproduce the NaN/Inf."""
import inspect
import os

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

import numguard
from inspector_helpers import SyncCounter, all_hooks, quiet, tiny_gpt2, train_steps
from test_operations import Divider, LogHead, exp_overflow_stack


def _trip(model, x, **options):
    with numguard.watch(model, **quiet(**options)) as insp:
        with pytest.raises(numguard.NonFiniteError) as info:
            model(x)
    assert _get_current_dispatch_mode() is None
    return insp, info.value


CASES = {
    "log of a negative": (lambda: (torch.manual_seed(0), LogHead())[1], lambda: torch.randn(2, 4)),
    "fp16 exp overflow, nested": (exp_overflow_stack, lambda: torch.full((2, 4), 1.0)),
    "division by zero": (lambda: (torch.manual_seed(0), nn.Sequential(nn.Linear(4, 4), Divider(False)))[1],
                         lambda: torch.randn(3, 4)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_replay_names_the_same_operation_as_operation_mode(case):
    make_model, make_x = CASES[case]
    ops_insp, _ = _trip(make_model(), make_x(), ops=True)
    expected = ops_insp.last_report["operation"]
    insp, err = _trip(make_model(), make_x(), replay=True)
    replayed = insp.last_report["replay"]
    assert "operation" not in insp.last_report   # module mode: found by the replay only
    assert replayed["reproduced"] is True
    assert replayed["op"] == expected["op"] and replayed["site"] == expected["site"]
    assert replayed["op_module"] == ops_insp.last_report["module"]
    assert replayed["op_class"] == ops_insp.last_report["class"]
    line = next(l for l in err.report.splitlines() if l.startswith("numguard: replay of"))
    assert f"first non-finite operation: {expected['op']} in " in line and expected["site"] in line
    assert f"by operation {expected['op']} at {expected['site']} (found by replay)" in str(err)


class DropoutLog(nn.Module):
    """log(dropout(x) - 0.5): NaN only where dropout kept a small value; whether it happens
    depends on the random draw."""

    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return torch.log(self.drop(x) + 1e-3)


def test_replay_restores_the_random_state_of_the_call():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Identity(), DropoutLog())
    x = -torch.rand(64) * 1e-4   # kept values: 2x(-1e-4..0) + 1e-3 > 0; dropped ones: 1e-3
    x[0] = -1.0                  # NaN only when dropout keeps element 0: depends on the draw
    seeds = []
    for seed in range(40):
        torch.manual_seed(seed)
        seeds.append(bool(torch.isnan(model(x)).any()))
    tripping = [seed for seed, nan in enumerate(seeds) if nan]
    assert len(tripping) >= 8 and False in seeds
    # Each replay draws dropout's mask again from the state of its call: every one reproduces
    # (a replay from whatever state came next would reproduce about half of them).
    for seed in tripping[:8]:
        torch.manual_seed(seed)
        insp, err = _trip(model, x, replay=True)
        replayed = insp.last_report["replay"]
        assert replayed["reproduced"] is True and replayed["op"] == "aten::log", seed
        assert replayed["op_module"] == "1"


class ResetsItself(nn.Module):
    """Divides by a buffer that the module sets to zero on one call and back to one after it: the
    replay runs with the buffer already reset, so the NaN/Inf does not come back."""

    def __init__(self):
        super().__init__()
        self.scale = 0.0

    def forward(self, x):
        out = x / self.scale
        self.scale = 1.0   # state that changed since the call that tripped
        return out


def test_a_replay_that_does_not_reproduce_says_so():
    model = nn.Sequential(nn.Linear(4, 4), ResetsItself())
    insp, err = _trip(model, torch.randn(2, 4), replay=True)
    replayed = insp.last_report["replay"]
    assert replayed["reproduced"] is False and replayed["op"] is None
    assert "did not reproduce" in replayed["reason"]
    assert any(l.startswith("numguard: replay of 1 (ResetsItself) did NOT reproduce the non-finite value")
               for l in err.report.splitlines())
    assert "found by replay" not in str(err)


class InPlaceAfter(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = LogHead()

    def forward(self, x):
        out = self.head(x)
        x.mul_(0.0)   # the input the head received is changed after its call
        return out


def test_an_input_changed_in_place_is_not_replayed():
    torch.manual_seed(0)
    model = InPlaceAfter()
    insp, err = _trip(model, torch.randn(2, 4), replay=True)
    replayed = insp.last_report["replay"]
    assert replayed["module"] == "head" and replayed["reproduced"] is False
    assert "changed in place" in replayed["reason"]
    assert "numguard: could not replay head (LogHead): input[0] was changed in place" in err.report


def test_a_backward_trip_is_not_replayed_and_says_why():
    model = nn.Sequential(nn.Linear(4, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with numguard.watch(model, **quiet(replay=True, backward=True)) as insp:
        out = model(torch.randn(2, 4))
        (out.sum() * float("inf")).backward()
        with pytest.raises(numguard.NonFiniteError):
            opt.step()
    replayed = insp.last_report["replay"]
    assert replayed["reproduced"] is False and "backward pass" in replayed["reason"]


class NormLog(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.BatchNorm1d(4)

    def forward(self, x):
        return torch.log(self.norm(x) - 1000.0)


def test_replay_leaves_buffers_random_state_and_hooks_as_they_were():
    import copy

    torch.manual_seed(0)
    model = nn.Sequential(nn.Identity(), NormLog())
    twin = copy.deepcopy(model)
    x = torch.randn(8, 4)
    twin(x)   # what one forward does to the running statistics
    rng = torch.get_rng_state()
    insp = numguard.watch(model, **quiet(replay=True))
    with pytest.raises(numguard.NonFiniteError):
        model(x)
    assert insp.last_report["replay"]["reproduced"] is True   # the replay ran the BatchNorm again...
    assert torch.equal(model[1].norm.running_mean, twin[1].norm.running_mean)   # ...and restored it
    assert model[1].norm.num_batches_tracked.item() == 1
    assert torch.equal(torch.get_rng_state(), rng)
    insp.close()
    assert all_hooks(model) == 0


def test_replay_adds_no_host_sync_and_lets_inputs_go_at_a_healthy_check(monkeypatch):
    model = tiny_gpt2(torch.float32)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    opt = train_steps(model, 1, ids)
    monkeypatch.setenv("NUMGUARD_REPLAY", "1")
    insp = numguard.watch(model, **quiet(check_every=2))
    assert insp.replay is True
    train_steps(model, 1, ids, opt)      # batch 0: not checked, its inputs are kept
    kept = len(insp._keeper.calls)
    assert 0 < kept <= len(list(model.modules()))   # one call per module that ran
    train_steps(model, 1, ids, opt)      # batch 1: checked healthy, nothing is held any more
    assert insp._keeper.calls == {}
    with SyncCounter()() as counter:
        train_steps(model, 4, ids, opt)
    insp.close()
    assert counter.in_hooks == 0, counter.where
    assert counter.numguard <= 2, counter.where   # the two checks' reads


def test_bad_replay_value_is_a_clear_error():
    with pytest.raises(ValueError, match="replay="):
        numguard.watch(nn.Linear(2, 2), replay="sometimes")


def test_under_no_grad_inputs_are_held_weakly_and_a_freed_one_is_said():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), LogHead())   # LogHead's input dies inside the forward
    with numguard.watch(model, **quiet(replay=True)) as insp:
        with torch.no_grad(), pytest.raises(numguard.NonFiniteError) as info:
            model(torch.randn(2, 4))
    replayed = insp.last_report["replay"]
    assert replayed["module"] == "1" and replayed["reproduced"] is False
    assert "freed after the call" in replayed["reason"]
    assert "numguard: could not replay 1 (LogHead): its inputs were freed" in info.value.report
    # An input still alive at the trip (the caller holds it) is replayed under no_grad too.
    x = torch.randn(2, 4)
    head = LogHead()
    with numguard.watch(head, **quiet(replay=True)) as insp:
        with torch.no_grad(), pytest.raises(numguard.NonFiniteError):
            head(x)
    assert insp.last_report["replay"]["reproduced"] is True


class HalvesItsWeight(nn.Module):
    """An EMA-like forward: it scales its own weight through .data, then takes a log that is NaN."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))

    def forward(self, x):
        self.weight.data.mul_(0.5)
        return torch.log(x * self.weight - 1000.0)


def test_replay_puts_back_the_parameters_its_forward_changes():
    model = nn.Sequential(nn.Identity(), HalvesItsWeight())
    insp, _ = _trip(model, torch.randn(2, 4), replay=True)
    assert insp.last_report["replay"]["reproduced"] is True   # the replay ran the forward again...
    assert torch.equal(model[1].weight.detach(), torch.full((4,), 0.5))   # ...and put the weight back
    assert model[1].weight._version == 0   # through .data: a pending backward is not broken


class DividesByCachedScale(nn.Module):
    """Divides by the first scale of a list argument, then replaces it in the list (a cache update):
    the list the replay is given must be the one the call saw."""

    def forward(self, x, scales):
        out = x / scales[0]
        scales[0] = torch.ones_like(scales[0])
        return out


class Caller(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x, scales):
        return self.inner(x, scales)


def test_a_list_argument_the_forward_changes_is_replayed_as_the_call_saw_it():
    scales = [torch.zeros(())]
    model = Caller(DividesByCachedScale())
    with numguard.watch(model, **quiet(replay=True)) as insp:
        with pytest.raises(numguard.NonFiniteError) as info:
            model(torch.randn(2, 4), scales)
    replayed = insp.last_report["replay"]
    assert replayed["module"] == "inner" and replayed["reproduced"] is True, replayed["reason"]
    assert replayed["op"] == "aten::div"
    first = inspect.getsourcelines(DividesByCachedScale.forward)[1]   # the `def` line; the div is next
    assert replayed["site"] == f"{os.path.basename(__file__)}:{first + 1}"
    assert "found by replay" in str(info.value)
    assert float(scales[0]) == 1.0   # the user's list is as the forward left it


class ResetsScaleInPlace(nn.Module):
    def forward(self, x, state):
        out = x / state["scale"]
        state["scale"].fill_(1.0)   # the tensor inside the dict is changed in place after use
        return out


def test_a_tensor_changed_in_place_inside_a_dict_argument_is_named_not_called_unreproduced():
    head = ResetsScaleInPlace()
    with numguard.watch(head, **quiet(replay=True)) as insp:
        with pytest.raises(numguard.NonFiniteError) as info:
            head(torch.randn(2, 4), {"scale": torch.zeros(())})
    replayed = insp.last_report["replay"]
    assert replayed["reproduced"] is False
    assert replayed["reason"].startswith("input[1].scale was changed in place after the call")
    assert "did NOT reproduce" not in info.value.report
    assert "numguard: could not replay (root module) (ResetsScaleInPlace): input[1].scale was changed in place" \
        in info.value.report
