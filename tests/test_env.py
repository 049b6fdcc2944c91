"""NUMGUARD_* variables: the one table, parsing, validation, and how they combine with watch()
arguments. Hostile values per variable: test_env_hostile.py; watch() arguments:
test_env_watch_options.py."""
import dataclasses
import logging
import math
import os
import re

import pytest

from numguard import env
from numguard.env import UNSET, BatchSet, EnvironmentSettingError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_unset_variables_set_nothing():
    assert env.settings_from_env({}) == {}
    assert env.settings_from_env({"NUMGUARD_MAX_FRAMES": "  ", "PATH": "/bin"}) == {}
    assert not env.enabled({})
    assert not env.enabled({"NUMGUARD": "0"})
    assert not env.enabled({"NUMGUARD": ""})
    assert env.enabled({"NUMGUARD": "1"})
    assert env.log_level_from_env({}) is None
    assert env.dist_settings_from_env({}) == {"dist_check": False, "dist_timeout": None}
    assert env.backend_choice({}) == "auto"
    assert env.cpu_isa_choice({}) is None
    values = env.validate({})
    assert set(values) == {v.name for v in env.VARIABLES}
    assert all(values[v.name] == v.default for v in env.VARIABLES)


def test_every_variable_maps_to_its_watch_argument():
    settings = env.settings_from_env({
        "NUMGUARD_MAX_FRAMES": "5",
        "NUMGUARD_TRACE_BATCHES": "1,3,10-12",
        "NUMGUARD_ABORT_AFTER": "0",
        "NUMGUARD_BACKWARD": "1",
        "NUMGUARD_OPS": "1",
        "NUMGUARD_CHECK": "ASYNC",
        "NUMGUARD_CHECK_EVERY": "10",
        "NUMGUARD_ON_TRIP": "dump",
        "NUMGUARD_DUMP_DIR": "/tmp/dumps",
    })
    assert settings == {
        "max_frames_to_save": 5,
        "trace_batch_nums": BatchSet([1, 3, 10, 11, 12]),
        "abort_after_batch_num": 0,
        "backward": True,
        "ops": True,
        "check": "async",
        "check_every": 10,
        "on_trip": "dump",
        "dump_dir": "/tmp/dumps",
    }
    assert env.settings_from_env({"NUMGUARD_BACKWARD": "0"}) == {"backward": False}
    assert env.settings_from_env({"NUMGUARD_OPS": " 0 "}) == {"ops": False}
    assert env.settings_from_env({"NUMGUARD_REPLAY": "1"}) == {"replay": True}
    assert env.log_level_from_env({"NUMGUARD_LOG_LEVEL": "debug"}) == logging.DEBUG
    assert env.log_level_from_env({"NUMGUARD_LOG_LEVEL": "15"}) == 15
    assert env.dist_settings_from_env({"NUMGUARD_DIST_CHECK": "1", "NUMGUARD_DIST_TIMEOUT": "2.5"}) == {
        "dist_check": True, "dist_timeout": 2.5}
    assert env.backend_choice({"NUMGUARD_BACKEND": " Torch "}) == "torch"
    assert env.cpu_isa_choice({"NUMGUARD_CPU_ISA": "avx2"}) == "avx2"
    # Every variable with a watch() argument maps to a key of the one copy of the defaults.
    assert {v.option for v in env.VARIABLES if v.option} <= set(env.WATCH_DEFAULTS)


@pytest.mark.parametrize("text, batches", [
    ("", []), ("7", [7]), ("3,1", [1, 3]), (" 1, 3 ,10-12 ", [1, 3, 10, 11, 12]),
    ("2-2,2", [2]), ("0-3,", [0, 1, 2, 3]), ("1,,2", [1, 2]), ("4-6,5-8,9", [4, 5, 6, 7, 8, 9]),
    ("007", [7]), ("10 - 12", [10, 11, 12]),
])
def test_batch_text(text, batches):
    parsed = env.parse_batch_list(text)
    assert list(parsed) == batches
    assert parsed == BatchSet(batches) == BatchSet.parse(str(parsed))  # str() round-trips


def test_batch_set_holds_huge_ranges_without_listing_them():
    batches = BatchSet.parse("1-10000000000,20000000000")
    assert len(batches) == 10_000_000_001
    assert 1 in batches and 10_000_000_000 in batches and 20_000_000_000 in batches
    assert 0 not in batches and 10_000_000_001 not in batches and "1" not in batches
    assert batches.ranges() == (range(1, 10_000_000_001), range(20_000_000_000, 20_000_000_001))
    assert str(batches) == "1-10000000000,20000000000"
    with pytest.raises(ValueError, match="more than 1000000 batch numbers"):
        iter(batches)  # listing them one by one is refused up front, not after minutes
    assert BatchSet(range(0, 10 ** 12)) == BatchSet.parse(f"0-{10 ** 12 - 1}")


