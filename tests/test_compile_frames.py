"""Module frames recorded inside compiled graphs: the record_at_cursor_ op (both backends, against
the float64 reference and record_), and watched compiled models (inductor on the CPU) whose report
names the first bad submodule exactly as eager mode does, with no graph break, no recompilation
per batch and no host sync of numguard's own."""
import contextlib
import io
import warnings

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

import numguard
from numguard import _torch_ops, schema
from numguard.errors import HeadroomWarning, InspectorWarning, NonFiniteWarning
from numguard.inspector import graph as _graph
from numguard.testing import SyncCounter

from test_compile_watch import fresh_dynamo  # noqa: F401 - autouse: dynamo and its counters reset per test
from test_kernels import (ALL_DTYPES, BACKENDS, INF, assert_records_equal, hostile_values, layout_cases, ops_for,
                          ordinary_values, reference_stats)

BASE = schema.GRAPH_POSITION_BASE


# ---------------------------------------------------------------------------------------------
# The op

def record_at_cursor(backend):
    if backend == "native":
        ops_for("native")  # skips without the extension
        return torch.ops.numguard.record_at_cursor_.default

    def fallback(ring, state, cursor, log, xs, slot, headroom):
        _torch_ops.record_at_cursor_(ring, state, cursor, log, xs, slot, headroom, numguard.ops.headroom_limits(xs))
    return fallback


def new_recording(rows=8, log_rows=4):
    ring, state = numguard.ops.new_ring(rows)
    cursor, log = numguard.ops.new_graph_cursor(log_rows)
    return ring, state, cursor, log


def hostile_frame():
    """Every recordable dtype's hostile values and a few layouts (non-contiguous, expanded,
    0-dim, empty, -0.0, subnormals, +-max)."""
    gen = torch.Generator().manual_seed(13)
    xs = []
    for dtype in ALL_DTYPES:
        xs.append(hostile_values(dtype))
        xs += list(layout_cases(dtype, gen).values())[:4]
    xs += [torch.tensor(-0.0), torch.empty(0, 3), torch.randn(5, 6, generator=gen).t(),
           torch.randn(3, 1, generator=gen).expand(3, 7)]
    return xs


@pytest.mark.parametrize("backend", BACKENDS)
def test_records_are_the_reference_and_match_record_(backend):
    op = record_at_cursor(backend)
    xs = hostile_frame()
    ring, state, cursor, log = new_recording(rows=len(xs) + 3)
    cursor[schema.CURSOR_BATCH] = 5
    op(ring, state, cursor, log, xs, 7, 0.5)
    start = BASE
    expected = torch.stack([reference_stats(x) for x in xs])
    rows = [(start + i) % ring.shape[0] for i in range(len(xs))]
    assert_records_equal(ring[rows], expected, "record_at_cursor_")
    # record_ at the same (host) position gives the same ring and state.
    ring2, state2 = numguard.ops.new_ring(len(xs) + 3)
    ops_for(backend).record_(ring2, state2, xs, start, 0.5)
    assert_records_equal(ring, ring2, "record_ at the same position")
    assert state.tolist() == state2.tolist()
    assert state.tolist()[0] == 1 and state.tolist()[1] >= BASE
    assert cursor.tolist() == [BASE + len(xs), 1, 5]
    assert log[0].tolist() == [7, BASE, 5]


