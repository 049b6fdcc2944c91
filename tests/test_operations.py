"""Operation mode (watch(model, ops=True) / NUMGUARD_OPS=1): the first operation that made a
NaN/Inf is named with its module and call site, without host syncs on healthy batches."""
import os
import warnings

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

import numguard
from numguard.errors import InspectorWarning
from numguard.inspector import operations
from inspector_helpers import SyncCounter, quiet, tiny_gpt2, train_steps, watched_training_syncs

THIS_FILE = os.path.basename(__file__)


def _line(marker):
    """The line number of the line of this file that ends with `# <marker>`."""
    with open(__file__, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.rstrip().endswith(f"# {marker}"):
                return number
    raise AssertionError(marker)


class LogHead(nn.Module):
    """A Linear then a log of a shifted value: negative inputs make NaN in aten::log."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        return torch.log(h - 1000.0)  # op: log


class Fp16Exp(nn.Module):
    def forward(self, x):
        y = x.to(torch.float16)
        return torch.exp(y)  # op: exp


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.act = Fp16Exp()

    def forward(self, x):
        return self.act(self.proj(x) * 20.0).float()


class Stack(nn.Module):
    """Nested blocks: the exp overflow happens two levels down."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, x):
        for block in self.blocks:
            x = block(x) * 1e-3
        return x


def _divide(x, by):
    return x / by  # op: div


class Divider(nn.Module):
    """An op called through a helper function: its call site is the helper's line."""

    def __init__(self, numerator_zero):
        super().__init__()
        self.norm = nn.LayerNorm(4)
        self.numerator_zero = numerator_zero

    def forward(self, x):
        x = self.norm(x)
        if self.numerator_zero:
            x = x * 0.0
        return _divide(x, torch.zeros_like(x))


def _trip(model, x, **options):
    with numguard.watch(model, **quiet(ops=True, **options)) as insp:
        with pytest.raises(numguard.NonFiniteError) as info:
            model(x)
    assert _get_current_dispatch_mode() is None  # the mode is left even though the forward raised
    return insp, info.value


def test_log_of_negative_is_named_with_module_and_call_site():
    torch.manual_seed(0)
    model = LogHead()
    insp, err = _trip(model, torch.randn(2, 4))
    report = insp.last_report
    assert report["operation"]["op"] == "aten::log"
    assert report["operation"]["site"] == f"{THIS_FILE}:{_line('op: log')}"
    assert report["module"] == "" and report["class"] == "LogHead"
    assert err.module == ""
    assert "aten::log" in str(err) and f"{THIS_FILE}:{_line('op: log')}" in str(err)
    line = next(l for l in err.report.splitlines() if l.startswith("numguard: first non-finite operation"))
    assert line.startswith(f"numguard: first non-finite operation: aten::log in (root module) (LogHead) at "
                           f"{THIS_FILE}:{_line('op: log')}: input abs max ")
    assert line.endswith("output nan")
    # The module frames are those of module mode: the Linear, then the root whose output holds
    # the NaN (operation frames explain a module's trip; they do not trip by themselves).
    assert "                  lin Linear" in err.report
    assert "Last 2 forward frames:" in err.report


def exp_overflow_stack():
    """A Stack whose first block's exp overflows float16 on an input of ones: exp(4 * 0.5 * 20)."""
    torch.manual_seed(0)
    model = Stack()
    with torch.no_grad():
        for block in model.blocks:
            block.proj.weight.fill_(0.5)
            block.proj.bias.zero_()
    return model


def test_fp16_exp_overflow_names_the_nested_module():
    model = exp_overflow_stack()
    x = torch.full((2, 4), 1.0)
    insp, err = _trip(model, x)
    op = insp.last_report["operation"]
    assert op["op"] == "aten::exp" and op["site"] == f"{THIS_FILE}:{_line('op: exp')}"
    assert op["output_abs_max"] == float("inf")
    assert op["input_abs_max"] == pytest.approx(40.0)   # 4 * 0.5 * 20: exp(40) overflows float16
    assert err.module == "blocks.0.act" and insp.last_report["class"] == "Fp16Exp"
    assert ("numguard: first non-finite operation: aten::exp in blocks.0.act (Fp16Exp) at "
            f"{THIS_FILE}:{_line('op: exp')}: input abs max 4.0e+01, output inf") in err.report
    # The operations section shows the bad operation with the ones just before it.
    section = err.report.split("operations frames:")[1]
    assert "blocks.0.proj Linear aten::addmm" in section or "blocks.0.proj Linear aten::" in section
    assert f"blocks.0.act Fp16Exp aten::exp at {THIS_FILE}:{_line('op: exp')}" in section


@pytest.mark.parametrize("numerator_zero, output", [(False, "inf"), (True, "nan")])
def test_division_by_zero(numerator_zero, output):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Divider(numerator_zero))
    insp, err = _trip(model, torch.randn(3, 4))
    op = insp.last_report["operation"]
    assert op["op"] == "aten::div" and op["site"] == f"{THIS_FILE}:{_line('op: div')}"
    assert err.module == "1" and insp.last_report["class"] == "Divider"
    assert err.report.splitlines().count(
        f"numguard: first non-finite operation: aten::div in 1 (Divider) at {THIS_FILE}:{_line('op: div')}: "
        f"input abs max {op['input_abs_max']:.1e}, output {output}") == 1
    # Module frames before the operation: the Linear and the LayerNorm.
    assert "                  0 Linear" in err.report and "                  1.norm LayerNorm" in err.report


