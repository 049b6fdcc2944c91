"""Attacks on the inspector's one promise, "if there is a NaN, I tell you": odd call patterns, odd
output structures, odd tensor kinds and odd settings. Each case is generated over its variations;
every one must end in a report (NonFiniteError / NonFiniteWarning), never in silence or a crash."""
import sys
import threading
import warnings

import pytest
import torch
from torch import nn

import numguard
from numguard.errors import InspectorWarning, NonFiniteWarning

from inspector_helpers import MLP, SyncCounter, all_hooks, quiet

NAN = float("nan")


# --- a healthy forward called while an exception is being handled -------------------------------
@pytest.mark.parametrize("depth", [1, 2, 3])
@pytest.mark.parametrize("bad_at", ["input", "a", "b"])
def test_model_called_inside_except_blocks_is_checked(depth, bad_at):
    model = MLP()
    insp = numguard.watch(model, **quiet())

    def call_nested(level):
        try:
            raise KeyError(f"user's own error {level}")
        except KeyError:
            if level > 1:
                return call_nested(level - 1)
            x = torch.ones(2, 8)
            if bad_at == "input":
                x[0, 0] = NAN
            elif bad_at == "a":
                with torch.no_grad():
                    model.a.bias[0] = NAN
            else:
                with torch.no_grad():
                    model.b.weight[0, 0] = float("inf")
            return model(x)

    model(torch.ones(2, 8))  # healthy batch first
    with pytest.raises(numguard.NonFiniteError) as info:
        call_nested(depth)
    assert info.value.batch_number == 1
    assert info.value.module == {"input": "a", "a": "a", "b": "b"}[bad_at]
    insp.close(check=False)


class RaisesAfterNaN(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x):
        y = self.a(x)
        raise RuntimeError("the model's own error after a NaN")


def test_nan_before_a_forward_that_raises_is_reported_and_the_error_goes_on():
    model = RaisesAfterNaN()
    insp = numguard.watch(model, **quiet())
    with pytest.warns(NonFiniteWarning, match="inf/nan detected"):
        with pytest.raises(RuntimeError, match="the model's own error"):
            model(torch.full((2, 4), NAN))
    assert insp.last_report is not None and insp.last_report["module"] == "a"
    insp.close(check=False)


# --- a NaN anywhere in an output or input structure ------------------------------------------------
class Emits(nn.Module):
    """Returns the structure `make(x)` builds around its input; the NaN is wherever make puts it."""

    def __init__(self, make):
        super().__init__()
        self.make = make

    def forward(self, x):
        return self.make(x)


def nested_list(depth):
    def make(x):
        value = x * NAN
        for _ in range(depth):
            value = [x, value]
        return (x, value)
    return make


def long_sequence(n, at, kind):
    def make(x):
        items = [x for _ in range(n)]
        items[at] = x * NAN
        return (x, kind(items))
    return make


def nested_dicts(depth):
    def make(x):
        value = {"bad": x * NAN}
        for i in range(depth):
            value = {f"k{i}": x, "inner": value}
        return value
    return make


STRUCTURES = {f"list nested {d} deep": nested_list(d) for d in (1, 2, 3, 9, 10, 30, 70)}
STRUCTURES.update({f"item {at} of {n} in a {kind.__name__}": long_sequence(n, at, kind)
                   for n, at in ((300, 299), (1000, 257), (600, 0)) for kind in (list, tuple)})
STRUCTURES.update({f"dicts nested {d} deep": nested_dicts(d) for d in (1, 12)})
STRUCTURES["sparse COO output"] = lambda x: (x * NAN).to_sparse()
STRUCTURES["sparse CSR output"] = lambda x: (x * NAN).to_sparse_csr()
STRUCTURES["nested tensor output"] = lambda x: torch.nested.nested_tensor([x[0] * NAN, x[1, :3]])
STRUCTURES["complex output"] = lambda x: torch.complex(x, x * NAN)
STRUCTURES["float64 output in a set-like dict value"] = lambda x: {"a": {"b": [(x * NAN).double()]}}


