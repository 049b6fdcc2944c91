"""Dump files are checked against their schema before anything renders them: every mutation of a
real dump (a dropped key, a wrong type at each position, per-line lists of different lengths, a
wrong or newer version, not JSON, an empty file) gives `python -m numguard report` (with and
without --plot) exit status 2 and one line saying what is wrong where, never a traceback; a valid
dump still renders exactly the golden report."""
import copy
import json
import os

import pytest

import numguard
from numguard import cli, dump
import test_report_golden as golden
from test_cli import run_cli


def _trip(scenario, monkeypatch):
    """Run a golden scenario; returns (report text, report dictionary)."""
    made = []
    real = numguard.watch
    monkeypatch.setattr(numguard, "watch", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    text = scenario()
    return text, made[0].last_report


@pytest.fixture(scope="module")
def base():
    with pytest.MonkeyPatch.context() as mp:
        return _trip(golden.forward_trip_report, mp)[1]


@pytest.mark.parametrize("scenario, golden_file", [
    (golden.forward_trip_report, "report_forward.txt"), (golden.backward_trip_report, "report_backward.txt")])
def test_valid_dump_renders_the_golden_report(scenario, golden_file, tmp_path, monkeypatch, capsys):
    text, report = _trip(scenario, monkeypatch)
    path = dump.write(report, tmp_path)
    with open(os.path.join(golden.GOLDEN_DIR, golden_file), encoding="utf-8") as f:
        expected = f.read()
    assert text == expected
    assert cli.main(["report", path]) == 0
    assert capsys.readouterr().out == expected
    assert dump.render_file(path) == expected


# Wrong values per key; every one of them must be refused at that key.
TOP = {
    "format": [1, None, "other"], "version": ["1", 1.5, True, None, 0, -1, [1]],
    "batch_number": ["1", 1.5, None, True, -1, [0]], "batch": ["1", 1.5, True, -2],
    "found_at_batch": ["x", 1.5], "check": [1, None, []], "check_every": ["2", 0, 1.5, True],
    "where": [3, []], "rank": ["0", 1.5, -1, True], "ranks": ["x", [["a"]], [1], [[0, 1]], [[0, "m", 2]]],
    "module": [1, []], "class": [1, None], "labels": ["input[0]", [1], None], "section": [1, None],
    "max_frames_to_save": ["4", 0, None], "headroom": ["0", None, True], "backend": [1, None],
    "frames": ["x", {}, None, [], 3],
}
FRAME = {
    "name": [1, None, []], "class": [1, None], "section": [1, None], "batch": ["1", 1.5, -1],
    "batch_start": ["x", 1.5, True], "hf": ["yes", 1, None], "in_report": ["yes", 0], "offender": [1, "no"],
    "labels": ["x", None, 7], "kinds": ["x", None], "extra": ["x", 1], "dtypes": ["x", 1],
    "shapes": ["x", 2], "records": ["x", None, 5],
}
# Wrong entries of the per-line lists (each put at one line).
LINE = {
    "labels": [1, None, ["a"]], "kinds": ["tensr", 1, None], "extra": [1, "no", None],
    "dtypes": [1, ["torch.float16"]], "shapes": ["4x4", [-1], ["a"], [1.5], 3],
    "records": ["abc", 5, {}, [1.0] * 7, [1.0] * 9, ["a"] * 8, [True] * 8,
                [0.1, 0.2, 0.3, -1, 0, 0, 0, 0], [0.1, 0.2, 0.3, 0.5, 0, 0, 0, 0],
                [0.1, 0.2, 0.3, float("nan"), 0, 0, 0, 0], [0.1, 0.2, 0.3, 0, float("inf"), 0, 0, 0],
                [0.1, 0.2, "x", 0, 0, 0, 0, 0]],
}
REQUIRED_TOP = ("format", "version", "batch_number", "frames")
REQUIRED_FRAME = ("name", "class", "labels", "kinds", "records")


def mutations(base):
    """(case, file text, the place the error must name)."""
    def one(change):
        data = copy.deepcopy(base)
        change(data)
        return json.dumps(data)

    for key in REQUIRED_TOP:
        yield f"drop {key}", one(lambda d: d.pop(key)), "format" if key == "format" else key
    for key, bads in TOP.items():
        for bad in bads:
            yield f"{key}={bad!r}", one(lambda d: d.__setitem__(key, bad)), key
    for i in range(len(base["frames"])):
        for key in REQUIRED_FRAME:
            yield f"drop frames[{i}].{key}", one(lambda d: d["frames"][i].pop(key)), f"frames[{i}].{key}"
        yield f"frames[{i}]='x'", one(lambda d: d["frames"].__setitem__(i, "x")), f"frames[{i}]"
    for key, bads in FRAME.items():
        for bad in bads:
            yield f"frames[1].{key}={bad!r}", one(lambda d: d["frames"][1].__setitem__(key, bad)), f"frames[1].{key}"
    for key, bads in LINE.items():
        for line in range(len(base["frames"][2][key])):
            for bad in bads:
                yield (f"frames[2].{key}[{line}]={bad!r}",
                       one(lambda d: d["frames"][2][key].__setitem__(line, bad)), f"frames[2].{key}[{line}]")
        for delta in (-1, 1):
            def resize(d, key=key, delta=delta):
                values = d["frames"][3][key]
                d["frames"][3][key] = values[:-1] if delta < 0 else values + values[-1:]
            yield f"frames[3].{key} {delta:+d}", one(resize), "frames[3]: the per-line lists differ in length"
    text = json.dumps(base)
    yield "not JSON", "{not json", "not valid JSON"
    yield "cut short", text[: len(text) // 2], "not valid JSON"
    yield "empty file", "", "the file is empty"
    yield "blank file", " \n", "the file is empty"
    yield "a list", "[1, 2]", "expected a JSON object"
    yield "null", "null", "expected a JSON object"
    yield "deep nesting", "[" * 100000 + "]" * 100000, "cannot be read as JSON"
    yield "5000-digit number", '{"format": "numguard-report", "version": 1' + "0" * 5000 + "}", \
        "cannot be read as JSON"
    yield "newer version", one(lambda d: d.__setitem__("version", dump.VERSION + 1)), \
        f"version: report version {dump.VERSION + 1} is newer than this numguard reads"


def test_every_mutation_is_a_clear_error(base, tmp_path, capsys):
    cases = list(mutations(base))
    assert len(cases) > 250
    for number, (case, text, where) in enumerate(cases):
        path = tmp_path / f"case{number}.json"
        path.write_text(text, encoding="utf-8")
        for plot in ([], ["--plot", str(tmp_path / "x.png")]):
            status = cli.main(["report", str(path)] + plot)
            out, err = capsys.readouterr()
            assert status == 2, f"{case}{plot}: status {status}, stdout {out[:200]!r}"
            assert out == "" and err.count("\n") == 1, f"{case}: {err!r}"
            assert f"numguard report: cannot read {path}: " in err, f"{case}: {err!r}"
            assert where in err, f"{case}: {where!r} not in {err!r}"
            assert not (tmp_path / "x.png").exists()


def test_error_names_the_bad_value(base, tmp_path):
    data = copy.deepcopy(base)
    data["frames"][3]["records"][2] = "abc"
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(dump.DumpError) as info:
        dump.load(path)
    assert info.value.where == "frames[3].records[2]"
    assert str(info.value) == (f"{path}: frames[3].records[2]: expected 8 numbers or null (abs_min, "
                               "abs_max, min_nonzero, then 5 counts >= 0), got 'abc'")
    assert isinstance(info.value, ValueError)


def test_optional_fields_may_be_missing(base, tmp_path, capsys):
    data = copy.deepcopy(base)
    for key in list(data):
        if key not in REQUIRED_TOP:
            del data[key]
    for frame in data["frames"]:
        for key in list(frame):
            if key not in REQUIRED_FRAME:
                del frame[key]
    path = tmp_path / "minimal.json"
    path.write_text(json.dumps(data))
    assert cli.main(["report", str(path)]) == 0
    assert "Detected inf/nan during batch_number=" in capsys.readouterr().out


def test_plot_refuses_a_bad_dictionary_before_drawing(base, tmp_path):
    from numguard.plot import plot_dump
    data = copy.deepcopy(base)
    data["frames"][0]["records"][0][2] = "x"   # rendered text never reads min_nonzero; the plot does
    with pytest.raises(dump.DumpError, match=r"frames\[0\]\.records\[0\]"):
        plot_dump(data, tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


def test_command_line_exit_status_and_no_traceback(base, tmp_path):
    data = copy.deepcopy(base)
    data["frames"][0]["kinds"][0] = "none"
    data["frames"][0]["records"][0] = ["a"] * 8
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    out = run_cli("report", str(path), "--plot", str(tmp_path / "x.png"))
    assert out.returncode == 2
    assert "Traceback" not in out.stderr and out.stdout == ""
    assert "frames[0].records[0]: expected 8 numbers or null" in out.stderr