def test_ops_off_records_no_operation_frames_and_names_no_operation():
    model = LogHead()
    with numguard.watch(model, **quiet()) as insp:
        with pytest.raises(numguard.NonFiniteError) as info:
            model(torch.randn(2, 4))
    assert "operation" not in insp.last_report
    assert "aten::" not in info.value.report and "aten::" not in str(info.value)
    assert info.value.module == ""


def test_healthy_ops_batches_keep_operation_frames_and_no_mode_after():
    model = tiny_gpt2(torch.float32)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with numguard.watch(model, **quiet(ops=True)) as insp:
        with torch.no_grad():
            model(ids)
        sections = {section for _, section, _ in insp.held().frames}
        assert _get_current_dispatch_mode() is None
    assert sections == {"forward", "operations"}


def test_no_sync_with_ops_except_the_batch_end_read(backend):
    steps = 3
    insp, counter = watched_training_syncs(steps, ops=True)
    assert len([f for f in insp.held().frames if f[1] == "operations"]) > 0
    insp.close()
    assert counter.in_hooks == 0, counter.where
    assert counter.numguard <= steps, counter.where


def test_internal_error_in_the_mode_warns_once_and_switches_it_off(monkeypatch):
    def broken():
        raise RuntimeError("call site lookup failed")
    monkeypatch.setattr(operations, "call_site", broken)
    torch.manual_seed(0)
    model = LogHead()
    with torch.no_grad():
        model.lin.weight.zero_()
        model.lin.bias.fill_(2000.0)   # healthy: log(1000)
    insp = numguard.watch(model, **quiet(ops=True))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = model(torch.randn(2, 4))
        model(torch.randn(2, 4))
    ours = [w for w in caught if issubclass(w.category, InspectorWarning) and "operation mode" in str(w.message)]
    assert len(ours) == 1 and "call site lookup failed" in str(ours[0].message)
    assert torch.isfinite(out).all()
    assert _get_current_dispatch_mode() is None
    # Modules are still watched: a NaN is still reported, by module.
    with torch.no_grad():
        model.lin.bias.zero_()
    with pytest.raises(numguard.NonFiniteError) as info:
        model(torch.randn(2, 4))
    assert info.value.module == "" and "operation" not in insp.last_report
    insp.close()


def test_numguard_ops_variable_turns_it_on(monkeypatch):
    monkeypatch.setenv("NUMGUARD_OPS", "1")
    model = LogHead()
    with numguard.watch(model, **quiet()) as insp:
        assert insp.ops is True
        with pytest.raises(numguard.NonFiniteError, match="aten::log"):
            model(torch.randn(2, 4))
    with numguard.watch(model, **quiet(ops=False)) as insp:
        assert insp.ops is False
    # The drop-in never records operations: it prints what Transformers prints.
    dropin = numguard.DebugUnderflowOverflow(model)
    assert dropin.ops is False
    dropin.close()


def test_bad_ops_value_is_a_clear_error():
    with pytest.raises(ValueError, match="ops="):
        numguard.watch(LogHead(), ops="yes")


class MaskedAttention(nn.Module):
    def forward(self, scores):
        mask = torch.ones_like(scores, dtype=torch.bool).triu(1)
        return torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)


def test_a_minus_inf_mask_up_to_the_softmax_is_not_a_trip():
    model = nn.Sequential(nn.Linear(4, 4), MaskedAttention())
    with numguard.watch(model, **quiet(ops=True)) as insp:
        out = model(torch.randn(4, 4))
        ops = [f for f in insp.held().frames if f[1] == "operations"]
    assert torch.isfinite(out).all() and insp.trips == 0
    assert len(ops) >= 2   # the Linear's addmm and the softmax are still recorded