@pytest.mark.parametrize("backend", BACKENDS)
def test_cursor_advances_logs_each_call_and_wraps(backend):
    op = record_at_cursor(backend)
    gen = torch.Generator().manual_seed(14)
    a, b = ordinary_values(torch.float32, 40, gen, clean=True), ordinary_values(torch.float16, 9, gen, clean=True)
    ring, state, cursor, log = new_recording(rows=4, log_rows=3)
    with SyncCounter()() as syncs:
        op(ring, state, cursor, log, [a, b], 0, 0.0)         # positions BASE, BASE+1
        cursor[schema.CURSOR_BATCH].fill_(1)
        op(ring, state, cursor, log, [b, a, b], 1, 0.0)      # BASE+2..BASE+4 (wraps)
        op(ring, state, cursor, log, [], 2, 0.0)             # no tensor: still a logged call
        op(ring, state, cursor, log, [a], 3, 0.0)            # BASE+5; log row 3 % 3 == 0
    assert syncs.total == 0
    ra, rb = reference_stats(a), reference_stats(b)
    want = {BASE + 2: rb, BASE + 3: ra, BASE + 4: rb, BASE + 5: ra}
    for position, record in want.items():
        assert_records_equal(ring[position % 4], record, f"position {position}")
    assert cursor.tolist() == [BASE + 6, 4, 1]
    assert log.tolist() == [[3, BASE + 5, 1], [1, BASE + 2, 1], [2, BASE + 5, 1]]
    assert state.tolist() == list(schema.STATE_INITIAL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_trip_freezes_ring_cursor_and_log(backend):
    op = record_at_cursor(backend)
    gen = torch.Generator().manual_seed(15)
    a = ordinary_values(torch.float32, 30, gen, clean=True)
    nan = a.clone()
    nan[3] = float("nan")
    inf = a.clone()
    inf[0] = -INF
    ring, state, cursor, log = new_recording(rows=8, log_rows=4)
    op(ring, state, cursor, log, [a], 0, 0.0)
    op(ring, state, cursor, log, [a, nan, inf], 1, 0.0)
    assert state.tolist() == [1, BASE + 2, 0, -1]
    frozen = [t.clone() for t in (ring, cursor, log)]
    op(ring, state, cursor, log, [inf, a], 2, 0.9)
    op(ring, state, cursor, log, [], 3, 0.0)
    assert all(torch.equal(x, y) for x, y in zip(frozen, (ring, cursor, log)))
    assert state.tolist() == [1, BASE + 2, 0, -1]
    assert cursor.tolist() == [BASE + 4, 2, 0]
    # An eager trip (record_ into the same state) freezes the graph ring too, and the reverse.
    ring, state, cursor, log = new_recording()
    ops_for(backend).record_(ring, state, [nan], 3, 0.0)
    op(ring, state, cursor, log, [a], 0, 0.0)
    assert cursor.tolist() == [BASE, 0, 0] and state.tolist() == [1, 3, 0, -1]


@pytest.mark.parametrize("backend", BACKENDS)
def test_headroom_flag_at_graph_positions(backend):
    op = record_at_cursor(backend)
    low = torch.tensor([1.0, -60000.0], dtype=torch.float16)  # 60000 > 0.9 * 65504
    big32 = torch.tensor([3e38])                               # fp32: never a headroom check
    ring, state, cursor, log = new_recording()
    op(ring, state, cursor, log, [big32, low], 0, 0.0)
    assert state.tolist() == list(schema.STATE_INITIAL)
    op(ring, state, cursor, log, [big32, low], 0, 0.9)
    assert state.tolist() == [0, -1, 1, BASE + 3]


@pytest.mark.parametrize("backend", BACKENDS)
def test_native_and_fallback_agree_over_many_calls(backend):
    if backend == "torch":
        pytest.skip("compares the two backends once")
    gen = torch.Generator().manual_seed(16)
    calls = []
    for step in range(10):
        dtype = [torch.float16, torch.bfloat16, torch.float32, torch.int8][step % 4]
        xs = [(ordinary_values(torch.float32, 20 + step, gen, clean=True) * 100).to(dtype)]
        if step == 6:
            xs.append(hostile_values(dtype))
        calls.append(xs)
    results = []
    for name in ("native", "torch"):
        op = record_at_cursor(name)
        ring, state, cursor, log = new_recording(rows=5, log_rows=3)
        for slot, xs in enumerate(calls):
            op(ring, state, cursor, log, xs, slot, 0.5)
        results.append((ring, state, cursor, log))
    for x, y in zip(*results):
        assert torch.equal(x, y)
    assert results[0][1][0].item() == 1


def test_bad_cursor_or_log_gives_a_clear_error():
    ops_for("native")
    ring, state = numguard.ops.new_ring(4)
    cursor, log = numguard.ops.new_graph_cursor(2)
    x = torch.ones(3)
    with pytest.raises(RuntimeError, match=r"cursor must be a contiguous int64\[3\]"):
        torch.ops.numguard.record_at_cursor_.default(ring, state, cursor[:2], log, [x], 0, 0.0)
    with pytest.raises(RuntimeError, match=r"log must be a contiguous int64\[L, 3\]"):
        torch.ops.numguard.record_at_cursor_.default(ring, state, cursor, log.float(), [x], 0, 0.0)
    with pytest.raises(ValueError, match="log_rows=0"):
        numguard.ops.new_graph_cursor(0)


def test_opcheck():
    ops_for("native")
    xs = [torch.randn(5), hostile_values(torch.float16), torch.empty(0)]
    ring, state = numguard.ops.new_ring(4)
    cursor, log = numguard.ops.new_graph_cursor(2)
    torch.library.opcheck(torch.ops.numguard.record_at_cursor_.default, (ring, state, cursor, log, xs, 3, 0.5))


# ---------------------------------------------------------------------------------------------
# Watched compiled models

class Planted(nn.Module):
    """Multiplies by NaN when told to (a bad activation inside the graph)."""

    def __init__(self):
        super().__init__()
        self.bad = False

    def forward(self, x):
        return x * float("nan") if self.bad else x


class Block(nn.Module):
    """A submodule with a keyword argument and a tuple output (the general frame path)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)

    def forward(self, x, scale=None):
        h = self.proj(x) * scale
        return self.norm(h), h


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.act = nn.ReLU()
        self.block = Block()
        self.planted = Planted()
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        h, _ = self.block(self.act(self.inp(x)), scale=torch.full((), 0.5))
        return self.out(self.planted(h))


def make_net():
    torch.manual_seed(0)
    return Net()


def run_with_nan(order, bad_batch=2, **watch_kwargs):
    """Run batches of a watched model (compiled per `order`), planting the NaN at `bad_batch`;
    returns (report text, error, inspector, model, what to call)."""
    model = make_net()
    text = io.StringIO()
    if order == "compile-then-watch":
        runner = torch.compile(model)
        inspector = numguard.watch(runner, report_to=text, **watch_kwargs)
    elif order == "watch-then-compile":
        inspector = numguard.watch(model, report_to=text, **watch_kwargs)
        runner = torch.compile(model)
    elif order == "Module.compile":
        inspector = numguard.watch(model, report_to=text, **watch_kwargs)
        model.compile()
        runner = model
    else:
        inspector = numguard.watch(model, report_to=text, **watch_kwargs)
        runner = model
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    error = None
    try:
        for batch in range(bad_batch + 1):
            model.planted.bad = batch == bad_batch
            runner(x)
    except numguard.NonFiniteError as exc:
        error = exc
    return text.getvalue(), error, inspector, model, runner


def module_lines(report):
    return [line for line in report.splitlines() if line.strip()]


@pytest.mark.parametrize("order", ["compile-then-watch", "watch-then-compile", "Module.compile"])
def test_report_of_a_nan_inside_the_graph_names_the_submodule_as_eager_does(order):
    eager, eager_error, eager_insp, _, _ = run_with_nan("eager")
    eager_insp.close(check=False)
    torch._dynamo.reset()
    compiled, error, inspector, _, _ = run_with_nan(order)
    inspector.close(check=False)
    assert error is not None and eager_error is not None
    assert error.module == eager_error.module == "planted"
    assert error.labels == eager_error.labels == ["output"]
    assert error.batch_number == eager_error.batch_number == 2
    assert str(error) == str(eager_error)
    if order == "compile-then-watch":
        # The whole report, byte for byte (the compiled model's frames carry the eager names).
        assert compiled == eager
    else:
        # The root's own hooks run outside the graph; the module frames are the same.
        assert module_lines(compiled)[-12:] == module_lines(eager)[-12:]
    assert "planted Planted" in compiled and "block.norm LayerNorm" in compiled
    assert "_orig_mod" not in compiled


@contextlib.contextmanager
def counting_host_reads():
    """SyncCounter's attribution of host reads, without its dispatch and function modes (under a
    mode, dynamo runs a compiled model's code eagerly instead): the Tensor methods that read a
    value back to the host are patched for the duration."""
    counter = SyncCounter()
    originals = {func: getattr(torch.Tensor, func.__name__) for func in SyncCounter.FUNCS}

    def counting(name, original):
        def read(*args, **kwargs):
            counter.event(name)
            return original(*args, **kwargs)
        return read

    try:
        for func, original in originals.items():
            setattr(torch.Tensor, func.__name__, counting(func.__name__, original))
        yield counter
    finally:
        for func, original in originals.items():
            setattr(torch.Tensor, func.__name__, original)


def test_compiled_once_no_graph_break_and_no_sync():
    model = make_net()
    compiled = torch.compile(model)
    x = torch.randn(4, 8)
    with numguard.watch(compiled, report_to=None) as inspector:
        compiled(x)
        graphs = counters["stats"]["unique_graphs"]
        with counting_host_reads() as syncs:
            for _ in range(4):
                compiled(x)
        assert inspector._graph.used
    # Compiled on the first batch only (the model's frame and its own hook's frame; no recompile).
    assert counters["stats"]["unique_graphs"] == graphs
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert syncs.in_hooks == 0, syncs.where
    # One read of the state per batch end, as without compile.
    assert syncs.numguard == 4, syncs.where
    # Every module call of every batch was recorded in the graph: the model's own and its 7
    # submodules' calls; the eager ring holds only the wrapper's (root) frames.
    assert inspector._graph.cursor[schema.CURSOR_CALLS].item() == 5 * 8
    assert {f.owner.cls for f in inspector._ring.frames} == {"OptimizedModule"}


def test_graph_frames_are_traced_once_and_log_their_batch():
    model = make_net()
    compiled = torch.compile(model)
    x = torch.randn(4, 8)
    with numguard.watch(compiled, report_to=None) as inspector:
        for _ in range(3):
            compiled(x)
        frames, _, _ = inspector._graph.logged_frames(0)
    names = [f.owner.name for f in frames]
    per_batch = ["inp", "act", "block.proj", "block.norm", "block", "planted", "out", ""]
    assert names == per_batch * 3
    assert [f.batch for f in frames] == [b for b in range(3) for _ in per_batch]
    block = frames[4]
    assert block.labels == ["input[0]", "kwargs.scale", "output[0]", "output[1]"]
    assert block.shapes == [(4, 16), (), (4, 16), (4, 16)]
    assert block.dtypes == [torch.float32] * 4


def test_training_step_records_graph_frames_and_checks_before_the_step():
    model = make_net()
    compiled = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(4, 8)
    with numguard.watch(compiled, backward=True, report_to=None) as inspector:
        for _ in range(3):
            compiled(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        graphs = counters["stats"]["unique_graphs"]
        model.planted.bad = True
        with pytest.raises(numguard.NonFiniteError) as info:
            loss = compiled(x).square().mean()
            loss.backward()
            opt.step()
    assert info.value.module == "planted"
    assert graphs == 2  # the forward once, the planted NaN's branch once more (the model's own code changed)
    assert sum(counters["graph_break"].values()) == 0


def test_weight_nan_trips_at_the_first_module_that_uses_it():
    model = make_net()
    compiled = torch.compile(model)
    x = torch.randn(4, 8)
    with numguard.watch(compiled, report_to=None):
        compiled(x)
        with torch.no_grad():
            model.block.proj.weight[0, 0] = float("nan")
        with pytest.raises(numguard.NonFiniteError) as info:
            compiled(x)
    assert info.value.module == "block.proj"


def test_warned_trip_forgets_the_frames_before_it():
    eager, _, eager_insp, eager_model, eager_runner = run_with_nan("eager", on_trip="warn")
    torch._dynamo.reset()
    with pytest.warns(NonFiniteWarning):
        compiled, _, inspector, model, runner = run_with_nan("compile-then-watch", on_trip="warn")
    assert compiled == eager
    # Two more batches, the second bad: the report starts after the first trip, as in eager mode.
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    reports = []
    for insp, m, run in ((eager_insp, eager_model, eager_runner), (inspector, model, runner)):
        insp.report_to = io.StringIO()
        with pytest.warns(NonFiniteWarning):
            for bad in (False, True):
                m.planted.bad = bad
                run(x)
        reports.append(insp.report_to.getvalue())
        insp.close(check=False)
    assert reports[0] == reports[1]
    assert "batch number=2" not in reports[1]


def test_trace_of_a_compiled_batch_shows_its_graph_frames():
    outputs = []
    for compiled in (False, True):
        torch._dynamo.reset()
        model = make_net()
        runner = torch.compile(model) if compiled else model
        text = io.StringIO()
        with numguard.watch(runner, report_to=text, trace_batch_nums=[1]):
            for _ in range(3):
                runner(torch.ones(2, 8))
        outputs.append(text.getvalue())
    assert outputs[0] == outputs[1]
    assert "block.norm LayerNorm" in outputs[1]


def test_pure_torch_backend_records_inside_the_graph(monkeypatch):
    monkeypatch.setattr(numguard.ops, "_native", None)
    eager, eager_error, eager_insp, _, _ = run_with_nan("eager")
    eager_insp.close(check=False)
    torch._dynamo.reset()
    compiled, error, inspector, _, _ = run_with_nan("compile-then-watch")
    inspector.close(check=False)
    assert error.module == "planted" and compiled == eager
    assert sum(counters["graph_break"].values()) == 0


def test_slot_metadata_is_registered_once_per_layout():
    model = make_net()
    compiled = torch.compile(model)
    before = len(_graph._slots)
    with numguard.watch(compiled, report_to=None):
        for _ in range(3):
            compiled(torch.randn(4, 8))
    assert len(_graph._slots) - before == 8


class Loud(nn.Module):
    """Returns float16 values at 92% of float16's largest finite value."""

    def forward(self, x):
        return (x * 0 + 60000.0).half()


def test_headroom_inside_the_graph_warns_once_naming_the_module():
    model = nn.Sequential(nn.Linear(8, 8), Loud())
    compiled = torch.compile(model)
    x = torch.randn(2, 8)
    with numguard.watch(compiled, headroom=0.5, report_to=None):
        with pytest.warns(HeadroomWarning) as caught:
            compiled(x)
        messages = [str(w.message) for w in caught if issubclass(w.category, HeadroomWarning)]
        assert messages[0].startswith("numguard: 1 (Loud) output reached abs max 6e+04, 92% of float16's")
        graphs = counters["stats"]["unique_graphs"]
        with warnings.catch_warnings():
            warnings.simplefilter("error", HeadroomWarning)  # a module warns once
            compiled(x)
            compiled(x)
    # The module that warned records without a headroom check from then on: traced once more.
    assert counters["stats"]["unique_graphs"] <= graphs + 1


def test_transformers_gpt2_compiled_report_equals_eager():
    transformers = pytest.importorskip("transformers")
    reports = []
    for compiled in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(0)
        cfg = transformers.GPT2Config(vocab_size=64, n_embd=16, n_layer=2, n_head=2, n_positions=16,
                                      bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(cfg).eval()
        runner = torch.compile(model) if compiled else model
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(3))
        text = io.StringIO()
        with numguard.watch(runner, report_to=text):
            with torch.no_grad():
                runner(ids)
                model.transformer.h[1].mlp.c_proj.weight[0, 0] = float("nan")
                with pytest.raises(numguard.NonFiniteError) as info:
                    runner(ids)
        reports.append((text.getvalue(), info.value.module, info.value.labels))
    assert reports[1][1] == reports[0][1] == "transformer.h.1.mlp.c_proj"
    assert reports[1][2] == reports[0][2]
    # Inductor's fused arithmetic may differ from eager's in the last printed digit: the module,
    # label and batch lines (the text after the two value columns) are identical, byte for byte.
    eager_lines, compiled_lines = ([line[18:] for line in r[0].splitlines()] for r in reports)
    assert compiled_lines == eager_lines
    assert len(eager_lines) > 80


def test_dynamic_shapes_record_without_graph_break_or_recompile_per_size():
    model = make_net()
    compiled = torch.compile(model)  # automatic dynamic shapes: recompiled once, dynamic, on a new size
    with numguard.watch(compiled, report_to=None) as inspector:
        for n in (3, 5, 7, 9):
            compiled(torch.randn(n, 8))
        graphs = counters["stats"]["unique_graphs"]
        compiled(torch.randn(11, 8))
        assert counters["stats"]["unique_graphs"] == graphs
        frames, _, _ = inspector._graph.logged_frames(0)
        model.planted.bad = True  # changes the model's own code path: traced once more
        with pytest.raises(numguard.NonFiniteError) as info:
            compiled(torch.randn(6, 8))
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert info.value.module == "planted"
    assert [f.owner.name for f in frames[-8:]] == ["inp", "act", "block.proj", "block.norm", "block", "planted",
                                                   "out", ""]
    assert frames[-8].shapes == [(-1, 8), (-1, 16)]  # the batch dimension is dynamic in the graph


def test_a_model_compiled_before_watch_is_named_in_a_warning():
    model = make_net()
    compiled = torch.compile(model)
    x = torch.randn(4, 8)
    compiled(x)  # compiled without numguard's hooks: dynamo reuses this code after watch()
    with numguard.watch(compiled, report_to=None):
        with pytest.warns(InspectorWarning, match="compiled before watch"):
            compiled(x)
    torch._dynamo.reset()
    with numguard.watch(compiled, report_to=None):
        with warnings.catch_warnings():
            warnings.simplefilter("error", InspectorWarning)
            compiled(x)


COMPILED_BEFORE_WATCH = ["torch.compile", "Module.compile", "submodule torch.compile", "submodule Module.compile"]


def _compile_as(how, model):
    """Compile `model` (or its block) as `how` says; returns what to call."""
    if how == "torch.compile":
        return torch.compile(model)
    if how == "Module.compile":
        model.compile()
    elif how == "submodule torch.compile":
        model.block = torch.compile(model.block)
    else:
        model.block.compile()
    return model


@pytest.mark.parametrize("how", COMPILED_BEFORE_WATCH)
def test_a_trip_in_the_first_batch_of_a_model_compiled_before_watch_names_the_missing_frames(how):
    """Compiled and run before watch(): the first watched batch trips (a NaN input, which does not
    recompile) and the warning naming the frames that were not recorded comes before the report."""
    model = make_net()
    runner = _compile_as(how, model)
    x = torch.randn(4, 8)
    runner(x)  # compiled without numguard's hooks: dynamo reuses this code after watch()
    x[0, 0] = float("nan")
    warned_at_report = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        inspector = numguard.watch(runner, report_to=lambda text: warned_at_report.append(
            [str(w.message) for w in caught if issubclass(w.category, InspectorWarning)]))
        with pytest.raises(numguard.NonFiniteError):
            runner(x)
    inspector.close(check=False)
    (said,) = warned_at_report[0]
    assert "compiled before watch" in said and "torch._dynamo.reset() before watch()" in said
    assert "block.proj, block.norm" in said and "_orig_mod" not in said
    assert ("the compiled model: inp, act, block, block.proj" in said) == (not how.startswith("submodule"))


@pytest.mark.parametrize("how", COMPILED_BEFORE_WATCH)
def test_a_model_compiled_after_watch_is_silent(how):
    model = make_net()
    with warnings.catch_warnings():
        warnings.simplefilter("error", InspectorWarning)
        if how == "torch.compile":
            runner = _compile_as(how, model)
            inspector = numguard.watch(runner, report_to=None)
        else:
            inspector = numguard.watch(model, report_to=None)
            runner = _compile_as(how, model)
        for _ in range(2):
            runner(torch.randn(4, 8))
    frames = {f.owner.name for f in inspector._graph.logged_frames(0)[0]}
    inspector.close()
    assert "block.proj" in frames or "block._orig_mod.proj" in frames