@pytest.mark.parametrize("extras", [True, False])
@pytest.mark.parametrize("structure", sorted(STRUCTURES))
def test_nan_anywhere_in_an_output_structure_is_reported(structure, extras):
    model = nn.Sequential(nn.Linear(4, 4), Emits(STRUCTURES[structure]))
    insp = numguard.watch(model, **quiet(extras=extras))
    with pytest.raises(numguard.NonFiniteError) as info:
        model(torch.ones(2, 4))
    assert info.value.module == "1"
    insp.close(check=False)


def test_drop_in_detects_nan_in_deep_outputs():
    model = nn.Sequential(nn.Linear(4, 4), Emits(nested_list(10)))
    debug = numguard.DebugUnderflowOverflow(model)
    debug.report_to = None
    with pytest.raises(numguard.NonFiniteError):
        model(torch.ones(2, 4))
    debug.close(check=False)


def test_a_container_that_holds_itself_is_followed_once_and_said_so():
    def make(x):
        loop = [x]
        loop.append(loop)
        loop.append(x * NAN)
        return (x, loop)
    model = nn.Sequential(nn.Linear(4, 4), Emits(make))
    texts = []
    insp = numguard.watch(model, report_to=texts.append)
    with pytest.raises(numguard.NonFiniteError) as info:
        model(torch.ones(2, 4))
    insp.close(check=False)
    assert info.value.labels == ["output[1][2]"]
    assert "output[1][1] (holds itself: not followed again)" in texts[0]


class KwargsModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Consumer()

    def forward(self, x, mask):
        return self.inner(x, mask=mask)


class Consumer(nn.Module):
    def forward(self, x, mask=None):
        return x.sum(dim=-1)


class PassesMaskOn(nn.Module):
    def forward(self, x, mask):
        return x * 2, mask


def test_a_nonfinite_input_a_module_passes_on_is_judged_as_its_output(backend):
    """A context record is not reused for an output line: a mask returned as an output trips,
    on both recorders (the native one and the Python one of the fallback)."""
    model = nn.Sequential(PassesMaskOn())
    mask = torch.full((2, 2), -float("inf"))
    insp = numguard.watch(model[0], **quiet())
    with pytest.raises(numguard.NonFiniteError) as info:
        model[0](torch.ones(2, 2), mask)
    assert info.value.labels == ["input[1]", "output[1]"]
    insp.close(check=False)

    inner = KwargsModel()  # the mask only taken, never returned: context at every level
    insp = numguard.watch(inner, **quiet())
    inner(torch.ones(2, 2), mask)
    inner(torch.ones(2, 2), mask)
    assert insp.trips == 0
    insp.close()


@pytest.mark.parametrize("extras", [True, False])
def test_nan_only_in_a_keyword_input_the_module_drops_is_context(extras):
    """A value a module takes and does not pass on (its output finite) is context in watch(): no
    trip, but its line is in the report of a later trip. The drop-in keeps Transformers' rule."""
    model = KwargsModel()
    insp = numguard.watch(model, **quiet(extras=extras))
    model(torch.ones(2, 4), mask=torch.full((2, 4), NAN))
    assert insp.trips == 0
    bad = torch.ones(2, 4)
    bad[0, 0] = NAN
    with pytest.raises(numguard.NonFiniteError) as info:
        model(bad, mask=torch.full((2, 4), NAN))
    assert info.value.batch_number == 1 and "input[0]" in info.value.labels
    assert ("kwargs.mask" in str(info.value.report)) is extras
    insp.close(check=False)

    dropin = numguard.DebugUnderflowOverflow(model, **quiet())
    with pytest.raises(ValueError, match="DebugUnderflowOverflow"):
        model(torch.ones(2, 4), mask=torch.full((2, 4), NAN))
    dropin.close(check=False)


