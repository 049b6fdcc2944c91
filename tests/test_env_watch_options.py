"""watch() options: numguard.env's validators check types strictly. Every option gets every value of
a pool of wrong-typed and out-of-range Python values; each is either accepted (and normalized as
the rules below say) or refused with an OptionError naming the option and the value."""
import io
import math
import pathlib
import sys

import pytest

from numguard import env
from numguard.env import BatchSet, OptionError

ERROR = object()


class Writer:
    def write(self, text):
        return len(text)


POOL = [None, True, False, 0, 1, -1, 2, 21, 1.0, 0.5, 1.5, -0.1, math.nan, math.inf, 10 ** 10,
        10 ** 400, env.MAX_BATCH_NUMBER, env.MAX_BATCH_NUMBER + 1, "", " ", "1", "12", "1,3", "no",
        "False", "True", "sync", "SYNC", "async", "raise", "warn", "dump", "count", "trip", "0.5",
        b"12", bytearray(b"1"), [], [1, 3], [1.0], [True], [-1], ["1"], [2 ** 70], (0, 2), {4}, {1: 2},
        (b for b in [1]), {1: 2}.keys(), range(3), range(0, 10 ** 10), range(0, 10 ** 8, 3), range(-1, 3), BatchSet.parse("1-10"),
        object(), Writer(), io.StringIO(), print, list, pathlib.Path("/tmp/d"), pathlib.Path(""),
        "/tmp/d", 1 + 0j, "nvfp4", "NVFP4", "Warn", "RAISE", "Dump", "ASYNC", "Trip", "FLOAT8_E4M3FN",
        "sync ", "warnings"]


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _int_in(lo, hi):
    return lambda v: int(v) if _is_int(v) and lo <= v <= hi else ERROR


def _flag(v):
    if isinstance(v, bool):
        return v
    return bool(v) if type(v) is int and v in (0, 1) else ERROR


def _choice(*choices):
    """A keyword option: its words in any case, as the word."""
    return lambda v: v.lower() if isinstance(v, str) and v.lower() in choices else ERROR


def _batches(v):
    if v is None:
        return BatchSet()
    if isinstance(v, (BatchSet, range)):
        if isinstance(v, range) and (len(v) and (min(v[0], v[-1]) < 0 or (abs(v.step) != 1 and len(v) > 10 ** 6))):
            return ERROR
        return BatchSet(v)
    if isinstance(v, (list, tuple, set, frozenset, type({}.keys()))) and all(
            _is_int(b) and 0 <= b <= env.MAX_BATCH_NUMBER for b in v):
        return BatchSet(v)
    return ERROR


def _headroom(v):
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return ERROR
    try:
        return float(v) if 0 <= float(v) < 1 else ERROR
    except OverflowError:
        return ERROR


def _dump_dir(v):
    if v is None:
        return None
    return v if isinstance(v, (str, pathlib.PurePath)) and str(v).strip() else ERROR


def _spikes(v):
    if isinstance(v, bool) or (type(v) is int and v in (0, 1)):
        return "warn" if v else False
    return _choice("warn", "raise")(v)


def _quant(v):
    if v is None or v is False or (type(v) is int and v == 0):
        return None
    return _choice(*env.QUANT_FORMAT_NAMES)(v)


def _amax_group(v):
    if v is None:
        return None
    if isinstance(v, (list, tuple, range)) and 0 < len(v) <= env.MAX_GROUP_RANKS and all(
            _is_int(r) and 0 <= r <= env.MAX_BATCH_NUMBER for r in v):
        return tuple(sorted(set(v)))
    return ERROR


def _report_to(v):
    if v is None or callable(getattr(v, "write", None)) or (callable(v) and not isinstance(v, (str, bytes))):
        return v
    return ERROR


RULES = {
    "max_frames_to_save": _int_in(1, 1_000_000),
    "trace_batch_nums": _batches,
    "abort_after_batch_num": lambda v: None if v is None else _int_in(0, env.MAX_BATCH_NUMBER)(v),
    "backward": _flag,
    "check": _choice("sync", "async"),
    "check_every": _int_in(1, env.MAX_BATCH_NUMBER),
    "on_trip": _choice("raise", "warn", "dump"),
    "dump_dir": _dump_dir,
    "headroom": _headroom,
    "report_to": _report_to,
    "extras": _flag,
    "scaler_skips": _choice("count", "trip"),
    "ops": _flag,
    "replay": _flag,
    "replicas": _int_in(0, env.MAX_BATCH_NUMBER),
    "spikes": _spikes,
    "rerun": _flag,
    "recover": _flag,
    "quant": _quant,
    "amax_group": _amax_group,
}


