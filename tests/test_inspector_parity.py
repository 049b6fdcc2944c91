"""numguard's report and trace lines equal those of Transformers' DebugUnderflowOverflow on the
same random-init models and inputs (fp16 and bf16, GPT-2 and T5), on both backends."""
import pytest
import torch

import numguard
from inspector_helpers import hf_vs_numguard, make_overflow, tiny_gpt2, tiny_t5

pytestmark = pytest.mark.filterwarnings("ignore")


def gpt2_batches(n=2):
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(3))
    return [lambda m: m(ids)] * n


def t5_batches(n=2):
    ids = torch.randint(2, 64, (2, 8), generator=torch.Generator().manual_seed(3))
    return [lambda m: m(input_ids=ids, labels=ids)] * n


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpt2_report_equals_transformers(backend, dtype):
    model = tiny_gpt2(dtype)
    make_overflow(model.transformer.h[1].mlp.c_fc.weight, dtype)
    hf_out, hf_err, ng_out, ng_err = hf_vs_numguard(model, gpt2_batches())
    assert hf_err is not None and "inf/nan" in str(hf_err)
    assert isinstance(ng_err, numguard.NonFiniteError) and isinstance(ng_err, ValueError)
    assert "Detected inf/nan during batch_number=0" in hf_out
    assert ng_out == hf_out
    assert ng_err.module == "transformer.h.1.mlp.c_fc"
    assert ng_err.batch_number == 0
    assert "output" in ng_err.labels
    assert ng_err.rank is None
    assert ng_err.report.strip("\n") == ng_out.strip("\n")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_t5_report_equals_transformers(backend, dtype):
    model = tiny_t5(dtype)
    make_overflow(model.decoder.block[0].layer[2].DenseReluDense.wi.weight, dtype)
    hf_out, hf_err, ng_out, ng_err = hf_vs_numguard(model, t5_batches())
    assert hf_err is not None
    assert isinstance(ng_err, numguard.NonFiniteError)
    assert ng_out == hf_out
    assert ng_err.module == "decoder.block.0.layer.2.DenseReluDense.wi"


def test_report_in_second_batch_spans_batches(backend):
    """The trip happens in batch 1 early enough that the saved frames reach back into batch 0
    (with the "Starting batch number" lines and batch 0's weight stats)."""
    dtype = torch.float16
    model = tiny_gpt2(dtype)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(3))

    def healthy(m):
        m(ids)

    def poison(m):
        make_overflow(m.transformer.h[0].attn.c_attn.weight, dtype)
        m(ids)

    hf_out, hf_err, ng_out, ng_err = hf_vs_numguard(model, [healthy, poison])
    assert "Starting batch number=1" in hf_out and "Detected inf/nan during batch_number=1" in hf_out
    assert ng_out == hf_out
    assert ng_err.batch_number == 1


def test_nonfinite_weight_trips_at_first_frame_that_uses_it(backend):
    """A NaN in an embedding row that the batch never looks up: the output is finite, but
    Transformers trips at the embedding's frame because of its weight; so does numguard."""
    model = tiny_gpt2(torch.float32)
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        model.transformer.wte.weight[63, 0] = float("nan")
    hf_out, hf_err, ng_out, ng_err = hf_vs_numguard(model, [lambda m: m(ids)])
    assert hf_err is not None
    assert ng_out == hf_out
    assert ng_err.module == "transformer.wte"
    assert ng_err.labels == ["weight"]


def test_trace_equals_transformers(backend):
    model = tiny_gpt2(torch.float16)
    hf_out, hf_err, ng_out, ng_err = hf_vs_numguard(model, gpt2_batches(4), {"trace_batch_nums": [1, 3]},
                                                    {"trace_batch_nums": [1, 3]})
    assert hf_err is None and ng_err is None
    assert "*** Starting batch number=1 ***" in hf_out and "*** Starting batch number=3 ***" in hf_out
    assert ng_out == hf_out


def test_trace_then_trip_in_later_batch(backend):
    """A trace of batch 0 then a trip in batch 1: the report does not reach back into the traced
    batch (as in Transformers)."""
    dtype = torch.float16
    model = tiny_gpt2(dtype)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(3))

    def poison(m):
        make_overflow(m.transformer.h[0].mlp.c_fc.weight, dtype)
        m(ids)

    hf_out, hf_err, ng_out, ng_err = hf_vs_numguard(model, [lambda m: m(ids), poison],
                                                    {"trace_batch_nums": [0]}, {"trace_batch_nums": [0]})
    assert hf_err is not None and ng_err is not None
    assert ng_out == hf_out