# --- torch.inference_mode ------------------------------------------------------------------------
@pytest.mark.parametrize("first", ["inference", "no_grad", "train"])
def test_inference_then_training_then_inference(first):
    """Buffers made during an inference_mode batch must still serve training batches."""
    model = MLP()
    insp = numguard.watch(model, **quiet())
    context = {"inference": torch.inference_mode, "no_grad": torch.no_grad, "train": torch.enable_grad}[first]
    with warnings.catch_warnings():
        warnings.simplefilter("error", InspectorWarning)
        with context():
            model(torch.ones(2, 8))
        model(torch.ones(2, 8)).sum().backward()
        with torch.inference_mode():
            model(torch.ones(2, 8))
        with torch.no_grad():
            model.a.weight[0, 0] = NAN
        with pytest.raises(numguard.NonFiniteError) as info:
            model(torch.ones(2, 8))
    assert info.value.module == "a" and info.value.labels[0] == "weight"
    insp.close(check=False)


@pytest.mark.parametrize("watch_inside", [False, True])
@pytest.mark.parametrize("bad", ["output", "weight first batch", "weight later batch"])
def test_inference_mode_batches_are_watched(watch_inside, bad):
    model = MLP()
    if watch_inside:
        with torch.inference_mode():
            insp = numguard.watch(model, **quiet())
    else:
        insp = numguard.watch(model, **quiet())
    if bad == "weight first batch":
        with torch.no_grad():
            model.b.weight[0, 0] = NAN
    with warnings.catch_warnings():
        warnings.simplefilter("error", InspectorWarning)  # numguard must not give up on a module
        with torch.inference_mode():
            if bad == "weight later batch":
                model(torch.ones(2, 8))
                model(torch.ones(2, 8))
        if bad == "weight later batch":
            with torch.no_grad():
                model.b.weight[0, 0] = NAN
        # Training batches after inference ones still work on the same buffers.
        model(torch.ones(2, 8)).sum().backward() if bad == "output" else None
        with torch.inference_mode(), pytest.raises(numguard.NonFiniteError) as info:
            x = torch.ones(2, 8)
            if bad == "output":
                x[0, 0] = NAN
            model(x)
    assert info.value.module == ("a" if bad == "output" else "b")
    insp.close(check=False)


# --- modules called outside the root's forward -----------------------------------------------------
@pytest.mark.parametrize("calls_before", [0, 1, 3])
@pytest.mark.parametrize("target", ["a", "b", "nested"])
def test_submodule_called_directly_is_reported_when_it_returns(calls_before, target):
    model = nn.Sequential(MLP(), nn.Linear(8, 8))
    insp = numguard.watch(model, **quiet())
    direct = {"a": model[0].a, "b": model[1], "nested": model[0]}[target]
    for _ in range(calls_before):
        direct(torch.ones(2, 8))
        model(torch.ones(2, 8))
    with pytest.raises(numguard.NonFiniteError) as info:
        direct(torch.full((2, 8), NAN))  # no root call follows
    assert info.value.module == {"a": "0.a", "b": "1", "nested": "0.a"}[target]
    # The root's own batches are still counted as before.
    assert insp.batch_number == max(0, calls_before - 1)
    insp.close(check=False)


# --- a module that once returned a meta tensor ---------------------------------------------------
class SometimesMeta(nn.Module):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 1:
            return torch.empty(x.shape, device="meta")
        return x * NAN


def test_module_that_returned_meta_once_is_still_watched():
    model = nn.Sequential(nn.Linear(4, 4), SometimesMeta())
    insp = numguard.watch(model, **quiet())
    with warnings.catch_warnings():
        warnings.simplefilter("error", InspectorWarning)
        model(torch.ones(2, 4))
        with pytest.raises(numguard.NonFiniteError) as info:
            model(torch.ones(2, 4))
    assert info.value.module == "1"
    insp.close(check=False)


# --- two inspectors on one model ----------------------------------------------------------------
def test_a_second_watch_of_one_model_is_a_clear_error_naming_the_first():
    model = MLP()
    first = numguard.watch(model, **quiet())
    made_at = f"{__file__}:{sys._getframe().f_lineno - 1}"
    hooks = all_hooks(model)
    with pytest.raises(ValueError, match="already watched by an open Inspector") as info:
        numguard.watch(model, **quiet(on_trip="warn"))
    assert made_at in str(info.value) and "close" in str(info.value)
    assert all_hooks(model) == hooks  # the failed watch() left nothing behind
    with pytest.raises(numguard.NonFiniteError):  # the first one still reports
        model(torch.full((2, 8), NAN))
    first.close()
    with numguard.watch(model, **quiet()):  # once closed, watching again works and reports
        model(torch.ones(2, 8))
        with pytest.raises(numguard.NonFiniteError) as trip:
            model(torch.full((2, 8), NAN))
    assert trip.value.batch_number == 1


