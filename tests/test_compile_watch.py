"""numguard.watch with torch.compile (inductor on the CPU): detection works, numguard causes no
graph break from a host read of its own, and a watched model is compiled once, not per batch."""
import gc
import warnings
import weakref

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

import numguard

SYNC_WORDS = ("_local_scalar_dense", "Data dependent", "item()", "tolist")


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def plant_nan(model):
    with torch.no_grad():
        model[2].weight[0, 0] = float("nan")


def test_watching_a_compiled_model_detects_and_compiles_once():
    model = make_model()
    compiled = torch.compile(model, backend="inductor")
    x = torch.randn(4, 8)
    with numguard.watch(compiled, report_to=None) as insp:
        for _ in range(4):
            compiled(x)
        graphs = counters["stats"]["unique_graphs"]
        assert graphs == 1
        assert insp.batch_number == 3
        plant_nan(model)
        with pytest.raises(numguard.NonFiniteError) as info:
            compiled(x)
    assert info.value.batch_number == 4
    assert "output" in info.value.labels
    assert counters["stats"]["unique_graphs"] == graphs  # no recompilation per batch


def test_compiling_a_watched_model_breaks_no_graph_for_a_host_read():
    model = make_model()
    x = torch.randn(4, 8)
    with numguard.watch(model, report_to=None):
        explanation = torch._dynamo.explain(model)(x)
    reasons = [r.reason for r in explanation.break_reasons]
    assert not any(word in reason for reason in reasons for word in SYNC_WORDS), reasons


def test_compiled_watched_model_detects():
    model = make_model()
    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    x = torch.randn(4, 8)
    with numguard.watch(model, report_to=None):
        compiled = torch.compile(model, backend=counting_backend)
        for _ in range(3):
            compiled(x)
        compiled_graphs = len(graphs)
        plant_nan(model)
        with pytest.raises(numguard.NonFiniteError) as info:
            compiled(x)
    assert info.value.batch_number == 3
    assert len(graphs) == compiled_graphs  # planting a NaN did not recompile anything
    # numguard's ops did not land inside the user's graphs as host reads
    for gm in graphs:
        targets = {str(node.target) for node in gm.graph.nodes}
        assert not any("_local_scalar_dense" in t or "item" == t for t in targets), targets


def test_compiled_model_backward_gradients_checked_before_the_step():
    model = make_model()
    compiled = torch.compile(model, backend="inductor")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8)
    with numguard.watch(compiled, backward=True, report_to=None):
        loss = compiled(x).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss = compiled(x).sum()
        loss.backward()
        model[2].weight.grad[0, 0] = float("inf")  # a bad gradient the forward never saw
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(numguard.NonFiniteError) as info:
            opt.step()
    assert info.value.labels == ["2.weight.grad"]  # the eager name, as the graph frames show it
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


class LogOfShift(nn.Module):
    def forward(self, x):
        return torch.log(x - 1000.0)


def make_log_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), LogOfShift())


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_replay_under_compile_breaks_no_graph_and_says_it_is_not_available(backend):
    import warnings

    model = make_log_model()
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(4, 8)
    with numguard.watch(compiled, replay=True, report_to=None) as insp:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with pytest.raises(numguard.NonFiniteError) as info:
                compiled(x)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert info.value.module == "2"
    replayed = insp.last_report["replay"]
    assert replayed["module"] == "2" and replayed["class"] == "LogOfShift"
    assert replayed["reproduced"] is False and "not available" in replayed["reason"]
    assert "numguard: could not replay 2 (LogOfShift): replay is not available for modules of a compiled model" \
        in info.value.report
    messages = [str(w.message) for w in caught if issubclass(w.category, numguard.errors.InspectorWarning)]
    assert any("replay is not available for modules of a compiled model" in m for m in messages), messages
    assert not any("could not add" in m for m in messages), messages   # no internal error


def test_replay_breaks_no_graph_of_a_model_compiled_after_watch():
    model = make_model()
    x = torch.randn(4, 8)
    with numguard.watch(model, replay=True, report_to=None) as insp:
        explanation = torch._dynamo.explain(model)(x)
        assert insp.replay is True
    assert explanation.graph_break_count == 0, [r.reason for r in explanation.break_reasons]