def test_an_operation_trip_names_its_pass_and_headroom_lists_no_operation_frames():
    model = exp_overflow_stack()
    insp, err = _trip(model, torch.full((2, 4), 1.0))
    assert insp.last_report["section"] == "forward"
    line = next(l for l in err.report.splitlines() if l.startswith("numguard: first non-finite value"))
    assert line.startswith("numguard: first non-finite value in blocks.0.act (Fp16Exp) output, forward pass,")
    # The headroom section lists module frames only (operation frames repeat their tensors).
    headroom = err.report.split("Headroom (", 1)[1]
    assert "blocks.0.act Fp16Exp output" in headroom and "aten::" not in headroom


# -- backward operations (backward=True, ops=True) -------------------------------------------------

class LogOfGradient(torch.autograd.Function):
    """Identity forward; the backward takes the log of the saved input: NaN for negative inputs."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 1.0  # op: custom forward

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * torch.log(x)  # op: backward log


class BackwardLog(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return LogOfGradient.apply(self.lin(x)) + 1.0


class SqrtHead(nn.Module):
    """sqrt(0) is finite; its backward divides by 2*sqrt(0) = 0, and the Inf reaches the Linear's
    output gradient."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        return torch.sqrt(y - y.detach())  # op: sqrt


def _backward_trip(model, x):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with numguard.watch(model, **quiet(ops=True, backward=True)) as insp:
        out = model(x)
        assert insp.trips == 0   # the forward is finite
        out.sum().backward()
        assert _get_current_dispatch_mode() is None
        with pytest.raises(numguard.NonFiniteError) as info:
            opt.step()   # the check before the optimizer step finds the backward's NaN/Inf
    return insp, info.value


def test_division_by_zero_in_backward_is_named_with_the_node_and_forward_line():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), SqrtHead())
    insp, err = _backward_trip(model, torch.randn(8, 4))
    report = insp.last_report
    op = report["operation"]
    assert op["op"] == "aten::div" and op["backward_of"] == "SqrtBackward0"
    assert op["site"] == f"{THIS_FILE}:{_line('op: sqrt')}"
    assert op["output_abs_max"] == float("inf")
    # The module frames are module mode's: the first gradient holding the Inf is the Linear's.
    assert report["module"] == "1.lin" and report["class"] == "Linear" and report["section"] == "backward"
    assert (f"numguard: first non-finite operation: aten::div in 1 (SqrtHead) in the backward of SqrtBackward0 "
            f"(forward at {THIS_FILE}:{_line('op: sqrt')})") in err.report
    assert "Last " in err.report and "backward operations frames:" in err.report
    assert "backward pass" in err.report


def test_log_of_negative_in_a_custom_backward_is_named():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Identity(), BackwardLog())
    with torch.no_grad():
        model[1].lin.bias.fill_(-5.0)   # negative saved inputs: log is NaN in the backward only
    insp, err = _backward_trip(model, torch.zeros(2, 4))
    op = insp.last_report["operation"]
    assert op["op"] == "aten::log" and op["backward_of"] == "LogOfGradientBackward"
    # Named by the module and line of the forward that made the node (the custom forward's op).
    assert op["site"] == f"{THIS_FILE}:{_line('op: custom forward')}"
    assert insp.last_report["module"] == "1.lin" and insp.last_report["class"] == "Linear"
    assert "aten::log" in str(err)


def test_backward_operations_are_not_recorded_without_backward_true():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), SqrtHead())
    with numguard.watch(model, **quiet(ops=True)) as insp:
        model(torch.randn(8, 4)).sum().backward()
        sections = {section for _, section, _ in insp.held().frames}
    assert "backward operations" not in sections
    assert torch.autograd.backward.__module__ == "torch.autograd"


def test_backward_operations_add_no_host_sync():
    model = tiny_gpt2(torch.float32)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    opt = train_steps(model, 1, ids)
    insp = numguard.watch(model, **quiet(ops=True, backward=True))
    train_steps(model, 1, ids, opt)
    steps = 2
    with SyncCounter()() as counter:
        train_steps(model, steps, ids, opt)
    held = {section for _, section, _ in insp.held().frames}
    insp.close()
    assert "backward operations" in held
    assert counter.in_hooks == 0, counter.where
    assert counter.numguard <= steps, counter.where


# -- a NaN/Inf the model throws away is not a trip (NOTE: [operation frames do not trip]) ----------

class DropsLogOfZero(nn.Module):
    """T5's relative-position buckets in small: log(0) = -inf for the zero distances, thrown away
    by torch.where; then, optionally, a real NaN made by sqrt of a negative."""

    def __init__(self, make_nan=False):
        super().__init__()
        self.make_nan = make_nan

    def forward(self, x):
        distance = torch.arange(4).float()
        large = torch.log(distance / 2.0)  # op: dead-end log
        buckets = torch.where(distance < 2, distance, large.clamp(max=3.0))
        out = x + buckets
        if self.make_nan:
            out = torch.sqrt(out - 10.0)  # op: real sqrt
        return out


