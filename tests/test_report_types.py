"""The typed report (numguard.report_types): a real trip's report reads as the types and writes back
the same dictionary and the same dump bytes; a missing or wrong-typed field is an error naming the
field; the line kinds (schema.LineKind) are the codes the recorders keep."""
import copy
import json
import os
import re
import warnings

import pytest
import torch
from torch import nn

import numguard
from numguard import dump, report_types as rt, schema
from numguard.inspector import frames as frames_module
from numguard.inspector import ring as ring_module
from numguard.inspector.frames import Owner
from numguard.schema import LINE_EXTRA, LINE_KIND_MASK, LineKind

import test_report_golden as golden

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _dump_of_trip(tmp_path, **options):
    """Run a model whose head overflows under watch(on_trip="dump"); (file text, last_report)."""
    torch.manual_seed(0)
    model = golden.build()
    insp = numguard.watch(model, report_to=None, headroom=0, on_trip="dump", dump_dir=tmp_path, **options)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", numguard.errors.NonFiniteWarning)
        model(torch.tensor([[0, 1, 2]]))
        model.boost = 30.0
        model(torch.tensor([[1, 2, 3], [4, 5, 6]]))
    insp.close(check=False)
    (name,) = os.listdir(tmp_path)
    with open(tmp_path / name, encoding="utf-8") as f:
        return f.read(), insp.last_report


@pytest.mark.parametrize("options", [{}, {"ops": True}, {"replay": True}, {"rerun": True}],
                         ids=["plain", "ops", "replay", "rerun"])
def test_a_real_report_round_trips(tmp_path, options):
    text, last = _dump_of_trip(tmp_path, **options)
    data = json.loads(text)
    report = rt.Report.from_json(data)
    assert report.to_json() == data
    assert json.dumps(report.to_json(), indent=1) == text   # the bytes dump.write wrote
    assert rt.Report.from_json(last).to_json() == last       # the inspector's own dictionary
    # The typed view says what the dictionary says.
    offender = report.frames[-1]
    assert offender.offender is True and not any(f.offender for f in report.frames[:-1])
    assert (report.module, report.class_name) == (offender.name, offender.class_name) == ("head", "Linear")
    assert [line.label for line in offender.lines] == ["weight", "input[0]", "output"]
    assert all(line.kind is LineKind.TENSOR for line in offender.lines)
    assert report.labels == [line.label for line in offender.lines if numguard.report.is_nonfinite(line.record)]
    assert "output" in report.labels
    assert isinstance(report.history, rt.History) and report.history.modules
    assert report.history.modules[0].out_abs_max
    if options.get("ops"):
        assert isinstance(report.operation, rt.Operation) and report.operation.op == "aten::mul"
    else:
        assert report.operation is rt.ABSENT and "operation" not in data
    if options.get("replay"):
        assert isinstance(report.replay, rt.Replay) and report.replay.module == "head"
    if options.get("rerun"):
        assert report.rerun.verdict == "reproducible" and report.rerun.class_name == "Linear"


def test_a_report_built_from_types_is_a_valid_dump(tmp_path):
    line = rt.ReportLine(label="output", kind=LineKind.TENSOR, dtype="torch.float16", shape=[2],
                         record=[0.5, float("inf"), 0.5, 0, 1, 0, 0, 0])
    frame = rt.ReportFrame(name="head", class_name="Linear", section="forward", batch=0, hf=True,
                           lines=(line,), in_report=True, offender=True)
    report = rt.Report(batch_number=0, batch=0, module="head", class_name="Linear", labels=["output"],
                       frames=[frame], first_fault=rt.FirstFault(rank=0, module="head", this_rank=True))
    data = report.to_json()
    assert list(data) == ["format", "version", "batch_number", "batch", "module", "class", "labels",
                          "frames", "first_fault"]   # ABSENT fields are not written
    assert data["frames"][0] == {"name": "head", "class": "Linear", "section": "forward", "batch": 0, "hf": True,
                                 "labels": ["output"], "kinds": ["tensor"], "extra": [False],
                                 "dtypes": ["torch.float16"], "shapes": [[2]],
                                 "records": [[0.5, float("inf"), 0.5, 0, 1, 0, 0, 0]],
                                 "in_report": True, "offender": True}
    assert data["first_fault"] == {"rank": 0, "module": "head", "this_rank": True}
    path = tmp_path / "typed.json"
    path.write_text(json.dumps(data))
    text = dump.render_file(path)
    assert "Detected inf/nan during batch_number=0" in text and "head Linear" in text