@pytest.mark.parametrize("when", ["compiled before watch", "compiled after watch", "compiled after eager batches"])
def test_quant_and_spikes_under_compile_say_once_what_they_cannot_see(when):
    import warnings

    from numguard.errors import InspectorWarning

    model = make_model()
    x = torch.randn(4, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if when == "compiled before watch":
            compiled = torch.compile(model, backend="eager")
            insp = numguard.watch(compiled, report_to=None, quant="float8_e4m3fn", spikes=True)
        else:
            insp = numguard.watch(model, report_to=None, quant="float8_e4m3fn", spikes=True)
            if when == "compiled after eager batches":   # looked at, nothing compiled: asked again later
                for _ in range(2):
                    model(x)
                assert not [w for w in caught if issubclass(w.category, InspectorWarning)]
            compiled = torch.compile(model, backend="eager")
        with insp:
            for _ in range(3):
                compiled(x)
            rows = {r["module"] for r in insp.quant_table()}
    ours = [str(w.message) for w in caught if issubclass(w.category, InspectorWarning)]
    quant = [m for m in ours if m.startswith("numguard: quant= under torch.compile")]
    spikes = [m for m in ours if m.startswith("numguard: spikes= under torch.compile")]
    assert len(quant) == 1 and len(spikes) == 1, ours  # once each, over three batches
    assert "'0', '1', '2' run inside compiled graphs" in quant[0] and "no row in quant_table()" in quant[0]
    assert "named at the compiled module's output" in spikes[0]
    if when != "compiled after eager batches":   # (which measured them before)
        assert not rows & {"0", "1", "2"}  # what the warning says: no rows for them
    if when == "compiled before watch":  # (after: the root's own hooks run outside the graph, by design)
        assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])


def test_quant_and_spikes_on_an_eager_model_say_nothing_of_compile():
    import warnings

    model = make_model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with numguard.watch(model, report_to=None, quant="float8_e4m3fn", spikes=True) as insp:
            for _ in range(3):
                model(torch.randn(4, 8))
            assert {"0", "1", "2"} <= {r["module"] for r in insp.quant_table()}
    assert not [w for w in caught if "torch.compile" in str(w.message)]


def test_the_wrappers_of_a_model_are_found_from_the_model():
    # NOTE: [wrappers compiled before watch]: found through the model's referrers, not by walking
    # every object; each wrapper of this model, alive, and none of another model's.
    from numguard.inspector.graph import compiled_wrappers

    model, other = make_model(), make_model()
    first, second, elsewhere = torch.compile(model), torch.compile(model), torch.compile(other)
    first(torch.randn(2, 8))
    assert vars(first) and vars(second)   # with their __dict__ made, and
    third = torch.compile(model)          # one without it (Python may keep its attributes inline)
    found = compiled_wrappers(model)
    assert len(found) == 3 and {id(w) for w in found} == {id(first), id(second), id(third)}
    assert [id(w) for w in compiled_wrappers(other)] == [id(elsewhere)]
    refs = [weakref.ref(second), weakref.ref(third)]
    del second, third
    gc.collect()   # a wrapper lives in reference cycles (dynamo may keep one alive a while longer)
    alive = {id(first)} | {id(r()) for r in refs if r() is not None}
    assert {id(w) for w in compiled_wrappers(model)} == alive
    assert compiled_wrappers(make_model()) == []


