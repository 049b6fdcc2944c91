"""The NUMGUARD_* variables and arguments the distributed guard reads, parsed by numguard.env.

Kept as a module because guard, the channel, logging and numguard.distributed import these
names; the parsing, bounds and error messages live in :mod:`numguard.env` only.
"""
from __future__ import annotations

from .. import env as _env

DEFAULT_TIMEOUT_S = _env.variable("NUMGUARD_DIST_TIMEOUT").default


def dist_check_enabled() -> bool:
    """``NUMGUARD_DIST_CHECK``: ``0``/unset off, ``1`` on."""
    return _env.read("NUMGUARD_DIST_CHECK")


def dist_timeout(value: float | None = None) -> float:
    """Seconds a check waits for every rank: ``value`` if given, else ``NUMGUARD_DIST_TIMEOUT``,
    else 60. Both are bounded (see numguard.env.MAX_DIST_TIMEOUT_S)."""
    if value is not None:
        return _env.dist_timeout_argument(value)
    return _env.read("NUMGUARD_DIST_TIMEOUT")


def parse_log_level(value, source: str = "log_level") -> int:
    """A logging level from an int (0-50) or a name (case-insensitive), or a clear ValueError."""
    return _env.log_level_argument(value, source)


def env_log_level() -> int | None:
    """``NUMGUARD_LOG_LEVEL`` as a logging level, or None when unset."""
    return _env.read("NUMGUARD_LOG_LEVEL")