@pytest.fixture(scope="module")
def real_report(tmp_path_factory):
    return json.loads(_dump_of_trip(tmp_path_factory.mktemp("dump"), rerun=True)[0])


@pytest.mark.parametrize("change, where, problem", [
    (lambda d: d.pop("batch_number"), "batch_number", "missing; the file is damaged or not a numguard dump"),
    (lambda d: d["frames"][1].pop("records"), "frames[1].records", "missing;"),
    (lambda d: d["frames"][0].__setitem__("class", 3), "frames[0].class", "expected a string, got 3"),
    (lambda d: d.__setitem__("check_every", 0), "check_every", "expected a whole number >= 1, got 0"),
    (lambda d: d["frames"][2]["kinds"].__setitem__(0, "tensr"), "frames[2].kinds[0]",
     "expected 'tensor', 'none' or 'not a tensor', got 'tensr'"),
    (lambda d: d["frames"][2]["shapes"].__setitem__(0, [-1]), "frames[2].shapes[0]",
     "expected a list of whole numbers >= 0, or null, got [-1]"),
    (lambda d: d["rerun"].__setitem__("verdict", "maybe"), "rerun.verdict",
     "expected one of 'transient', 'device', 'reproducible' or null, got 'maybe'"),
    (lambda d: d["rerun"].__setitem__("recovered", "no"), "rerun.recovered", "expected true or false, got 'no'"),
    (lambda d: d["history"]["modules"][0]["out_abs_max"].__setitem__(0, "x"), "history.modules[0].out_abs_max[0]",
     "expected a number or null, got 'x'"),
    (lambda d: d.__setitem__("first_fault", {"module": "head"}), "first_fault.rank", "missing;"),
    (lambda d: d.__setitem__("operation", ["aten.mm"]), "operation", "expected an object, got ['aten.mm']"),
    (lambda d: d.__setitem__("outliers", [{"rank": 1}]), "outliers[0].metric", "missing;"),
])
def test_a_bad_field_is_named(real_report, change, where, problem):
    data = copy.deepcopy(real_report)
    change(data)
    with pytest.raises(rt.ReportFieldError) as info:
        rt.Report.from_json(data)
    assert info.value.where == where
    assert info.value.problem.startswith(problem)
    assert str(info.value).startswith(f"{where}: {problem}")
    with pytest.raises(dump.DumpError) as info:   # the dump names the same place
        dump.validate(data, "f.json")
    assert str(info.value).startswith(f"f.json: {where}: {problem}")


def test_unknown_fields_are_ignored_and_absent_ones_stay_absent(real_report):
    data = copy.deepcopy(real_report)
    data["written_by"] = "a later numguard"
    del data["rerun"]["identical"]
    report = rt.Report.from_json(data)
    assert report.rerun.identical is rt.ABSENT and not report.rerun.identical
    out = report.to_json()
    assert "written_by" not in out and "identical" not in out["rerun"]
    del data["written_by"]
    assert out == data


def test_history_series_are_the_inspector_columns():
    from numguard.inspector import history
    fields = [f.name for f in rt.dataclasses.fields(rt.ModuleHistory)]
    assert tuple(fields[4:]) == rt.HISTORY_SERIES == history.FIELDS


# ---------------------------------------------------------------------------------------------
# Line kinds: the codes the recorders keep.


