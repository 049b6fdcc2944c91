"""watch(model, backward=True) of compiled models (inductor on the CPU): the gradients of the modules
inside the graph are recorded in the graph's backward, and the report of a NaN made in the backward
of one submodule names that submodule and gradient label exactly as eager mode does, with no graph
break, no recompilation per batch and no host sync of numguard's own."""
import io

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

import numguard
from numguard import schema
from numguard.inspector import graph as _graph

import test_compile_frames as compile_frames
from test_compile_frames import counting_host_reads
from test_compile_watch import fresh_dynamo  # noqa: F401 - autouse: dynamo and its counters reset per test


class ScaleGradient(torch.autograd.Function):
    """Identity forward; the backward multiplies the gradient by a 0-dim tensor."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.save_for_backward(factor)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        factor, = ctx.saved_tensors
        return grad * factor, None


class Planted(nn.Module):
    """Its backward alone turns the gradient bad once its `factor` buffer is set to NaN/Inf (a
    buffer, not a Python flag: the compiled code stays the same, nothing is recompiled)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("factor", torch.ones(()))

    def forward(self, x):
        return ScaleGradient.apply(x, self.factor)


class Net(compile_frames.Net):
    """test_compile_frames' model (a keyword argument, a tuple output one part of which is thrown
    away) with a planted backward."""

    def __init__(self):
        super().__init__()
        self.planted = Planted()


# The backward frames of one training step in eager mode, in the order they are recorded.
EAGER_GRADIENTS = [("out", "grad_output[0]"), ("out", "grad_input[0]"), ("planted", "grad_input[0]"),
                   ("block.norm", "grad_input[0]"), ("block.proj", "grad_output[0]"),
                   ("block.proj", "grad_input[0]"), ("act", "grad_input[0]")]


def prepare(order, **watch_kwargs):
    torch.manual_seed(0)
    model = Net()
    if order == "compile-then-watch":
        runner = torch.compile(model)
        inspector = numguard.watch(runner, backward=True, **watch_kwargs)
    else:
        inspector = numguard.watch(model, backward=True, **watch_kwargs)
        runner = model
        if order == "watch-then-compile":
            runner = torch.compile(model)
        elif order == "Module.compile":
            model.compile()
    return model, runner, inspector


def train(model, runner, steps, bad_step=None, value=float("nan")):
    """Training steps; the planted module's backward goes bad at `bad_step`. Returns the
    NonFiniteError raised (or None) and the weights right before the step that raised."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    weights = None
    try:
        for step in range(steps):
            if step == bad_step:
                model.planted.factor.fill_(value)
            runner(x).square().mean().backward()
            weights = [p.detach().clone() for p in model.parameters()]
            opt.step()
            opt.zero_grad()
    except numguard.NonFiniteError as exc:
        return exc, weights
    return None, weights


def run_with_bad_gradient(order):
    text = io.StringIO()
    model, runner, inspector = prepare(order, report_to=text)
    error, weights = train(model, runner, 3, bad_step=2)
    inspector.close(check=False)
    return text.getvalue(), error, weights, model


@pytest.mark.parametrize("order", ["compile-then-watch", "watch-then-compile", "Module.compile"])
def test_report_of_a_nan_made_in_a_compiled_backward_equals_eager(order):
    eager, eager_error, _, _ = run_with_bad_gradient("eager")
    torch._dynamo.reset()
    counters.clear()
    compiled, error, weights_before, model = run_with_bad_gradient(order)
    assert eager_error is not None and error is not None
    assert error.module == eager_error.module == "planted"
    assert error.labels == eager_error.labels == ["grad_input[0]"]
    assert error.batch_number == eager_error.batch_number == 2
    assert "in planted (Planted) grad_input[0], backward pass, batch_number=2" in compiled
    # Raised before the optimizer step, as in eager mode: no weight took the NaN.
    assert all(torch.equal(a, b) for a, b in zip(weights_before, model.parameters()))
    # The whole report, byte for byte: the backward frames of the earlier steps included.
    assert compiled == eager
    assert "_orig_mod" not in compiled
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])


def test_compiled_once_no_graph_break_and_no_sync():
    model, runner, inspector = prepare("compile-then-watch", report_to=None)
    with inspector:
        train(model, runner, 1)
        graphs = counters["stats"]["unique_graphs"]
        calls = inspector._graph.cursor[schema.CURSOR_CALLS].item()
        with counting_host_reads() as syncs:
            train(model, runner, 4)
        frames, _, _ = inspector._graph.logged_frames(0)
    assert counters["stats"]["unique_graphs"] == graphs
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert syncs.in_hooks == 0, syncs.where
    assert syncs.numguard == 4, syncs.where  # one read per training step (before the optimizer step)
    # Per step: 8 module frames and 7 gradient frames, all recorded in the graphs.
    assert calls == 8 + 7
    assert inspector._graph.cursor[schema.CURSOR_CALLS].item() == 5 * calls
    gradients = [f for f in frames if f.batch == 3 and f.section == "backward"]
    assert [(f.owner.name, f.labels[0]) for f in gradients] == EAGER_GRADIENTS
    assert gradients[0].shapes == [(4, 4)] and gradients[0].dtypes == [torch.float32]


def test_eager_backward_frames_are_the_same_as_before():
    # The graph taps stay out of eager mode: the eager taps record the same frames, no graph ring.
    model, runner, inspector = prepare("eager", report_to=None)
    with inspector:
        train(model, runner, 2)
        frames = [f for f in inspector._ring.frames if f.section == "backward" and f.batch == 1]
        assert not inspector._graph.used
    assert [(f.owner.name, f.labels[0]) for f in frames][:-1] == EAGER_GRADIENTS
    assert frames[-1].labels[0] == "inp.weight.grad"


class Residual(nn.Module):
    """h = a(x) + b(x) is returned by no module: the graph taps it where `c` receives it."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.planted = Planted()
        self.c = nn.Linear(8, 2)

    def forward(self, x):
        h = self.a(x) + self.b(x)
        return self.c(self.planted(h))