def test_watching_a_part_of_a_watched_model_still_works():
    model = MLP()
    with numguard.watch(model, **quiet()), numguard.watch(model.b, **quiet()) as inner:
        with pytest.raises(numguard.NonFiniteError) as info:
            model(torch.full((2, 8), NAN))
        assert info.value.module in ("a", "")
        with pytest.raises(numguard.NonFiniteError):
            model.b(torch.full((2, 8), NAN))
    assert inner.trips >= 1


# --- on_trip="dump" where the dump cannot be written --------------------------------------------
@pytest.mark.parametrize("where", ["a file", "under a file", "unwritable", "NUL in the name"])
def test_unwritable_dump_dir_still_reports_the_trip(tmp_path, where):
    blocker = tmp_path / "blocker"
    blocker.write_text("x")
    dump_dir = {"a file": blocker, "under a file": blocker / "sub", "unwritable": "/proc/numguard",
                "NUL in the name": str(tmp_path / "bad\0dir")}[where]
    model = MLP()
    insp = numguard.watch(model, **quiet(on_trip="dump", dump_dir=str(dump_dir)))
    with pytest.warns(NonFiniteWarning, match="inf/nan detected.*could not write the dump file"):
        model(torch.full((2, 8), NAN))
    insp.close(check=False)


# --- a watch() that fails leaves nothing behind ----------------------------------------------------
@pytest.mark.parametrize("options", [dict(backward=True, scaler_skips="sometimes"),
                                     dict(backward=True, scaler_skips=None)])
def test_failed_watch_leaves_no_hooks(options):
    model = MLP()
    before = all_hooks(model)
    with pytest.raises((ValueError, TypeError)):
        numguard.watch(model, **quiet(**options))
    assert all_hooks(model) == before
    model(torch.full((2, 8), NAN))  # nobody watches: no orphan raises


def test_watch_failing_after_its_hooks_are_in_removes_them(monkeypatch):
    import numguard.backward

    def broken(*args, **kwargs):
        raise RuntimeError("backward watcher could not start")

    monkeypatch.setattr(numguard.backward, "BackwardWatcher", broken)
    model = MLP()
    before = all_hooks(model)
    with pytest.raises(RuntimeError, match="could not start"):
        numguard.watch(model, **quiet(backward=True))
    assert all_hooks(model) == before
    model(torch.full((2, 8), NAN))


def test_a_failing_watch_leaves_the_other_inspectors_modules_watched(monkeypatch):
    from numguard.inspector import core, is_watched

    model = MLP()
    first = numguard.watch(model, **quiet())

    def broken(self, model):
        self._module_names[model] = ""  # got as far as naming the root
        raise RuntimeError("hooks could not be installed")

    monkeypatch.setattr(core.Inspector, "_install_hooks", broken)
    with pytest.raises(RuntimeError, match="could not be installed"):
        numguard.watch(model.a, **quiet())  # a part of the watched model (one model twice: an error)
    assert is_watched(model) and is_watched(model.a)
    first.close()
    assert not is_watched(model) and not is_watched(model.a)


# --- several threads -----------------------------------------------------------------------------
class Slow(nn.Module):
    def __init__(self, gate):
        super().__init__()
        self.gate = gate

    def forward(self, x):
        self.gate.wait(timeout=10)
        return x + 1


