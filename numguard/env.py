"""numguard's settings from ``NUMGUARD_*`` environment variables.

``NUMGUARD=1`` switches detection on for a script that never imports numguard (the start-up hook
in :mod:`numguard._startup` does that); the other variables set what :func:`numguard.watch` would
take as arguments. Arguments passed to ``watch()`` win; the variables fill in what the arguments
leave unset; the documented defaults fill in the rest.

| variable | watch() argument | accepted values |
|---|---|---|
| NUMGUARD | (switch) | 0 or unset: off; 1: on |
| NUMGUARD_MAX_FRAMES | max_frames_to_save | whole number >= 1 (default 21) |
| NUMGUARD_TRACE_BATCHES | trace_batch_nums | batch numbers and ranges, e.g. 1,3,10-12 |
| NUMGUARD_ABORT_AFTER | abort_after_batch_num | whole number >= 0 |
| NUMGUARD_BACKWARD | backward | 0 or 1 |
| NUMGUARD_CHECK | check | sync (default) or async |
| NUMGUARD_CHECK_EVERY | check_every | whole number >= 1 (default 1) |
| NUMGUARD_ON_TRIP | on_trip | raise (default), warn or dump |
| NUMGUARD_DUMP_DIR | dump_dir | a folder path |
| NUMGUARD_LOG_LEVEL | (numguard's loggers) | DEBUG, INFO, WARNING, ERROR, CRITICAL or a number |
| NUMGUARD_DIST_CHECK | (numguard.distributed) | 0 or 1 |
| NUMGUARD_DIST_TIMEOUT | (numguard.distributed) | seconds, a number > 0 |

This module imports neither torch nor the rest of numguard: the start-up hook reads it before the
script has imported anything. Every function is pure (it reads the mapping it is given, or
``os.environ``) and raises :class:`EnvironmentSettingError` naming the variable, its value and the
accepted values when a value is invalid.
"""
import logging
import os

__all__ = ["EnvironmentSettingError", "UNSET", "WATCH_DEFAULTS", "dist_settings_from_env",
           "enabled", "log_level_from_env", "parse_batch_list", "resolve_watch_options",
           "settings_from_env"]


class EnvironmentSettingError(ValueError):
    """A ``NUMGUARD_*`` variable holds a value numguard does not accept."""

    def __init__(self, name, value, accepted):
        self.variable, self.value, self.accepted = name, value, accepted
        super().__init__(f"{name}={value!r} is not valid: accepted values are {accepted}. "
                         f"Fix or unset {name}.")


class _Unset:
    """Default of a watch() argument the caller did not pass (env or default fills it in)."""

    _instance = None

    def __new__(cls):
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self):
        return "UNSET"

    def __bool__(self):
        return False


UNSET = _Unset()

# The documented defaults of the watch() arguments that a variable can set.
WATCH_DEFAULTS = {
    "max_frames_to_save": 21,
    "trace_batch_nums": (),
    "abort_after_batch_num": None,
    "backward": False,
    "check": "sync",
    "check_every": 1,
    "on_trip": "raise",
    "dump_dir": None,
}

_SWITCH = "0 or 1"
_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _get(environ, name):
    """The stripped value of a variable, or None when it is unset or empty."""
    value = environ.get(name)
    if value is None:
        return None
    value = value.strip()
    return value if value else None


def _switch(environ, name):
    value = _get(environ, name)
    if value is None:
        return None
    if value not in ("0", "1"):
        raise EnvironmentSettingError(name, value, _SWITCH)
    return value == "1"


def _whole(environ, name, minimum):
    value = _get(environ, name)
    if value is None:
        return None
    try:
        number = int(value, 10)
    except ValueError:
        number = None
    if number is None or number < minimum:
        raise EnvironmentSettingError(name, value, f"a whole number >= {minimum}")
    return number


def _choice(environ, name, choices):
    value = _get(environ, name)
    if value is None:
        return None
    if value.lower() not in choices:
        raise EnvironmentSettingError(name, value, " or ".join(choices))
    return value.lower()


def parse_batch_list(text, name="NUMGUARD_TRACE_BATCHES"):
    """``"1,3,10-12"`` -> ``(1, 3, 10, 11, 12)``: sorted, without repeats. Empty text -> ``()``."""
    accepted = "batch numbers (>= 0) and ranges separated by commas, e.g. 1,3,10-12"
    batches = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        low, sep, high = part.partition("-")
        try:
            first = int(low.strip(), 10)
            last = int(high.strip(), 10) if sep else first
        except ValueError:
            raise EnvironmentSettingError(name, text, accepted) from None
        if first < 0 or last < first:
            raise EnvironmentSettingError(name, text, accepted)
        batches.update(range(first, last + 1))
    return tuple(sorted(batches))