def test_rules_cover_every_option():
    assert set(RULES) == set(env.WATCH_VALIDATORS) == set(env.WATCH_DEFAULTS)


@pytest.mark.parametrize("option", sorted(RULES))
def test_every_option_against_the_pool(option):
    for value in POOL:
        want = RULES[option](value)
        try:
            got = env.validate_watch_options({option: value})[option]
        except OptionError as exc:
            assert want is ERROR, f"{option}={value!r} refused ({exc}); expected {want!r}"
            message = str(exc)
            assert exc.option == option and exc.value is value
            assert message.startswith(f"numguard.watch: {option}=")
            assert env._short_repr(value) in message and "is not valid: " in message
            assert isinstance(exc, TypeError) and isinstance(exc, ValueError)
        else:
            assert want is not ERROR, f"{option}={value!r} was accepted as {got!r}"
            assert got == want and type(got) is type(want), f"{option}={value!r}: {got!r} != {want!r}"


@pytest.mark.parametrize("option, value, hint", [
    ("trace_batch_nums", "12", "character by character"),
    ("backward", "no", "would count as true"),
    ("extras", "False", "would count as true"),
    ("abort_after_batch_num", True, "not a bool"),
    ("max_frames_to_save", 10 ** 10, "512 MB"),
    ("max_frames_to_save", 2.0, "not a float"),
    ("headroom", math.nan, "up to, not including, 1"),
    ("report_to", "stdout", "sys.stderr"),
    ("dump_dir", b"/tmp", "os.PathLike"),
    ("check", "synch", "'sync' or 'async' (any case)"),
    ("quant", "fp8", "'float8_e4m3fn'"),
])
def test_errors_say_what_to_do(option, value, hint):
    with pytest.raises(OptionError) as info:
        env.validate_watch_options({option: value})
    assert hint in str(info.value) and f"{option}={value!r}" in str(info.value)


def test_keyword_choices_are_taken_in_any_case_through_watch():
    import numguard
    model = _model()
    with numguard.watch(model, check="SYNC", on_trip="Warn", quant="FLOAT8_E4M3FN", spikes="RAISE",
                        scaler_skips="Trip", report_to=None) as insp:
        assert (insp.options.check, insp.options.on_trip, insp.options.quant, insp.options.spikes,
                insp.options.scaler_skips) == ("sync", "warn", "float8_e4m3fn", "raise", "trip")
    every = {o.name for o in env.WATCH_OPTIONS if o.keywords}
    assert every == {"check", "on_trip", "scaler_skips", "spikes", "quant"}  # one place says it


def test_huge_values_do_not_flood_the_message():
    with pytest.raises(OptionError) as info:
        env.validate_watch_options({"trace_batch_nums": list(range(10 ** 5)) + ["x"]})
    assert len(str(info.value)) < 600


def test_normalized_values():
    options = env.validate_watch_options({
        "trace_batch_nums": [3, 1], "backward": 1, "extras": 0, "headroom": 0, "check_every": 2,
        "report_to": sys.stderr, "unknown_future_option": "kept"})
    assert options == {"trace_batch_nums": BatchSet([1, 3]), "backward": True, "extras": False,
                       "headroom": 0.0, "check_every": 2, "report_to": sys.stderr,
                       "unknown_future_option": "kept"}
    assert type(options["headroom"]) is float


def _model():
    import torch
    return torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())


@pytest.mark.parametrize("option, value", [
    ("trace_batch_nums", "12"), ("backward", "no"), ("extras", "False"),
    ("abort_after_batch_num", True), ("max_frames_to_save", 10 ** 10), ("max_frames_to_save", True),
    ("report_to", 1), ("dump_dir", 1), ("scaler_skips", "skip"), ("ops", "on"), ("replay", "on"),
])
def test_watch_refuses_bad_options_and_leaves_no_hook(option, value):
    import numguard
    model = _model()
    with pytest.raises(OptionError, match=f"numguard.watch: {option}="):
        numguard.watch(model, **{option: value})
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_watch_keeps_working_with_good_options(capsys):
    import torch

    import numguard
    model = _model()
    with numguard.watch(model, trace_batch_nums=range(0, 1000), report_to=sys.stdout,
                        backward=0, extras=1) as insp:
        model(torch.ones(1, 2))
        assert 0 in insp.trace_batch_nums and not insp.backward and insp.extras
    assert "Starting batch number=0" in capsys.readouterr().out
