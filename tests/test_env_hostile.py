"""Hostile values for every NUMGUARD_* variable: each either parses to the documented value or
raises EnvironmentSettingError naming the variable and the value, never anything else.

The expected outcome comes from a small reference reading of README.md's rules (below), written
independently of numguard.env's parsers."""
import logging
import re
import time

import pytest

from numguard import env
from numguard.env import EnvironmentSettingError

ERROR = object()

HOSTILE = ["", " ", "\t", "-5", "-0", "0", "1", "2", "21", "10000000000", "1.5", "1.", ".5", "nan",
           "NaN", "inf", "-inf", "\u0661\u0662", "\uff11", "\u00b2", "1e3", "1E3", "0x10", "0b1", "+1",
           "12abc", "abc", "1_000", " 3 ", "3\n", "9" * 5000, "1-", "-", "1-3", "5-3", "1,3", "1,,3",
           "1-10000000000", "sync", "ASYNC", "dump", "WARN", "debug", "INFO", "NOTSET", "avx2", "AVX2",
           " avx2", "avx2 ", "baseline", "avx512", "auto", "torch", "Native", "\x00", "\u00e9", "yes",
           "true", "0.0001", "0.001", "86400", "86400.0", "86401", "1e10", "1e-400", "1e400"]
# Values at and just past each bound.
EDGES = {
    "NUMGUARD_MAX_FRAMES": ["1000000", "1000001", "0"],
    "NUMGUARD_ABORT_AFTER": [str(env.MAX_BATCH_NUMBER), str(env.MAX_BATCH_NUMBER + 1)],
    "NUMGUARD_CHECK_EVERY": [str(env.MAX_BATCH_NUMBER), str(env.MAX_BATCH_NUMBER + 1)],
    "NUMGUARD_REPLICA_CHECK": [str(env.MAX_BATCH_NUMBER), str(env.MAX_BATCH_NUMBER + 1), "0"],
    "NUMGUARD_TRACE_BATCHES": [f"0-{env.MAX_BATCH_NUMBER}", f"0-{env.MAX_BATCH_NUMBER + 1}"],
    "NUMGUARD_LOG_LEVEL": ["50", "51", "050"],
    "NUMGUARD_QUANT": ["nvfp4", "MXFP8_E4M3", " float8_e5m2 ", "float8", "fp8", "nvfp4,mxfp8_e4m3"],
}


def _whole(lo, hi):
    # (Python refuses int() of > 4300 digits; such a number is out of every bound anyway.)
    return lambda t: int(t) if re.fullmatch(r"[0-9]{1,100}", t) and lo <= int(t) <= hi else ERROR


def _batches(t):
    numbers = set()
    for part in t.split(","):
        part = part.strip()
        if not part:
            continue
        m = re.fullmatch(r"([0-9]{1,100})(?:\s*-\s*([0-9]{1,100}))?", part)
        if not m:
            return ERROR
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo or hi > env.MAX_BATCH_NUMBER:
            return ERROR
        numbers.add((lo, hi))
    return numbers


def _seconds(t):
    if not re.fullmatch(r"([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+)?", t):
        return ERROR
    return float(t) if 0.001 <= float(t) <= 86400 else ERROR


def _level(t):
    if t.upper() in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        return getattr(logging, t.upper())
    return _whole(0, 50)(t)