def test_batch_set_from_python_values():
    assert list(BatchSet([5, 1, 5, 2])) == [1, 2, 5]
    assert list(BatchSet(range(0, 10, 3))) == [0, 3, 6, 9]
    assert list(BatchSet(range(9, -1, -3))) == [0, 3, 6, 9]
    assert BatchSet(None) == BatchSet() == BatchSet([]) and not BatchSet()
    assert BatchSet(BatchSet([3])) == BatchSet([3]) and hash(BatchSet([3])) == hash(BatchSet([3]))
    with pytest.raises(TypeError, match=r"BatchSet.parse"):
        BatchSet("12")  # would otherwise be the batches 1 and 2
    with pytest.raises(TypeError, match="ints"):
        BatchSet([1.0])
    with pytest.raises(ValueError, match="run from 0 to"):
        BatchSet([-1])
    with pytest.raises(ValueError, match="step 2"):
        BatchSet(range(0, 10 ** 8, 2))


@pytest.mark.parametrize("name, value, accepted", [
    ("NUMGUARD", "yes", "0 or 1"),
    ("NUMGUARD_MAX_FRAMES", "abc", "whole number (digits 0-9) from 1 to"),
    ("NUMGUARD_MAX_FRAMES", "0", "whole number (digits 0-9) from 1 to"),
    ("NUMGUARD_MAX_FRAMES", "2.5", "whole number (digits 0-9) from 1 to"),
    ("NUMGUARD_MAX_FRAMES", "10000000000", "512 MB"),
    ("NUMGUARD_TRACE_BATCHES", "1,x", "e.g. 1,3,10-12; 'x' is not a batch number"),
    ("NUMGUARD_TRACE_BATCHES", "5-3", "'5-3' is an empty range"),
    ("NUMGUARD_TRACE_BATCHES", "-1", "e.g. 1,3,10-12"),
    ("NUMGUARD_TRACE_BATCHES", "1-99999999999999999", "2**53-1"),
    ("NUMGUARD_ABORT_AFTER", "-1", "whole number (digits 0-9) from 0 to"),
    ("NUMGUARD_BACKWARD", "true", "0 or 1"),
    ("NUMGUARD_OPS", "yes", "0 or 1"),
    ("NUMGUARD_OPS", "2", "0 or 1"),
    ("NUMGUARD_CHECK", "sometimes", "sync or async"),
    ("NUMGUARD_CHECK_EVERY", "0", "whole number (digits 0-9) from 1 to"),
    ("NUMGUARD_ON_TRIP", "explode", "raise, warn or dump"),
    ("NUMGUARD_LOG_LEVEL", "LOUD", "DEBUG, INFO, WARNING, ERROR, CRITICAL"),
    ("NUMGUARD_LOG_LEVEL", "-5", "from 0 to 50"),
    ("NUMGUARD_DIST_CHECK", "2", "0 or 1"),
    ("NUMGUARD_DIST_TIMEOUT", "-3", "seconds from 0.001"),
    ("NUMGUARD_DIST_TIMEOUT", "soon", "seconds from 0.001"),
    ("NUMGUARD_DIST_TIMEOUT", "1e10", "86400 (one day"),
    ("NUMGUARD_BACKEND", "cuda", "auto, native or torch"),
    ("NUMGUARD_CPU_ISA", "sse4", "avx512, avx2 or baseline"),
    ("NUMGUARD_CPU_ISA", "avx1024", "any case"),
])
def test_invalid_value_names_variable_and_accepted_values(name, value, accepted):
    with pytest.raises(EnvironmentSettingError) as info:
        env.validate({name: value})
    message = str(info.value)
    assert name in message and repr(value) in message and accepted in message
    assert info.value.variable == name and info.value.value == value
    assert isinstance(info.value, ValueError)