def test_abort_after_batch(backend):
    model = tiny_gpt2(torch.float32)
    hf_out, hf_err, ng_out, ng_err = hf_vs_numguard(model, gpt2_batches(5), {"abort_after_batch_num": 2},
                                                    {"abort_after_batch_num": 2})
    assert "aborting after 3 batches" in str(hf_err)
    assert isinstance(ng_err, ValueError)
    assert "batch_number=2" in str(ng_err) and "3 batches" in str(ng_err)
    assert "abort_after_batch_num=2" in str(ng_err)
    assert ng_out == hf_out == ""


def test_extras_add_lines_but_keep_transformers_lines(backend):
    """With extras on (the default) every Transformers line is still there, in order; numguard's
    own lines (keyword inputs, ModelOutput contents, summary, headroom) come in addition."""
    dtype = torch.float16
    model = tiny_gpt2(dtype)
    make_overflow(model.transformer.h[1].mlp.c_fc.weight, dtype)
    hf_out, _, plain, _ = hf_vs_numguard(model, gpt2_batches())
    from inspector_helpers import clear_hooks, run_batches
    clear_hooks(model)
    out, err, insp = run_batches(model, lambda m: numguard.watch(m), gpt2_batches())
    insp.close(check=False)
    lines = out.splitlines()
    it = iter(lines)
    assert all(any(line == other for other in it) for line in hf_out.splitlines())
    assert "kwargs.position_ids" in out
    assert "numguard: first non-finite value in transformer.h.1.mlp.c_fc" in out
    assert len(lines) > len(hf_out.splitlines())