def test_line_kinds_are_the_recorder_codes():
    assert (LineKind.TENSOR, LineKind.NONE, LineKind.NOT_A_TENSOR) == (0, 1, 2)
    assert (frames_module.TENSOR, frames_module.NONE, frames_module.NOT_A_TENSOR) == tuple(LineKind)
    assert type(frames_module.TENSOR) is int           # plain ints on the hot path
    assert frames_module.EXTRA == LINE_EXTRA == 4 and LINE_KIND_MASK == 3 and not LINE_KIND_MASK & LINE_EXTRA
    assert [k.report_name for k in LineKind] == list(schema.LINE_KINDS) == ["tensor", "none", "not a tensor"]
    assert [LineKind.named(name) for name in schema.LINE_KINDS] == list(LineKind)
    assert [LineKind.of(code) for code in range(8) if code != 3 and code != 7] == list(LineKind) * 2


def test_csrc_history_reads_the_same_mask():
    path = os.path.join(ROOT, "csrc", "history.cpp")
    if not os.path.exists(path):
        pytest.skip("no csrc/ next to the tests (an installed wheel)")
    with open(path, encoding="utf-8") as f:
        found = re.findall(r"as_int\(kind\.ptr\(\)\) & (\d+)\) != (\d+)\) continue;  // not a TENSOR line", f.read())
    assert found == [(str(LINE_KIND_MASK), str(LineKind.TENSOR.value))]


def _call():
    """A module call with every kind of line: (args, kwargs, output) and each line's (kind, extra)."""
    x = torch.ones(2)
    args = (x, None, 3.0, [x, None])
    kwargs = {"mask": x, "options": {"scale": 2.0}}
    output = (x, None)
    expected = {"input[0]": (LineKind.TENSOR, False), "input[1]": (LineKind.NONE, False),
                "input[2]": (LineKind.NOT_A_TENSOR, False), "input[3]": (LineKind.NOT_A_TENSOR, False),
                "input[3][0]": (LineKind.TENSOR, True), "input[3][1]": (LineKind.NONE, True),
                "kwargs.mask": (LineKind.TENSOR, True), "kwargs.options": (LineKind.NOT_A_TENSOR, True),
                "kwargs.options.scale": (LineKind.NOT_A_TENSOR, True),
                "output[0]": (LineKind.TENSOR, False), "output[1]": (LineKind.NONE, False)}
    return args, kwargs, output, expected


@pytest.mark.parametrize("recorder", ["native", "python"])
def test_recorders_keep_the_line_codes(recorder, monkeypatch):
    if recorder == "native" and numguard.backend() != "native":
        pytest.skip("native extension not loaded")
    if recorder == "python":
        monkeypatch.setattr(numguard.ops, "native_module", lambda: None)
    ring = ring_module.FrameRing(64, torch.device("cpu"))
    monkeypatch.undo()
    assert (type(ring._recorder) is ring_module._PythonRecorder) == (recorder == "python")
    args, kwargs, output, expected = _call()
    xs, labels, kinds, _ = frames_module.flatten_call(args, kwargs, output)
    ring.record(Owner(0, "m", "M"), xs, labels, kinds, "forward", True, False, 0)
    kept = ring.frames[-1]
    assert list(kept.kinds) == list(kinds)
    decoded = {label: (LineKind.of(code), bool(code & LINE_EXTRA)) for label, code in zip(kept.labels, kept.kinds)}
    assert decoded == expected


def test_a_report_shows_the_kinds_the_hooks_recorded():
    args, kwargs, output, expected = _call()

    class Odd(nn.Module):
        def forward(self, x, nothing, number, items, mask=None, options=None):
            return x * float("inf"), None

    class Root(nn.Module):
        def __init__(self):
            super().__init__()
            self.odd = Odd()

        def forward(self, x):
            return self.odd(x, *args[1:], **kwargs)[0]

    model = Root()
    insp = numguard.watch(model, report_to=None, headroom=0)
    with pytest.raises(numguard.NonFiniteError):
        model(args[0])
    insp.close(check=False)
    frame = next(f for f in rt.Report.from_json(insp.last_report).frames if f.name == "odd")
    assert {line.label: (line.kind, line.extra) for line in frame.lines} == expected