def test_arguments_win_then_variables_then_defaults():
    environ = {"NUMGUARD_MAX_FRAMES": "7", "NUMGUARD_ON_TRIP": "warn", "NUMGUARD_CHECK": "async"}
    passed = {"max_frames_to_save": 3, "on_trip": UNSET, "check_every": UNSET, "headroom": 0.9}
    options = env.resolve_watch_options(passed, environ)
    assert options["max_frames_to_save"] == 3          # argument wins
    assert options["on_trip"] == "warn"                # variable fills an unset argument
    assert options["check"] == "async"                 # variable fills a missing argument
    assert options["check_every"] == 1                 # default
    assert options["headroom"] == 0.9                  # an argument no variable sets
    assert options["trace_batch_nums"] == BatchSet()
    assert options["report_to"] is env.STDOUT
    assert set(options) == set(env.WATCH_DEFAULTS)
    assert UNSET not in options.values()
    # An explicit value equal to the default still wins over the variable.
    assert env.resolve_watch_options({"on_trip": "raise"}, environ)["on_trip"] == "raise"
    # Keys numguard.env does not know pass through (options added by later features).
    assert env.resolve_watch_options({"replicas": 3}, {})["replicas"] == 3


def test_resolve_rejects_invalid_variable_even_when_argument_given():
    with pytest.raises(EnvironmentSettingError, match="NUMGUARD_CHECK_EVERY"):
        env.resolve_watch_options({"check_every": 2}, {"NUMGUARD_CHECK_EVERY": "often"})


def test_watch_defaults_are_one_read_only_copy():
    with pytest.raises(TypeError):
        env.WATCH_DEFAULTS["max_frames_to_save"] = 5
    assert env.WATCH_DEFAULTS["max_frames_to_save"] == 21
    assert env.validate_watch_options(dict(env.WATCH_DEFAULTS)) == dict(env.WATCH_DEFAULTS)


def test_stdout_default_writes_to_the_stdout_of_the_moment(capsys):
    print("report text", file=env.STDOUT, flush=True)
    assert capsys.readouterr().out == "report text\n"


def _readme():
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        return f.read()


def test_readme_table_is_the_env_table():
    readme = _readme()
    assert env.markdown_table() in readme, (
        "README.md's variable table differs from numguard.env.VARIABLES; paste "
        "numguard.env.markdown_table() into README.md")
    rows = re.findall(r"^\| `(NUMGUARD\w*)` \| (.*) \|$", readme, flags=re.M)
    assert [name for name, _ in rows] == [v.name for v in env.VARIABLES]
    assert dict(rows) == {v.name: v.meaning for v in env.VARIABLES}


def _variables_read_by_source():
    """Every NUMGUARD_* name the package's Python or the C++ kernels read from the environment."""
    pattern = re.compile(r"(?:getenv\(|environ\.get\(|environ\[|env\.read\(|_env\.read\(|read\()"
                         r"\s*[\"'](NUMGUARD\w*)[\"']")
    names = set()
    for folder in ("numguard", "csrc"):
        for root, _, files in os.walk(os.path.join(REPO, folder)):
            for name in files:
                if name.endswith((".py", ".cpp", ".h", ".cu", ".cuh")):
                    with open(os.path.join(root, name), encoding="utf-8") as f:
                        names.update(pattern.findall(f.read()))
    return names


def test_every_variable_the_source_reads_is_in_the_table():
    read = _variables_read_by_source()
    assert {"NUMGUARD", "NUMGUARD_BACKEND", "NUMGUARD_CPU_ISA", "NUMGUARD_DIST_TIMEOUT"} <= read
    missing = read - {v.name for v in env.VARIABLES}
    assert not missing, f"read by numguard but not in numguard.env.VARIABLES: {sorted(missing)}"