def enabled(environ=None):
    """True when ``NUMGUARD`` is 1; False when it is unset, empty or 0."""
    environ = os.environ if environ is None else environ
    return bool(_switch(environ, "NUMGUARD"))


def settings_from_env(environ=None):
    """The watch() keyword arguments the ``NUMGUARD_*`` variables set (only those that are set).

    >>> settings_from_env({"NUMGUARD_MAX_FRAMES": "5", "NUMGUARD_TRACE_BATCHES": "1,3-4"})
    {'max_frames_to_save': 5, 'trace_batch_nums': (1, 3, 4)}
    """
    environ = os.environ if environ is None else environ
    settings = {}
    value = _whole(environ, "NUMGUARD_MAX_FRAMES", 1)
    if value is not None:
        settings["max_frames_to_save"] = value
    text = _get(environ, "NUMGUARD_TRACE_BATCHES")
    if text is not None:
        settings["trace_batch_nums"] = parse_batch_list(text)
    value = _whole(environ, "NUMGUARD_ABORT_AFTER", 0)
    if value is not None:
        settings["abort_after_batch_num"] = value
    value = _switch(environ, "NUMGUARD_BACKWARD")
    if value is not None:
        settings["backward"] = value
    value = _choice(environ, "NUMGUARD_CHECK", ("sync", "async"))
    if value is not None:
        settings["check"] = value
    value = _whole(environ, "NUMGUARD_CHECK_EVERY", 1)
    if value is not None:
        settings["check_every"] = value
    value = _choice(environ, "NUMGUARD_ON_TRIP", ("raise", "warn", "dump"))
    if value is not None:
        settings["on_trip"] = value
    value = _get(environ, "NUMGUARD_DUMP_DIR")
    if value is not None:
        settings["dump_dir"] = value
    return settings


def log_level_from_env(environ=None):
    """The level ``NUMGUARD_LOG_LEVEL`` sets for numguard's loggers (a ``logging`` int), or None."""
    environ = os.environ if environ is None else environ
    value = _get(environ, "NUMGUARD_LOG_LEVEL")
    if value is None:
        return None
    if value.upper() in _LOG_LEVELS:
        return getattr(logging, value.upper())
    try:
        return int(value, 10)
    except ValueError:
        raise EnvironmentSettingError("NUMGUARD_LOG_LEVEL", value,
                                      ", ".join(_LOG_LEVELS) + " or a number") from None


def dist_settings_from_env(environ=None):
    """``{"dist_check": bool, "dist_timeout": float or None}`` from NUMGUARD_DIST_CHECK/TIMEOUT."""
    environ = os.environ if environ is None else environ
    timeout = _get(environ, "NUMGUARD_DIST_TIMEOUT")
    if timeout is not None:
        try:
            seconds = float(timeout)
        except ValueError:
            seconds = None
        if seconds is None or not seconds > 0 or seconds == float("inf"):
            raise EnvironmentSettingError("NUMGUARD_DIST_TIMEOUT", timeout, "a number of seconds > 0")
        timeout = seconds
    return {"dist_check": bool(_switch(environ, "NUMGUARD_DIST_CHECK")), "dist_timeout": timeout}


def validate(environ=None):
    """Parse every ``NUMGUARD*`` variable once, so that an invalid one fails before any work."""
    environ = os.environ if environ is None else environ
    enabled(environ)
    settings_from_env(environ)
    log_level_from_env(environ)
    dist_settings_from_env(environ)


def resolve_watch_options(passed, environ=None, defaults=None):
    """The watch() options to use: ``passed`` wins, then the variables, then the defaults.

    Args:
        passed: the watch() keyword arguments as the caller gave them; a value of :data:`UNSET`
            (or a missing key) means the caller left it out. Keys the variables do not cover are
            returned unchanged.
        environ: the environment to read (``os.environ`` when None).
        defaults: the defaults for what neither sets (:data:`WATCH_DEFAULTS` when None).

    Returns a new dict holding every key of ``passed`` and of the defaults, none of them UNSET.
    """
    defaults = WATCH_DEFAULTS if defaults is None else defaults
    from_env = settings_from_env(environ)
    options = dict(defaults)
    for key, value in from_env.items():
        if key in options or key in passed:
            options[key] = value
    for key, value in passed.items():
        if value is not UNSET:
            options[key] = value
        elif key not in options:
            raise TypeError(f"watch(): no value and no default for {key!r}")
    return options