def test_drop_in_class_has_transformers_signature():
    import inspect
    from transformers.debug_utils import DebugUnderflowOverflow as HF
    ours = inspect.signature(numguard.DebugUnderflowOverflow.__init__).parameters
    theirs = inspect.signature(HF.__init__).parameters
    positional = [n for n, p in ours.items() if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert positional == list(theirs)
    assert all(ours[n].default == theirs[n].default for n in theirs if n != "self")
    # numguard's extras are keyword-only options, off by default.
    assert all(p.kind in (p.KEYWORD_ONLY, p.VAR_KEYWORD) for n, p in ours.items() if n not in theirs)


def _poisoned(name):
    if name.startswith("t5"):
        model = tiny_t5(torch.float16)
        make_overflow(model.decoder.block[0].layer[2].DenseReluDense.wi.weight, torch.float16)
        return model, t5_batches(3)
    dtype = torch.bfloat16 if "bf16" in name else torch.float16
    model = tiny_gpt2(dtype)
    batches = gpt2_batches(5)
    if "traced before" in name:  # the overflow comes in batch 2, after the traced batch 0
        batches[2] = lambda m, run=batches[2]: make_overflow(m.transformer.h[1].mlp.c_fc.weight, dtype) or run(m)
    elif "healthy" not in name:
        make_overflow(model.transformer.h[1].mlp.c_fc.weight, dtype)
    return model, batches


DROP_IN_SCENARIOS = {
    "gpt2 fp16 overflow": {},
    "gpt2 bf16 overflow": {},
    "t5 fp16 overflow": {},
    "gpt2 fp16 overflow, traced before": {"trace_batch_nums": [0]},
    "gpt2 healthy": {},
    "gpt2 healthy, traced 1 and 3": {"trace_batch_nums": [1, 3]},
    "gpt2 healthy, abort after 2": {"abort_after_batch_num": 2},
    "gpt2 healthy, 3 frames": {"max_frames_to_save": 3},
}


@pytest.mark.parametrize("scenario", sorted(DROP_IN_SCENARIOS))
def test_drop_in_prints_raises_and_counts_like_transformers(backend, scenario):
    """numguard.DebugUnderflowOverflow against Transformers' class on the same model and inputs:
    every printed line, the exception's type and text, and the public attributes."""
    import copy
    from transformers.debug_utils import DebugUnderflowOverflow as HF
    from inspector_helpers import run_batches
    model, batches = _poisoned(scenario)
    kwargs = DROP_IN_SCENARIOS[scenario]
    hf_out, hf_err, hf = run_batches(copy.deepcopy(model), lambda m: HF(m, **kwargs), batches)
    ng_out, ng_err, ng = run_batches(copy.deepcopy(model), lambda m: numguard.DebugUnderflowOverflow(m, **kwargs),
                                     batches)
    if "traced before" in scenario:
        # Known difference: after a traced batch Transformers' frame buffer loses its size limit,
        # so its next report lists every frame since the trace; numguard's lists the last
        # max_frames_to_save of them, exactly as Transformers prints those.
        head, _, tail = ng_out.partition("Last 21 forward frames:\nabs min  abs max  metadata\n")
        assert tail and hf_out.startswith(head) and hf_out.endswith(tail)
    else:
        assert ng_out == hf_out
    assert (type(hf_err) is None) == (type(ng_err) is None)
    if hf_err is not None:
        assert isinstance(ng_err, ValueError) and str(ng_err) == str(hf_err)
    assert ng.batch_number == hf.batch_number
    assert ng.detected_overflow == hf.detected_overflow
    assert ng.total_calls == hf.total_calls
    if not kwargs.get("trace_batch_nums"):
        # After a traced batch Transformers' buffer becomes an unbounded list (every frame since the
        # trace); numguard keeps max_frames_to_save (see DebugUnderflowOverflow's docstring).
        assert list(ng.frames) == list(hf.frames)
    assert ng.prefix == hf.prefix
    assert ng.trace_batch_nums == hf.trace_batch_nums
    assert ng.abort_after_batch_num == hf.abort_after_batch_num
    assert ng.model is not None
    ng.close(check=False)


def test_drop_in_extras_are_options():
    model, batches = _poisoned("gpt2 fp16 overflow")
    from inspector_helpers import run_batches
    plain, _, d1 = run_batches(model, lambda m: numguard.DebugUnderflowOverflow(m), batches)
    d1.close(check=False)
    model, batches = _poisoned("gpt2 fp16 overflow")
    extra, _, d2 = run_batches(model, lambda m: numguard.DebugUnderflowOverflow(m, extras=True), batches)
    d2.close(check=False)
    assert "numguard: first non-finite value" not in plain
    assert "numguard: first non-finite value" in extra




class _Scaled(torch.nn.Module):
    """Transformers' documented recipe: detect_overflow(x, "after ...") inside a forward. Its
    Linear's output is scaled past float32's range, checked, then passed on."""

    def __init__(self, detect, seen):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.act = torch.nn.ReLU()
        self.detect, self.seen = detect, seen

    def forward(self, x):
        y = self.lin(x) * 1e39
        self.seen.append(self.detect(y, "after lin"))
        return self.act(y)


class _WithDetect(torch.nn.Module):
    def __init__(self, detect, seen):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = _Scaled(detect, seen)
        self.c = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.c(self.b(self.a(x)))


@pytest.mark.parametrize("detector", ["drop-in", "watch"])
def test_detect_overflow_inside_a_watched_forward_is_transformers(backend, detector):
    """detect_overflow inside the forward prints its lines and returns True at once, and the
    report ends with the module frame that holds the Inf, byte for byte as Transformers'."""
    from transformers.debug_utils import DebugUnderflowOverflow as HF
    from transformers.debug_utils import detect_overflow as hf_detect
    from inspector_helpers import run_batches

    def run(detect, make_detector):
        torch.manual_seed(0)
        seen = []
        model = _WithDetect(detect, seen)
        x = torch.randn(2, 4)
        out, err, insp = run_batches(model, make_detector, [lambda m: m(x)])
        return out, err, seen, insp

    hf_out, hf_err, hf_seen, _ = run(hf_detect, HF)
    make = (numguard.DebugUnderflowOverflow if detector == "drop-in"
            else lambda m: numguard.watch(m, extras=False))
    ng_out, ng_err, ng_seen, insp = run(numguard.detect_overflow, make)
    insp.close(check=False)
    assert hf_out.startswith("after lin has infs\n") and "b.act ReLU" in hf_out
    assert ng_out == hf_out
    assert ng_seen == hf_seen == [True]
    assert ng_err.module == "b.act"
    if detector == "drop-in":
        assert str(ng_err) == str(hf_err)


def test_detect_overflow_is_a_report_line_with_extras_and_trips_nothing_by_itself(backend):
    torch.manual_seed(0)
    seen = []
    model = _WithDetect(numguard.detect_overflow, seen)
    x = torch.randn(2, 4)
    from inspector_helpers import run_batches
    out, err, insp = run_batches(model, lambda m: numguard.watch(m), [lambda m: m(x)])
    insp.close(check=False)
    assert seen == [True] and err.module == "b.act"
    assert "                  b _Scaled\n     inf      inf after lin\n                  b.act ReLU\n" in out
    # An Inf that the forward checks and then throws away is printed, not a trip (Transformers' rule).
    model.b.act = torch.nn.Identity()
    model.b.forward = lambda h: model.b.lin(h) * 0 + model.b.detect(h * float("inf"), "scratch") * 0
    out, err, insp = run_batches(model, lambda m: numguard.watch(m), [lambda m: m(x)])
    insp.close(check=False)
    assert err is None and out == "scratch has infs\n"