def test_an_inf_the_model_throws_away_is_not_a_trip():
    model = nn.Sequential(nn.Linear(4, 4), DropsLogOfZero())
    with numguard.watch(model, **quiet(ops=True)) as insp:
        for _ in range(2):
            out = model(torch.randn(3, 4))
    assert torch.isfinite(out).all() and insp.trips == 0


def test_the_blamed_operation_is_the_one_that_made_the_modules_nan():
    model = nn.Sequential(nn.Linear(4, 4), DropsLogOfZero(make_nan=True))
    insp, err = _trip(model, torch.zeros(3, 4))
    op = insp.last_report["operation"]
    # Not the dead-end log(0) that ran first in the same module: the sqrt whose NaN is the output.
    assert op["op"] == "aten::sqrt" and op["site"] == f"{THIS_FILE}:{_line('op: real sqrt')}"
    assert op["module"] == "1" and op["class"] == "DropsLogOfZero"
    assert insp.last_report["module"] == "1"


class InPlaceLog(nn.Module):
    """A shift then a log, both in place on the Linear's output: the log makes the NaN."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        h.sub_(1000.0)  # op: in-place sub
        h.log_()  # op: in-place log
        return h


class OutLog(nn.Module):
    """log(x - 1000) written with out= into a buffer that holds a NaN before the op (its old values
    are no input of the log)."""

    def forward(self, x):
        buf = torch.full_like(x, float("nan"))
        torch.log(x - 1000.0, out=buf)  # op: out= log
        return buf


def test_an_in_place_operation_that_makes_the_nan_is_named_not_the_one_before_it():
    torch.manual_seed(0)
    insp, err = _trip(InPlaceLog(), torch.randn(2, 4))
    op = insp.last_report["operation"]
    assert op["op"] == "aten::log_" and op["site"] == f"{THIS_FILE}:{_line('op: in-place log')}"
    # The log's input is recorded as it was before the log ran: finite, about -1000.
    assert op["input_abs_max"] == pytest.approx(1000.0, rel=0.01) and op["output_abs_max"] != op["output_abs_max"]
    assert "aten::log_" in str(err) and "aten::sub_" not in str(err)
    frames = [f for f in insp.last_report["frames"] if f.get("op") == "aten::sub_"]
    nan = numguard.STAT_FIELDS.index("nan")
    assert frames and all(r[nan] == 0 for r in frames[0]["records"] if r is not None)


def test_an_out_operation_is_named_and_its_old_values_are_no_input():
    insp, err = _trip(OutLog(), torch.randn(2, 4))
    op = insp.last_report["operation"]
    assert op["op"] == "aten::log" and op["site"] == f"{THIS_FILE}:{_line('op: out= log')}"
    assert op["input_abs_max"] == pytest.approx(1000.0, rel=0.01)
    log_frame = next(f for f in insp.last_report["frames"] if f.get("op") == "aten::log")
    assert log_frame["labels"] == ["input[0]", "output"]   # the out= buffer only as the output


class ViewsBetween(nn.Module):
    """x * big overflows float32; views (view, t, expand) stand between it and the matmul that
    reads the Inf."""

    def __init__(self, batched):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 3))
        self.batched = batched

    def forward(self, x):
        a = x * 1e39  # op: overflowing mul
        b = a.view(4, 2).t()
        if self.batched:
            return torch.bmm(b.unsqueeze(0).expand(3, 2, 4), self.weight.expand(3, 4, 3))
        return b @ self.weight


@pytest.mark.parametrize("batched", [False, True])
def test_lineage_follows_views_to_the_operation_that_made_the_inf(batched):
    torch.manual_seed(0)
    insp, err = _trip(ViewsBetween(batched), torch.randn(2, 4))
    op = insp.last_report["operation"]
    assert op["op"] == "aten::mul" and op["site"] == f"{THIS_FILE}:{_line('op: overflowing mul')}"
    assert op["output_abs_max"] == float("inf")
    assert "by operation aten::mul" in str(err)


class WrittenThroughAView(nn.Module):
    """A slice of the Linear's output is scaled in place past float32's range; the matmul reads
    the whole output (the same storage, written after the Linear made it)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        h[:, :2].mul_(1e39)  # op: in-place mul of a slice
        return h @ h.t()


def test_lineage_follows_an_in_place_write_through_a_view():
    torch.manual_seed(0)
    insp, _ = _trip(WrittenThroughAView(), torch.randn(2, 4))
    op = insp.last_report["operation"]
    assert op["op"] == "aten::mul_" and op["site"] == f"{THIS_FILE}:{_line('op: in-place mul of a slice')}"