@pytest.mark.parametrize("called_before_watch", [True, False])
def test_a_wrapper_compiled_before_watching_its_model_is_named_at_its_first_call(called_before_watch):
    # NOTE: [wrappers compiled before watch]: watch(model) after torch.compile(model) ran: calls
    # through that wrapper bypass numguard's hooks; numguard says so at once instead of staying silent.
    torch.compile(nn.Linear(2, 2))(torch.randn(1, 2))   # dynamo has compiled something
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    compiled = torch.compile(model)
    if called_before_watch:
        compiled(torch.randn(2, 4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        insp = numguard.watch(model, report_to=None)
        compiled(torch.randn(2, 4))
        compiled(torch.randn(2, 4))
    said = [w for w in caught if "compiled before watch() added numguard's hooks" in str(w.message)]
    if called_before_watch:
        assert len(said) == 1 and "is NOT watched" in str(said[0].message)
    else:   # the wrapper's first call traced numguard's hooks: watched, and silent
        assert caught == [] and insp.batches_finished == 2
        with torch.no_grad():
            model[0].bias.fill_(float("inf"))
        with pytest.raises(numguard.NonFiniteError):
            compiled(torch.randn(2, 4))
    insp.close(check=False)


def test_a_wrapper_made_after_watch_that_reuses_code_compiled_before_it_is_named():
    # NOTE: [wrappers compiled before watch]: dynamo keeps the code a wrapper compiled with the
    # model, so a new wrapper made after watch() (the first one deleted) runs it without numguard's
    # hooks: a NaN in that call was missed with no word. The new wrapper is hooked as it is made.
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    first = torch.compile(model, backend="eager")
    first(torch.randn(2, 4))
    del first
    gc.collect()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        insp = numguard.watch(model, report_to=None)
        again = torch.compile(model, backend="eager")
        again(torch.randn(2, 4))
        again(torch.randn(2, 4))
        said = [w for w in caught if "compiled before watch() added numguard's hooks" in str(w.message)]
        if insp.batches_finished == 0:   # the new wrapper ran the old code: said, once
            assert len(said) == 1 and "is NOT watched" in str(said[0].message), [str(w.message) for w in caught]
        else:   # dynamo recompiled with the hooks: watched, and nothing said
            assert said == [] and insp.batches_finished == 2
    insp.close(check=False)


def test_a_wrapper_numguard_cannot_hook_is_said_and_compiles(monkeypatch):
    # numguard's failure to hook a new wrapper does not fail torch.compile, and is not silent
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    torch.compile(model, backend="eager")(torch.randn(2, 4))   # dynamo has compiled something
    insp = numguard.watch(model, report_to=None)
    from numguard.inspector import graph

    def broken(*args):
        raise RuntimeError("hooks refused")
    monkeypatch.setattr(graph, "_hook_wrapper", broken)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again = torch.compile(model, backend="eager")
    said = [str(w.message) for w in caught if "could not hook this torch.compile wrapper" in str(w.message)]
    assert len(said) == 1 and "hooks refused" in said[0], [str(w.message) for w in caught]
    assert again(torch.randn(2, 4)).shape == (2, 4)
    insp.close(check=False)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
@pytest.mark.parametrize("how", ["torch.compile(model)", "model.compile()"])
def test_rerun_of_a_compiled_model_gives_its_verdict(backend, how):
    # The report of a compiled model indexes frames merged with the graphs'; the rerun read the
    # eager ring at that index (IndexError: the verdict was lost, an internal warning said so).
    model = make_log_model()
    x = torch.randn(4, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with numguard.watch(model, rerun=True, report_to=None) as insp:
            compiled = torch.compile(model, backend=backend) if how == "torch.compile(model)" else model
            if how == "model.compile()":
                model.compile(backend=backend)
            with pytest.raises(numguard.NonFiniteError) as info:
                compiled(x)
    assert info.value.module == "2"
    assert [str(w.message) for w in caught if issubclass(w.category, numguard.errors.InspectorWarning)] == []
    rerun = insp.last_report["rerun"]
    assert rerun["verdict"] == "reproducible" and rerun["module"] == "2", rerun
    assert info.value.attribution is not None and info.value.attribution.verdict == "reproducible"


@pytest.mark.parametrize("how", ["torch.compile(model)", "model.compile()"])
def test_quant_of_a_model_compiled_after_watch_measures_the_root_as_it_says(how):
    # The warning says a compiled module's own output is measured; the root's quant hook ran inside
    # the graph (skipped there), so the table was empty.
    model = make_model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with numguard.watch(model, report_to=None, quant="float8_e4m3fn") as insp:
            compiled = torch.compile(model, backend="eager") if how == "torch.compile(model)" else model
            if how == "model.compile()":
                model.compile(backend="eager")
            for _ in range(3):
                compiled(torch.randn(4, 8))
            rows = insp.quant_table()
    (said,) = [str(w.message) for w in caught if "quant= under torch.compile" in str(w.message)]
    assert "only a compiled module's own output is measured" in said
    assert [(r["module"], r["quantity"]) for r in rows] == [("", "output")], rows
    assert rows[0]["batches"] == 3, rows[0]