def test_concurrent_calls_from_threads_are_reported_once():
    gate = threading.Barrier(2)
    model = nn.Sequential(Slow(gate))
    insp = numguard.watch(model, **quiet())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        threads = [threading.Thread(target=model, args=(torch.ones(2),)) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    messages = [str(w.message) for w in caught if issubclass(w.category, InspectorWarning)]
    assert sum("several threads" in m for m in messages) == 1, messages
    insp.close(check=False)


# --- "raised before any weight is written" -------------------------------------------------------
class NaNGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * NAN


class GradBreaker(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 1)
        self.broken = False

    def forward(self, x):
        h = self.a(x)
        return self.b(NaNGrad.apply(h) if self.broken else h)


OPTIMIZERS = {
    "SGD": lambda p: torch.optim.SGD(p, lr=0.1),
    "Adam": lambda p: torch.optim.Adam(p, lr=0.1),
    "AdamW foreach": lambda p: torch.optim.AdamW(p, lr=0.1, foreach=True),
    "LBFGS": lambda p: torch.optim.LBFGS(p, lr=0.1, max_iter=3),
    "RMSprop": lambda p: torch.optim.RMSprop(p, lr=0.1),
}


@pytest.mark.parametrize("closure_style", ["positional", "keyword", "none"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_nan_gradient_raises_before_any_weight_is_written(name, closure_style):
    if name == "LBFGS" and closure_style == "none":
        pytest.skip("LBFGS needs a closure")
    model = GradBreaker()
    opt = OPTIMIZERS[name](model.parameters())
    x = torch.ones(3, 4)

    def closure():
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        return loss

    insp = numguard.watch(model, **quiet(backward=True))
    for step in range(3):
        model.broken = step == 2
        before = [p.detach().clone() for p in model.parameters()]
        try:
            if closure_style == "positional":
                opt.step(closure)
            elif closure_style == "keyword":
                opt.step(closure=closure)
            else:
                closure()
                opt.step()
        except numguard.NonFiniteError as exc:
            assert step == 2
            assert "grad" in " ".join(exc.labels), exc.labels
            break
    else:
        pytest.fail("the NaN gradient was never reported")
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p.detach(), b), "a weight was written after the NaN gradient"
        assert torch.isfinite(p).all()
    insp.close(check=False)


@pytest.mark.parametrize("options", [dict(check="async"), dict(check_every=2), dict(check="async", check_every=3)])
def test_modes_that_cannot_raise_before_the_step_say_so(options):
    model = GradBreaker()
    with pytest.warns(InspectorWarning, match="reaches the optimizer.*check='sync', check_every=1"):
        insp = numguard.watch(model, **quiet(backward=True, **options))
    insp.close(check=False)


def test_sync_backward_watch_gives_no_such_warning():
    model = GradBreaker()
    with warnings.catch_warnings():
        warnings.simplefilter("error", InspectorWarning)
        numguard.watch(model, **quiet(backward=True)).close(check=False)


# --- a NaN written through .data after the tensor was recorded ------------------------------------
class WritesThroughData(nn.Module):
    """Writes a NaN into a tensor a watched module already returned (and numguard recorded), in a
    way that does not move its version counter, then lets it reach the output unchanged."""

    def __init__(self, how, then_identity):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.keep = nn.Identity()
        self.how = how
        self.then_identity = then_identity
        self.bad = False

    def forward(self, x):
        y = self.keep(self.a(x))  # recorded twice: a's output, then keep's reused input/output
        if self.bad:
            if self.how == "data":
                y.data[0, 0] = NAN
            else:
                with torch.no_grad():
                    y.data.copy_(torch.full_like(y, NAN))
        return self.keep(y) if self.then_identity else y


@pytest.mark.parametrize("then_identity", [False, True], ids=["returned", "through_identity"])
@pytest.mark.parametrize("how", ["data", "no_grad_copy"])
def test_a_nan_written_through_data_that_reaches_the_output_is_reported(backend, how, then_identity):
    model = WritesThroughData(how, then_identity)
    with numguard.watch(model, **quiet()):
        model(torch.ones(2, 4))
        model.bad = True
        with pytest.raises(numguard.NonFiniteError) as info:
            model(torch.ones(2, 4))
    assert info.value.batch_number == 1
    assert "nan" in info.value.report


def test_recording_what_reaches_the_output_afresh_needs_no_host_sync(backend):
    model = WritesThroughData("data", then_identity=True)
    insp = numguard.watch(model, **quiet(check="async"))
    model(torch.ones(2, 4))
    with SyncCounter()() as counter:
        for _ in range(3):
            model(torch.ones(2, 4))
    insp.close()
    assert counter.numguard == 0, counter.where