@pytest.mark.parametrize("compiled", [False, True])
def test_tensor_no_module_returned_is_named_by_its_consumer(compiled):
    torch.manual_seed(0)
    model = Residual()
    runner = torch.compile(model) if compiled else model
    model.planted.factor.fill_(float("inf"))
    with numguard.watch(runner, backward=True, report_to=None):
        with pytest.raises(numguard.NonFiniteError) as info:
            runner(torch.randn(3, 8)).sum().backward()
            torch.optim.SGD(model.parameters(), lr=0.1).step()
    assert info.value.module == "planted" and info.value.labels == ["grad_input[0]"]
    assert sum(counters["graph_break"].values()) == 0


def test_gradscaler_skip_in_a_compiled_backward_is_counted_not_a_trip():
    model, runner, inspector = prepare("compile-then-watch", report_to=None)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    x = torch.randn(4, 8)
    with inspector:
        for step in range(4):
            model.planted.factor.fill_(float("inf") if step == 1 else 1.0)
            scaler.scale(runner(x).square().mean()).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        assert inspector.backward_watcher.scaler_skipped_steps == 1
    assert scaler.get_scale() == 512.0
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_failing_gradient_record_warns_and_training_goes_on(monkeypatch):
    model, runner, inspector = prepare("compile-then-watch", report_to=None)

    def broken(*args):
        raise RuntimeError("broken recorder")

    monkeypatch.setattr(_graph, "_record_gradient_now", broken)
    with inspector:
        with pytest.warns(RuntimeWarning, match="broken recorder"):
            error, _ = train(model, runner, 2)
        assert error is None
        assert inspector._graph.closed
        # Forward frames inside the graph and the parameter gradients are still checked.
        model.planted.factor.fill_(float("nan"))
        error, _ = train(model, runner, 1)
    assert error is not None and error.labels[0].endswith(".grad")


def test_transformers_gpt2_compiled_training_names_the_module_whose_backward_went_bad():
    transformers = pytest.importorskip("transformers")
    results = []
    for compiled in (False, True):
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        cfg = transformers.GPT2Config(vocab_size=64, n_embd=16, n_layer=2, n_head=2, n_positions=16,
                                      bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(cfg)
        factor = torch.ones(())
        # The MLP activation's backward goes bad (the model's code is unchanged: nothing recompiles).
        model.transformer.h[1].mlp.act.register_forward_hook(lambda m, a, out: ScaleGradient.apply(out, factor))
        runner = torch.compile(model) if compiled else model
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(3))
        text = io.StringIO()
        with numguard.watch(runner, backward=True, report_to=text):
            for _ in range(2):
                runner(ids, labels=ids).loss.backward()
                opt.step()
                opt.zero_grad()
            graphs = counters["stats"]["unique_graphs"]
            factor.fill_(float("nan"))
            with pytest.raises(numguard.NonFiniteError) as info:
                runner(ids, labels=ids).loss.backward()
                opt.step()
        assert counters["stats"]["unique_graphs"] == graphs
        # Transformers' own logger call is the only break (the model's, watched or not).
        assert all("logging.Logger" in reason for reason in counters["graph_break"]), dict(counters["graph_break"])
        results.append((info.value.module, info.value.labels, info.value.batch_number))
    assert results[1] == results[0] == ("transformer.h.1.mlp.act", ["grad_input[0]"], 2)


def test_dynamic_shapes_record_gradients_without_recompile_per_size():
    model, runner, inspector = prepare("compile-then-watch", report_to=None)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with inspector:
        for n in (3, 5, 7):  # recompiled once, dynamic, on the second size
            runner(torch.randn(n, 8)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        graphs = counters["stats"]["unique_graphs"]
        frames, _, _ = inspector._graph.logged_frames(2)
        model.planted.factor.fill_(float("inf"))
        with pytest.raises(numguard.NonFiniteError) as info:
            runner(torch.randn(9, 8)).square().mean().backward()
            opt.step()
    assert counters["stats"]["unique_graphs"] == graphs
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert info.value.module == "planted" and info.value.labels == ["grad_input[0]"]
    gradients = [f for f in frames if f.section == "backward"]
    assert [(f.owner.name, f.labels[0]) for f in gradients] == EAGER_GRADIENTS
    assert gradients[0].shapes == [(-1, 4)]  # the batch dimension is dynamic in the graph
