"""NUMGUARD_* variables: parsing, validation, and how they combine with watch() arguments."""
import logging

import pytest

from numguard import env
from numguard.env import UNSET, EnvironmentSettingError


def test_unset_variables_set_nothing():
    assert env.settings_from_env({}) == {}
    assert env.settings_from_env({"NUMGUARD_MAX_FRAMES": "  ", "PATH": "/bin"}) == {}
    assert not env.enabled({})
    assert not env.enabled({"NUMGUARD": "0"})
    assert not env.enabled({"NUMGUARD": ""})
    assert env.enabled({"NUMGUARD": "1"})
    assert env.log_level_from_env({}) is None
    assert env.dist_settings_from_env({}) == {"dist_check": False, "dist_timeout": None}


def test_every_variable_maps_to_its_watch_argument():
    settings = env.settings_from_env({
        "NUMGUARD_MAX_FRAMES": "5",
        "NUMGUARD_TRACE_BATCHES": "1,3,10-12",
        "NUMGUARD_ABORT_AFTER": "0",
        "NUMGUARD_BACKWARD": "1",
        "NUMGUARD_CHECK": "ASYNC",
        "NUMGUARD_CHECK_EVERY": "10",
        "NUMGUARD_ON_TRIP": "dump",
        "NUMGUARD_DUMP_DIR": "/tmp/dumps",
    })
    assert settings == {
        "max_frames_to_save": 5,
        "trace_batch_nums": (1, 3, 10, 11, 12),
        "abort_after_batch_num": 0,
        "backward": True,
        "check": "async",
        "check_every": 10,
        "on_trip": "dump",
        "dump_dir": "/tmp/dumps",
    }
    assert env.settings_from_env({"NUMGUARD_BACKWARD": "0"}) == {"backward": False}
    assert env.log_level_from_env({"NUMGUARD_LOG_LEVEL": "debug"}) == logging.DEBUG
    assert env.log_level_from_env({"NUMGUARD_LOG_LEVEL": "15"}) == 15
    assert env.dist_settings_from_env({"NUMGUARD_DIST_CHECK": "1", "NUMGUARD_DIST_TIMEOUT": "2.5"}) == {
        "dist_check": True, "dist_timeout": 2.5}


@pytest.mark.parametrize("text, batches", [
    ("", ()), ("7", (7,)), ("3,1", (1, 3)), (" 1, 3 ,10-12 ", (1, 3, 10, 11, 12)),
    ("2-2,2", (2,)), ("0-3,", (0, 1, 2, 3)),
])
def test_batch_list(text, batches):
    assert env.parse_batch_list(text) == batches


@pytest.mark.parametrize("name, value, accepted", [
    ("NUMGUARD", "yes", "0 or 1"),
    ("NUMGUARD_MAX_FRAMES", "abc", "whole number >= 1"),
    ("NUMGUARD_MAX_FRAMES", "0", "whole number >= 1"),
    ("NUMGUARD_MAX_FRAMES", "2.5", "whole number >= 1"),
    ("NUMGUARD_TRACE_BATCHES", "1,x", "e.g. 1,3,10-12"),
    ("NUMGUARD_TRACE_BATCHES", "5-3", "e.g. 1,3,10-12"),
    ("NUMGUARD_TRACE_BATCHES", "-1", "e.g. 1,3,10-12"),
    ("NUMGUARD_ABORT_AFTER", "-1", "whole number >= 0"),
    ("NUMGUARD_BACKWARD", "true", "0 or 1"),
    ("NUMGUARD_CHECK", "sometimes", "sync or async"),
    ("NUMGUARD_CHECK_EVERY", "0", "whole number >= 1"),
    ("NUMGUARD_ON_TRIP", "explode", "raise or warn or dump"),
    ("NUMGUARD_LOG_LEVEL", "LOUD", "DEBUG, INFO, WARNING, ERROR, CRITICAL or a number"),
    ("NUMGUARD_DIST_CHECK", "2", "0 or 1"),
    ("NUMGUARD_DIST_TIMEOUT", "-3", "seconds > 0"),
    ("NUMGUARD_DIST_TIMEOUT", "soon", "seconds > 0"),
])
def test_invalid_value_names_variable_and_accepted_values(name, value, accepted):
    with pytest.raises(EnvironmentSettingError) as info:
        env.validate({name: value})
    message = str(info.value)
    assert name in message and repr(value) in message and accepted in message
    assert info.value.variable == name
    assert isinstance(info.value, ValueError)


def test_arguments_win_then_variables_then_defaults():
    environ = {"NUMGUARD_MAX_FRAMES": "7", "NUMGUARD_ON_TRIP": "warn", "NUMGUARD_CHECK": "async"}
    passed = {"max_frames_to_save": 3, "on_trip": UNSET, "check_every": UNSET, "headroom": 0.9}
    options = env.resolve_watch_options(passed, environ)
    assert options["max_frames_to_save"] == 3          # argument wins
    assert options["on_trip"] == "warn"                # variable fills an unset argument
    assert options["check"] == "async"                 # variable fills a missing argument
    assert options["check_every"] == 1                 # default
    assert options["headroom"] == 0.9                  # keys the variables don't know pass through
    assert options["trace_batch_nums"] == ()
    assert UNSET not in options.values()
    # An explicit value equal to the default still wins over the variable.
    assert env.resolve_watch_options({"on_trip": "raise"}, environ)["on_trip"] == "raise"


def test_resolve_rejects_invalid_variable_even_when_argument_given():
    with pytest.raises(EnvironmentSettingError, match="NUMGUARD_CHECK_EVERY"):
        env.resolve_watch_options({"check_every": 2}, {"NUMGUARD_CHECK_EVERY": "often"})


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
    for name in list(__import__("os").environ):
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