REFERENCE = {  # variable -> (reading of the stripped text, default)
    "NUMGUARD": (lambda t: {"0": False, "1": True}.get(t, ERROR), False),
    "NUMGUARD_MAX_FRAMES": (_whole(1, 1_000_000), 21),
    "NUMGUARD_TRACE_BATCHES": (_batches, set()),
    "NUMGUARD_ABORT_AFTER": (_whole(0, env.MAX_BATCH_NUMBER), None),
    "NUMGUARD_BACKWARD": (lambda t: {"0": False, "1": True}.get(t, ERROR), False),
    "NUMGUARD_OPS": (lambda t: {"0": False, "1": True}.get(t, ERROR), False),
    "NUMGUARD_REPLAY": (lambda t: {"0": False, "1": True}.get(t, ERROR), False),
    "NUMGUARD_RERUN": (lambda t: {"0": False, "1": True}.get(t, ERROR), False),
    "NUMGUARD_CHECK": (lambda t: t.lower() if t.lower() in ("sync", "async") else ERROR, "sync"),
    "NUMGUARD_CHECK_EVERY": (_whole(1, env.MAX_BATCH_NUMBER), 1),
    "NUMGUARD_ON_TRIP": (lambda t: t.lower() if t.lower() in ("raise", "warn", "dump") else ERROR, "raise"),
    "NUMGUARD_DUMP_DIR": (lambda t: t, None),
    "NUMGUARD_DIST_CHECK": (lambda t: {"0": False, "1": True}.get(t, ERROR), False),
    "NUMGUARD_DIST_TIMEOUT": (_seconds, 60.0),
    "NUMGUARD_LOG_LEVEL": (_level, None),
    "NUMGUARD_BACKEND": (lambda t: t.lower() if t.lower() in ("auto", "native", "torch") else ERROR, "auto"),
    # Trimmed and any case, as csrc/cpu/dispatch.cpp reads it too.
    "NUMGUARD_CPU_ISA": (lambda t: t.lower() if t.lower() in ("avx512", "avx2", "baseline") else ERROR, None),
    "NUMGUARD_REPLICA_CHECK": (_whole(0, env.MAX_BATCH_NUMBER), 0),
    "NUMGUARD_SPIKES": (lambda t: {"0": False, "1": "warn"}.get(t, t.lower() if t.lower() in ("warn", "raise")
                                                               else ERROR), False),
    "NUMGUARD_QUANT": (lambda t: None if t == "0" else (t.lower() if t.lower() in (
        "float8_e4m3fn", "float8_e5m2", "mxfp8_e4m3", "mxfp8_e5m2", "nvfp4") else ERROR), None),
}


def expected(name, text):
    reading, default = REFERENCE[name]
    return default if not text.strip() else reading(text.strip())


def test_reference_covers_every_variable():
    assert set(REFERENCE) == {v.name for v in env.VARIABLES}


def _normalize(name, value):
    return [(r.start, r.stop - 1) for r in value.ranges()]


def _merged(intervals):
    out = []
    for lo, hi in sorted(intervals):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(hi, out[-1][1]))
        else:
            out.append((lo, hi))
    return out


@pytest.mark.parametrize("name", [v.name for v in env.VARIABLES])
def test_hostile_values(name):
    for text in HOSTILE + EDGES.get(name, []):
        want = expected(name, text)
        start = time.monotonic()
        try:
            got = env.read(name, {name: text})
        except EnvironmentSettingError as exc:
            message = str(exc)
            assert want is ERROR, f"{name}={text!r}: expected {want!r}, got the error {message}"
            assert exc.variable == name and exc.value == text
            assert message.startswith(f"{name}={text!r} is not valid: accepted values are ")
            assert f"Fix or unset {name}." in message
        else:
            assert want is not ERROR, f"{name}={text!r} was accepted as {got!r}"
            if name == "NUMGUARD_TRACE_BATCHES":
                assert _normalize(name, got) == _merged(want), f"{name}={text!r}: {got!r}"
            else:
                assert got == want and type(got) is type(want), f"{name}={text!r}: {got!r} != {want!r}"
        assert time.monotonic() - start < 1.0, f"{name}={text!r} took too long to parse"


@pytest.mark.parametrize("name", [v.name for v in env.VARIABLES])
def test_validate_reports_the_bad_variable_among_good_ones(name):
    environ = {v.name: "" for v in env.VARIABLES}
    environ["NUMGUARD_MAX_FRAMES"] = "5"
    environ[name] = "\u0661\u0662" if name != "NUMGUARD_DUMP_DIR" else "ok"
    if name == "NUMGUARD_DUMP_DIR":
        assert env.validate(environ)[name] == "ok"
        return
    with pytest.raises(EnvironmentSettingError) as info:
        env.validate(environ)
    assert info.value.variable == name
