"""Parsing of the NUMGUARD_* variables the distributed guard reads.

An invalid value is an error that names the variable, the value and what is accepted.
"""
from __future__ import annotations

import logging
import os

DEFAULT_TIMEOUT_S = 60.0

_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def dist_check_enabled() -> bool:
    """``NUMGUARD_DIST_CHECK``: ``0``/unset off, ``1`` on."""
    raw = os.environ.get("NUMGUARD_DIST_CHECK", "").strip()
    if raw in ("", "0"):
        return False
    if raw == "1":
        return True
    raise ValueError(
        f"NUMGUARD_DIST_CHECK={raw!r} is not valid: use 0 (off, the default) or 1 "
        "(check shapes and dtypes before every torch.distributed collective)."
    )


def dist_timeout(value: float | None = None) -> float:
    """Seconds a check waits for every rank: ``value`` if given, else ``NUMGUARD_DIST_TIMEOUT``,
    else 60."""
    if value is not None:
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
            raise ValueError(f"timeout={value!r} is not valid: pass a number of seconds > 0.")
        return float(value)
    raw = os.environ.get("NUMGUARD_DIST_TIMEOUT", "").strip()
    if raw == "":
        return DEFAULT_TIMEOUT_S
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not seconds > 0 or seconds != seconds or seconds == float("inf"):
        raise ValueError(
            f"NUMGUARD_DIST_TIMEOUT={raw!r} is not valid: use a finite number of seconds > 0 "
            f"(default {DEFAULT_TIMEOUT_S:g})."
        )
    return seconds


def parse_log_level(value, source: str = "log_level") -> int:
    """A logging level from an int or a name (case-insensitive), or a clear ValueError."""
    if isinstance(value, bool):
        value = None  # fall through to the error below
    elif isinstance(value, int):
        return value
    elif isinstance(value, str):
        name = value.strip().upper()
        if name in _LEVELS:
            return getattr(logging, name)
        if name.isdigit():
            return int(name)
    raise ValueError(
        f"{source}={value!r} is not valid: use one of {', '.join(_LEVELS)} "
        "(any case) or a numeric logging level."
    )


def env_log_level() -> int | None:
    """``NUMGUARD_LOG_LEVEL`` as a logging level, or None when unset."""
    raw = os.environ.get("NUMGUARD_LOG_LEVEL", "").strip()
    if raw == "":
        return None
    return parse_log_level(raw, "NUMGUARD_LOG_LEVEL")