def test_env_module_imports_nothing_heavy():
    import subprocess
    import sys
    code = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('e', "
            "sys.argv[1]); m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m);"
            "print('torch' in sys.modules, 'numguard' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, env.__file__], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]


def _model():
    import torch
    return torch.nn.Sequential(torch.nn.Linear(2, 2))


def test_watch_takes_unset_arguments_from_the_variables(monkeypatch):
    import numguard
    monkeypatch.setenv("NUMGUARD_MAX_FRAMES", "4")
    monkeypatch.setenv("NUMGUARD_ON_TRIP", "warn")
    monkeypatch.setenv("NUMGUARD_CHECK_EVERY", "3")
    monkeypatch.setenv("NUMGUARD_TRACE_BATCHES", "2,5-6")
    with numguard.watch(_model(), report_to=None) as insp:
        assert insp.max_frames_to_save == 4
        assert insp.on_trip == "warn"
        assert insp.check_every == 3
        assert sorted(insp.trace_batch_nums) == [2, 5, 6]
    with numguard.watch(_model(), 9, on_trip="raise", check_every=1, report_to=None) as insp:
        assert insp.max_frames_to_save == 9          # arguments win
        assert insp.on_trip == "raise" and insp.check_every == 1
        assert sorted(insp.trace_batch_nums) == [2, 5, 6]


def test_watch_defaults_without_variables(monkeypatch):
    import numguard
    for name in list(os.environ):
        if name.startswith("NUMGUARD_"):
            monkeypatch.delenv(name)
    with numguard.watch(_model(), report_to=None) as insp:
        assert insp.max_frames_to_save == 21 and insp.on_trip == "raise"
        assert insp.check_mode == "sync" and insp.check_every == 1 and not insp.backward


def test_watch_fails_fast_on_an_invalid_variable(monkeypatch):
    import numguard
    monkeypatch.setenv("NUMGUARD_ON_TRIP", "explode")
    with pytest.raises(EnvironmentSettingError, match="NUMGUARD_ON_TRIP='explode'"):
        numguard.watch(_model(), report_to=None)


def test_huge_max_frames_fails_before_any_allocation(monkeypatch):
    import numguard
    model = _model()
    monkeypatch.setenv("NUMGUARD_MAX_FRAMES", "10000000000")
    with pytest.raises(EnvironmentSettingError, match="from 1 to 1000000 .*512 MB"):
        numguard.watch(model, report_to=None)
    monkeypatch.delenv("NUMGUARD_MAX_FRAMES")
    with pytest.raises(env.OptionError, match=r"max_frames_to_save=10000000000 .*512 MB"):
        numguard.watch(model, max_frames_to_save=10 ** 10, report_to=None)
    assert not model[0]._forward_hooks and not model._forward_hooks


def test_distributed_reads_the_same_table(monkeypatch):
    from numguard.distributed import _env as dist_env
    for name in ("NUMGUARD_DIST_TIMEOUT", "NUMGUARD_DIST_CHECK", "NUMGUARD_LOG_LEVEL"):
        monkeypatch.delenv(name, raising=False)
    assert dist_env.dist_timeout() == dist_env.DEFAULT_TIMEOUT_S == 60.0
    assert not dist_env.dist_check_enabled() and dist_env.env_log_level() is None
    monkeypatch.setenv("NUMGUARD_DIST_TIMEOUT", "1e10")
    with pytest.raises(EnvironmentSettingError, match="86400 \\(one day"):
        dist_env.dist_timeout()
    assert dist_env.dist_timeout(2) == 2.0        # the argument wins, and is checked the same way
    for bad in (1e10, 0, -1, math.nan, math.inf, True, "5", 10 ** 400):
        with pytest.raises(env.OptionError, match=r"^timeout=.* is not valid: pass a number of seconds"):
            dist_env.dist_timeout(bad)
    assert dist_env.parse_log_level("warning") == logging.WARNING
    assert dist_env.parse_log_level(15) == 15
    for bad in (-5, 51, True, 1.5, "LOUD", "-5"):
        with pytest.raises(env.OptionError, match=r"^log_level=.* is not valid: use DEBUG"):
            dist_env.parse_log_level(bad)


def test_readme_option_table_is_the_option_table():
    assert env.options_markdown_table() in _readme(), (
        "README.md's option table differs from numguard.env.WATCH_OPTIONS; paste "
        "numguard.env.options_markdown_table() into README.md")


def test_every_option_is_declared_once_and_everything_derives_from_its_row():
    import inspect

    from numguard.inspector.core import Inspector
    from numguard.inspector.options import WatchOptions
    names = [o.name for o in env.WATCH_OPTIONS]
    assert len(set(names)) == len(names)
    assert list(env.WATCH_DEFAULTS) == names == list(env.WATCH_VALIDATORS)
    assert [f.name for f in dataclasses.fields(WatchOptions)] == names
    for o in env.WATCH_OPTIONS:
        assert env.WATCH_DEFAULTS[o.name] is o.default and env.WATCH_VALIDATORS[o.name] == o.validate
        assert f"        {o.name}: " in Inspector.__doc__
        if o.variable:  # the variable sets this option and defaults to the option's default
            var = env.variable(o.variable)
            assert var.option == o.name and var.default is o.default
    signature = inspect.signature(Inspector.__init__).parameters
    assert signature["max_frames_to_save"].default is env.WATCH_DEFAULTS["max_frames_to_save"]
    assert {v.option for v in env.VARIABLES if v.option} == {o.name for o in env.WATCH_OPTIONS if o.variable}
