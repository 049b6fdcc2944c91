"""numguard's settings: every ``NUMGUARD_*`` variable, and the options of :func:`numguard.watch`.

``NUMGUARD=1`` switches detection on for a script that never imports numguard (the start-up hook
in :mod:`numguard._startup` does that); the other variables set what :func:`numguard.watch` would
take as arguments, or how numguard's distributed checks, loggers and kernels behave. Arguments
passed to ``watch()`` win; the variables fill in what the arguments leave unset; the defaults in
:data:`WATCH_DEFAULTS` fill in the rest.

:data:`VARIABLES` is the one table of the variables (name, parser, default, meaning, accepted
values); README.md's table is :func:`markdown_table`, and a test keeps the two equal. An unset or
blank variable takes its default. An invalid value raises :class:`EnvironmentSettingError`, which
names the variable, the value and the accepted values (with the reason for any bound).

For ``watch()``'s Python arguments, :func:`validate_watch_options` checks types strictly (a string
is not a list of batch numbers, ``"no"`` is not a bool) and raises :class:`OptionError` naming the
argument, the value and what is accepted. :class:`BatchSet` holds batch numbers as ranges, so
``NUMGUARD_TRACE_BATCHES=1-10000000000`` costs as little as ``1``.

This module imports neither torch nor the rest of numguard: the start-up hook reads it before the
script has imported anything. Every function is pure (it reads the mapping it is given, or
``os.environ``).
"""
import bisect
import collections.abc
import logging
import numbers
import operator
import os
import re
import sys
import textwrap
import types
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["BatchSet", "EnvironmentSettingError", "MAX_BATCH_NUMBER", "MAX_DIST_TIMEOUT_S",
           "MAX_FRAMES_LIMIT", "OptionError", "STDOUT", "UNSET", "VARIABLES", "WATCH_DEFAULTS",
           "WATCH_OPTIONS", "WATCH_VALIDATORS", "Variable", "WatchOption", "backend_choice",
           "cpu_isa_choice", "dist_settings_from_env", "dist_timeout_argument", "enabled",
           "log_level_argument", "log_level_from_env", "markdown_table", "options_doc",
           "options_markdown_table", "parse_batch_list", "read", "resolve_watch_options",
           "settings_from_env", "validate", "validate_watch_options", "variable"]

# Bounds, each with the reason the error message gives.
MAX_FRAMES_LIMIT = 1_000_000
_MAX_FRAMES_WHY = (f"the device ring preallocates 8 records of 64 bytes per kept frame: "
                   f"{MAX_FRAMES_LIMIT} frames already take 512 MB")
MAX_BATCH_NUMBER = 2 ** 53 - 1
_MAX_BATCH_WHY = "2**53-1, the largest whole number a JSON dump keeps exact for every reader"
MAX_DIST_TIMEOUT_S = 86400.0
MIN_DIST_TIMEOUT_S = 0.001
_TIMEOUT_WHY = (f"from {MIN_DIST_TIMEOUT_S:g} (collectives wait in whole milliseconds) to "
                f"{MAX_DIST_TIMEOUT_S:g} (one day; a rank missing for longer is a hang)")
MAX_LOG_LEVEL = logging.CRITICAL
_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_LOG_LEVEL_ACCEPTED = (", ".join(_LOG_LEVELS) + f" (any case) or a whole number from 0 to {MAX_LOG_LEVEL} "
                       "(logging's levels run from NOTSET=0 to CRITICAL=50)")
# Listing batches one by one (a list, a generator) costs memory per batch; ranges do not.
_MAX_LISTED_BATCHES = 1_000_000


class EnvironmentSettingError(ValueError):
    """A ``NUMGUARD_*`` variable holds a value numguard does not accept.

    Attributes: ``variable`` (the name), ``value`` (the text as set), ``accepted`` (what is).
    """

    def __init__(self, name, value, accepted):
        self.variable, self.value, self.accepted = name, value, accepted
        super().__init__(f"{name}={value!r} is not valid: accepted values are {accepted}. "
                         f"Fix or unset {name}.")


class OptionError(TypeError, ValueError):
    """A Python argument (a ``watch()`` option, ``timeout=``, ``log_level=``) has a wrong type or
    value. Both a TypeError and a ValueError, so either ``except`` catches it.

    Attributes: ``option`` (the argument's name), ``value``, ``accepted`` (what is).
    """

    def __init__(self, option, value, accepted, where="numguard.watch"):
        self.option, self.value, self.accepted = option, value, accepted
        prefix = f"{where}: " if where else ""
        super().__init__(f"{prefix}{option}={_short_repr(value)} is not valid: {accepted}.")


def _short_repr(value, limit=80):
    """repr() for an error message: a huge list or string must not flood the message."""
    try:
        text = repr(value)
    except Exception:  # a broken __repr__ must not hide the real error
        text = f"<{type(value).__name__} object>"
    return text if len(text) <= limit else text[:limit - 3] + "..."


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


class _Stdout:
    """Default ``report_to``: writes to whatever ``sys.stdout`` is when a report is printed (so
    pytest's capture, or a script that swaps sys.stdout, sees it), not the one at watch() time."""

    def write(self, text):
        stream = sys.stdout
        return stream.write(text) if stream is not None else len(text)

    def flush(self):
        stream = sys.stdout
        if stream is not None:
            stream.flush()

    def __repr__(self):
        return "numguard.env.STDOUT"


STDOUT = _Stdout()


# ------------------------------------------------------------------------------------------------
# Batch numbers


def _batch_number(value):
    """A batch number from a Python value: an int (not a bool) from 0 to MAX_BATCH_NUMBER."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"batch numbers are ints, got {_short_repr(value)} ({type(value).__name__})")
    number = int(value)
    if not 0 <= number <= MAX_BATCH_NUMBER:
        raise ValueError(f"batch number {number} is out of range: batch numbers run from 0 to "
                         f"{MAX_BATCH_NUMBER} ({_MAX_BATCH_WHY})")
    return number


def _merge(intervals):
    """Sorted, disjoint, non-adjacent inclusive intervals covering the given ones."""
    merged = []
    for lo, hi in sorted(intervals):
        if merged and lo <= merged[-1][1] + 1:
            if hi > merged[-1][1]:
                merged[-1][1] = hi
        else:
            merged.append([lo, hi])
    return tuple(m[0] for m in merged), tuple(m[1] for m in merged)


_BATCH_PART = re.compile(r"([0-9]+)(?:\s*-\s*([0-9]+))?")
BATCH_TEXT_ACCEPTED = "batch numbers (>= 0) and ranges separated by commas, e.g. 1,3,10-12"


class BatchSet:
    """An immutable set of batch numbers, held as sorted ranges.

    ``n in batches`` is a binary search over the ranges and the size of a range costs nothing, so
    ``BatchSet.parse("0-10000000000")`` is as cheap as ``BatchSet([0])``. Iterating yields the
    numbers in increasing order; a set of more than 1,000,000 numbers refuses to be listed (test
    membership with ``in`` or walk :meth:`ranges`).

    Build one from batch numbers (a list, a ``range``, another BatchSet; ``None`` is empty) or
    from text with :meth:`parse`. A string is refused by the constructor: ``BatchSet("12")`` would
    otherwise be read as the characters ``"1"`` and ``"2"``.
    """

    __slots__ = ("_lo", "_hi")

    def __init__(self, batches=None):
        if batches is None:
            self._lo, self._hi = (), ()
        elif isinstance(batches, BatchSet):
            self._lo, self._hi = batches._lo, batches._hi
        elif isinstance(batches, (str, bytes, bytearray)):
            raise TypeError(f"BatchSet takes batch numbers, not text {_short_repr(batches)}: use "
                            "BatchSet.parse('1,3,10-12') for text")
        elif isinstance(batches, range):
            self._lo, self._hi = _merge(self._range_intervals(batches))
        else:
            try:
                items = iter(batches)
            except TypeError:
                raise TypeError(f"BatchSet takes an iterable of batch numbers, got "
                                f"{_short_repr(batches)} ({type(batches).__name__})") from None
            intervals = []
            for count, item in enumerate(items):
                if count == _MAX_LISTED_BATCHES:
                    raise ValueError(f"more than {_MAX_LISTED_BATCHES} batch numbers listed one by "
                                     "one: pass a range (range(a, b)) or BatchSet.parse('a-b'), "
                                     "which cost nothing per batch")
                number = _batch_number(item)
                intervals.append((number, number))
            self._lo, self._hi = _merge(intervals)

    @staticmethod
    def _range_intervals(r):
        if len(r) == 0:
            return []
        first, last = _batch_number(min(r[0], r[-1])), _batch_number(max(r[0], r[-1]))
        if abs(r.step) == 1:
            return [(first, last)]
        if len(r) > _MAX_LISTED_BATCHES:
            raise ValueError(f"{r!r} holds {len(r)} batches with step {r.step}: at most "
                             f"{_MAX_LISTED_BATCHES} from a range with a step other than 1")
        return [(n, n) for n in r]

    @classmethod
    def parse(cls, text):
        """``"1,3,10-12"`` -> the set {1, 3, 10, 11, 12}. Blank text is the empty set; empty parts
        (``"1,,2"``, a trailing comma) are skipped. Only ASCII digits count as digits.

        Raises ValueError naming the bad part and what is accepted."""
        if not isinstance(text, str):
            raise TypeError(f"BatchSet.parse takes text, got {_short_repr(text)}")
        intervals = []
        for part in text.split(","):
            part = part.strip()
            if not part:
                continue
            match = _BATCH_PART.fullmatch(part)
            if match is None:
                raise ValueError(f"{part!r} is not a batch number or a range such as 10-12 "
                                 "(digits 0-9 only)")
            low, high = match.group(1), match.group(2) or match.group(1)
            if len(low) > 16 or len(high) > 16 or int(high) > MAX_BATCH_NUMBER:
                raise ValueError(f"{part!r} is out of range: batch numbers run up to "
                                 f"{MAX_BATCH_NUMBER} ({_MAX_BATCH_WHY})")
            first, last = int(low), int(high)
            if last < first:
                raise ValueError(f"{part!r} is an empty range (it ends before it starts); write "
                                 f"{last}-{first}")
            intervals.append((first, last))
        self = cls.__new__(cls)
        self._lo, self._hi = _merge(intervals)
        return self

    def __contains__(self, number):
        try:
            number = operator.index(number)
        except TypeError:
            return False
        i = bisect.bisect_right(self._lo, number) - 1
        return i >= 0 and number <= self._hi[i]

    def __iter__(self):
        # Listing 10**10 numbers would hang the caller: refuse up front and point at `in`/ranges().
        if len(self) > _MAX_LISTED_BATCHES:
            raise ValueError(f"{self!r} holds {len(self)} batches: more than {_MAX_LISTED_BATCHES} "
                             "batch numbers to list one by one; test `n in batches` or use "
                             ".ranges() instead")
        return (n for lo, hi in zip(self._lo, self._hi) for n in range(lo, hi + 1))

    def __len__(self):
        return sum(hi - lo + 1 for lo, hi in zip(self._lo, self._hi))

    def __bool__(self):
        return bool(self._lo)

    def __eq__(self, other):
        if not isinstance(other, BatchSet):
            return NotImplemented
        return (self._lo, self._hi) == (other._lo, other._hi)

    def __hash__(self):
        return hash((self._lo, self._hi))

    def ranges(self):
        """The set as sorted, disjoint ``range`` objects (step 1)."""
        return tuple(range(lo, hi + 1) for lo, hi in zip(self._lo, self._hi))

    def __str__(self):
        return ",".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in zip(self._lo, self._hi))

    def __repr__(self):
        return f"BatchSet.parse({str(self)!r})"


# ------------------------------------------------------------------------------------------------
# The variables


class _Invalid(Exception):
    """A parser's rejection; the caller turns it into EnvironmentSettingError."""

    def __init__(self, accepted=None):
        super().__init__(accepted)
        self.accepted = accepted


@dataclass(frozen=True)
class Variable:
    """One ``NUMGUARD_*`` variable.

    Attributes:
        name: the variable.
        meaning: what it does, as README.md's table says it (markdown).
        accepted: the accepted values, as an error message gives them (with each bound's reason).
        parse: text -> value; raises _Invalid. Gets the text stripped of surrounding blanks,
            unless ``strip`` is False.
        default: the value when the variable is unset or blank.
        option: the watch() argument it sets, or None.
        strip: False when a program other than Python reads the raw value (the C++ kernels), so
            that Python accepts exactly what that program accepts.
    """

    name: str
    meaning: str
    accepted: str
    parse: Callable[[str], Any]
    default: Any = None
    option: str = None
    strip: bool = True


def _switch(text):
    if text not in ("0", "1"):
        raise _Invalid()
    return text == "1"


def _whole(minimum, maximum, why):
    """Parser of a whole number in [minimum, maximum]: ASCII digits only (no sign, no exponent,
    no '_', no other scripts' digits), so the number read is the number written."""
    accepted = f"a whole number (digits 0-9) from {minimum} to {maximum} ({why})"

    def parse(text):
        if not re.fullmatch(r"[0-9]+", text):
            raise _Invalid(accepted)
        # Compare lengths first: int() of a 5000-digit string is refused by Python itself.
        if len(text.lstrip("0")) > len(str(maximum)) or not minimum <= int(text) <= maximum:
            raise _Invalid(accepted)
        return int(text)

    parse.accepted = accepted
    return parse


def _choice(*choices):
    def parse(text):
        if text.lower() not in choices:
            raise _Invalid()
        return text.lower()

    return parse


def _batches(text):
    try:
        return BatchSet.parse(text)
    except ValueError as exc:
        raise _Invalid(f"{BATCH_TEXT_ACCEPTED}; {exc}") from None


_DECIMAL = re.compile(r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


def _seconds(text):
    # ASCII decimal only: float() would also take 'nan', 'inf', '1_0' and other scripts' digits.
    if not _DECIMAL.fullmatch(text):
        raise _Invalid()
    seconds = float(text)
    if not MIN_DIST_TIMEOUT_S <= seconds <= MAX_DIST_TIMEOUT_S:
        raise _Invalid()
    return seconds


def _log_level(text):
    if text.upper() in _LOG_LEVELS:
        return getattr(logging, text.upper())
    if re.fullmatch(r"[0-9]{1,3}", text) and int(text) <= MAX_LOG_LEVEL:
        return int(text)
    raise _Invalid()


def _path(text):
    return text


# ------------------------------------------------------------------------------------------------
# Python arguments


def _integer(option, value, minimum, maximum, why, also=""):
    accepted = f"pass an int from {minimum} to {maximum} ({why}){also}"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise OptionError(option, value, accepted + f", not a {type(value).__name__}")
    if not minimum <= int(value) <= maximum:
        raise OptionError(option, value, accepted)
    return int(value)


def _max_frames(value):
    return _integer("max_frames_to_save", value, 1, MAX_FRAMES_LIMIT, _MAX_FRAMES_WHY)


def _check_every(value):
    return _integer("check_every", value, 1, MAX_BATCH_NUMBER, _MAX_BATCH_WHY)


def _abort_after(value):
    if value is None:
        return None
    return _integer("abort_after_batch_num", value, 0, MAX_BATCH_NUMBER,
                    _MAX_BATCH_WHY, also=", or None to never abort")


def _trace_batches(value):
    if isinstance(value, (str, bytes, bytearray)):
        raise OptionError("trace_batch_nums", value,
                          "pass batch numbers as ints, e.g. [1, 12] or range(10, 20) (a string would "
                          "be read character by character); for text such as '1,3,10-12' use "
                          "numguard.env.BatchSet.parse or NUMGUARD_TRACE_BATCHES")
    if value is not None and (not isinstance(value, collections.abc.Collection)
                              or isinstance(value, collections.abc.Mapping)):
        # A generator or a file is iterable too, but nobody means batch numbers by one.
        raise OptionError("trace_batch_nums", value, "pass a list, tuple, set or range of batch "
                                                     "numbers, or None")
    try:
        return BatchSet(value)
    except (TypeError, ValueError) as exc:
        raise OptionError("trace_batch_nums", value, f"pass a list, tuple, set or range of ints "
                                                     f"from 0 to {MAX_BATCH_NUMBER}, or None ({exc})") from None


def _flag(option):
    def check(value):
        if isinstance(value, bool):
            return value
        if type(value) is int and value in (0, 1):
            return bool(value)
        raise OptionError(option, value, "pass True or False (or 1/0); a string such as 'no' or "
                                         "'False' would count as true")
    return check


def _one_of(option, choices):
    def check(value):
        if not isinstance(value, str) or value not in choices:
            raise OptionError(option, value, "use " + " or ".join(repr(c) for c in choices) + " (any case)")
        return value
    return check


def _as_float(value):
    """float(value), or nan for an int too large for a float (so that range checks refuse it)."""
    try:
        return float(value)
    except OverflowError:
        return float("nan")


def _headroom(value):
    accepted = "pass a number from 0 (off) up to, not including, 1: the fraction of the dtype's " \
               "largest finite value that triggers a headroom warning"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise OptionError("headroom", value, accepted)
    number = _as_float(value)
    if not 0.0 <= number < 1.0:  # also refuses nan
        raise OptionError("headroom", value, accepted)
    return number


def _dump_dir(value):
    if value is None:
        return None
    accepted = "pass a folder path (str or os.PathLike), or None for the current folder"
    if not isinstance(value, (str, os.PathLike)):
        raise OptionError("dump_dir", value, accepted)
    path = os.fspath(value)
    if not isinstance(path, str) or not path.strip():  # bytes paths, blank paths
        raise OptionError("dump_dir", value, accepted)
    return value


def _report_to(value):
    if value is None or callable(getattr(value, "write", None)):
        return value
    if callable(value) and not isinstance(value, (str, bytes)):
        return value
    raise OptionError("report_to", value, "pass a file object (with .write, e.g. sys.stderr), a "
                                          "callable taking the report text, or None for nowhere")


def _replicas(value):
    return _integer("replicas", value, 0, MAX_BATCH_NUMBER, _MAX_BATCH_WHY,
                    also=": check the replicas every N steps, or 0 to turn the check off")


def _spikes(value):
    if value is True or value is False or (type(value) is int and value in (0, 1)):
        return "warn" if value else False
    if value in ("warn", "raise"):
        return value
    raise OptionError("spikes", value, "use True (or \"warn\"), \"raise\" or False (any case)")


def _spikes_text(text):
    if text in ("0", "1"):
        return "warn" if text == "1" else False
    if text.lower() in ("warn", "raise"):
        return text.lower()
    raise _Invalid()


# numguard.schema.QUANT_FORMATS' names (this module imports nothing of numguard; a test keeps them equal).
QUANT_FORMAT_NAMES = ("float8_e4m3fn", "float8_e5m2", "mxfp8_e4m3", "mxfp8_e5m2", "nvfp4")
_QUANT_ACCEPTED = "use one of " + ", ".join(repr(n) for n in QUANT_FORMAT_NAMES) + " (any case), or None / False (off)"


def _quant(value):
    if value is None or value is False or (type(value) is int and value == 0):
        return None
    if isinstance(value, str) and value in QUANT_FORMAT_NAMES:
        return value
    raise OptionError("quant", value, _QUANT_ACCEPTED)


def _quant_text(text):
    if text == "0":
        return None
    if text.lower() in QUANT_FORMAT_NAMES:
        return text.lower()
    raise _Invalid()


MAX_GROUP_RANKS = 1 << 20  # a list of ranks longer than this is not a group of this job


def _amax_group(value):
    """None, a process group (anything with size() and rank(): torch.distributed's), or global ranks
    (a tuple, sorted, without repeats)."""
    if value is None:
        return None
    if callable(getattr(value, "size", None)) and callable(getattr(value, "rank", None)) \
            and not isinstance(value, (str, bytes, collections.abc.Sequence)):
        return value
    if isinstance(value, (list, tuple, range)) and 0 < len(value) <= MAX_GROUP_RANKS and all(
            isinstance(r, numbers.Integral) and not isinstance(r, bool) and 0 <= r <= MAX_BATCH_NUMBER for r in value):
        return tuple(sorted(set(int(r) for r in value)))
    raise OptionError("amax_group", value, "pass the process group the ranks reduce their fp8 amax over (e.g. the "
                                           "tensor-parallel group), a list of its global ranks, or None")


@dataclass(frozen=True)
class WatchOption:
    """One watch() option, declared once: its name, default, check, meaning and variable. The
    defaults (:data:`WATCH_DEFAULTS`), the checks (:data:`WATCH_VALIDATORS`), the fields of
    ``numguard.inspector.options.WatchOptions``, the Inspector's docstring, the variables' defaults
    and README.md's option table (:func:`options_markdown_table`) all come from these rows.

    Attributes:
        name: the keyword argument.
        default: its value when neither the argument nor its variable is given.
        check: value -> normalized value; raises OptionError naming the option.
        doc: what it does (markdown; one paragraph).
        variable: the ``NUMGUARD_*`` variable that sets it, or None.
        keywords: the words it takes; a string that is one of them in another case
            (``"SYNC"``, ``"Warn"``, ``"FLOAT8_E4M3FN"``) is taken as that word before ``check``
            sees it, as its variable takes it.
    """

    name: str
    default: Any
    check: Callable[[Any], Any]
    doc: str
    variable: str = None
    keywords: tuple = ()

    def validate(self, value):
        """check(value), a keyword in any case taken as the keyword."""
        if self.keywords and isinstance(value, str) and value.lower() in self.keywords:
            value = value.lower()
        return self.check(value)


def _keyword_option(name, default, keywords, doc, variable=None):
    """The row of an option that takes one of `keywords` (in any case) and nothing else."""
    return WatchOption(name, default, _one_of(name, keywords), doc, variable, keywords)


WATCH_OPTIONS = (
    WatchOption("max_frames_to_save", 21, _max_frames,
                "frames shown in a report (the last ones, ending with the first frame that holds a "
                "non-finite value)", "NUMGUARD_MAX_FRAMES"),
    WatchOption("trace_batch_nums", BatchSet(), _trace_batches,
                "batches whose every frame is printed, in Transformers' trace format",
                "NUMGUARD_TRACE_BATCHES"),
    WatchOption("abort_after_batch_num", None, _abort_after,
                "raise `numguard.errors.AbortAfterBatch` (a ValueError) when this batch has finished",
                "NUMGUARD_ABORT_AFTER"),
    WatchOption("backward", False, _flag("backward"),
                "also watch gradients (numguard.backward)", "NUMGUARD_BACKWARD"),
    _keyword_option("check", "sync", ("sync", "async"),
                "`\"sync\"` (read the trip flag at each checked batch end: one tiny device->host copy) "
                "or `\"async\"` (copy it to pinned memory without waiting and read it at the next "
                "check: healthy batches never wait; a trip is reported one check late)", "NUMGUARD_CHECK"),
    WatchOption("check_every", 1, _check_every,
                "check every N-th batch (records are kept for the batches in between)",
                "NUMGUARD_CHECK_EVERY"),
    _keyword_option("on_trip", "raise", ("raise", "warn", "dump"),
                "`\"raise\"` (numguard.NonFiniteError), `\"warn\"` (NonFiniteWarning, training goes "
                "on) or `\"dump\"` (write a JSON report per rank into `dump_dir`, warn, go on)",
                "NUMGUARD_ON_TRIP"),
    WatchOption("dump_dir", None, _dump_dir,
                "where `on_trip=\"dump\"` writes (None: the current directory)", "NUMGUARD_DUMP_DIR"),
    WatchOption("headroom", 0.5, _headroom,
                "warn once per module when a float16/bfloat16/float8 tensor's abs max passes this "
                "fraction of the dtype's largest finite value (0 turns it off)"),
    WatchOption("report_to", STDOUT, _report_to,
                "where reports and traces are printed: a file object, a callable taking the text, "
                "or None for nowhere (default: sys.stdout at the time of printing)"),
    WatchOption("extras", True, _flag("extras"),
                "also show what Transformers does not (keyword inputs, contents of dict / list / "
                "dataclass outputs, deeper nesting) on lines of their own, and check the running statistics "
                "of normalization layers (numguard.inspector.norm_stats)"),
    _keyword_option("scaler_skips", "count", ("count", "trip"),
                "with backward=True, a step that torch.amp.GradScaler skips for inf/NaN gradients is "
                "`\"count\"`ed (not a trip) or a `\"trip\"` (numguard.backward)"),
    WatchOption("ops", False, _flag("ops"),
                "also record every aten operation the forward runs (numguard.inspector.operations; "
                "slower): a trip names the first operation that made a NaN/Inf and its call site; "
                "with backward=True, the backward's operations too", "NUMGUARD_OPS"),
    WatchOption("replay", False, _flag("replay"),
                "keep each module's last inputs and, after a trip, re-run the first bad module in "
                "operation mode (numguard.inspector.replay): the report names the operation, or says "
                "that the replay did not reproduce the NaN/Inf", "NUMGUARD_REPLAY"),
    WatchOption("replicas", 0, _replicas,
                "every N steps, check that the data-parallel replicas of the parameters and their "
                "gradients are bitwise identical on every rank (numguard.distributed.replicas; 0: off)",
                "NUMGUARD_REPLICA_CHECK"),
    WatchOption("spikes", False, _spikes,
                "find a module's value far outside its own recent range (numguard.inspector.spikes: the "
                "abs max of its outputs, with backward=True of its gradients and the parameter-gradient norms, and "
                "the loss the root returns): "
                "`\"warn\"` (or True) "
                "gives a numguard.SpikeWarning, `\"raise\"` a numguard.SpikeError; False: off",
                "NUMGUARD_SPIKES", ("warn", "raise")),
    WatchOption("quant", None, _quant,
                "measure each module's outputs (and gradients with backward=True) as if cast to this "
                "low-precision format with current scaling (numguard.inspector.quant_watch): "
                "`insp.quant_table()` gives underflow, saturation and MSE per module, `insp.advice()` "
                "names the modules to keep in bf16; one of `\"float8_e4m3fn\"`, `\"float8_e5m2\"`, "
                "`\"mxfp8_e4m3\"`, `\"mxfp8_e5m2\"`, `\"nvfp4\"`; None: off", "NUMGUARD_QUANT",
                QUANT_FORMAT_NAMES),
    WatchOption("amax_group", None, _amax_group,
                "with quant=, the ranks that must see the same amax for every watched tensor (the process group "
                "the fp8 amax is reduced over: tensor parallel, or data parallel where the recipe reduces there; "
                "each rank passes its own group, or a list of its global ranks): a rank whose amax differs from "
                "its group's is named (numguard.distributed.amax; the Megatron-LM #442 failure); None: off"),
    WatchOption("rerun", False, _flag("rerun"),
                "after a trip, run the batch's forward again on the same inputs and device "
                "(numguard.inspector.rerun): the verdict, a numguard.Attribution on the error or warning "
                "(`.attribution`), says whether the fault was `\"transient\"`, `\"device\"` (multi-rank: a "
                "data-parallel peer given the same inputs does not reproduce it) or `\"reproducible\"`",
                "NUMGUARD_RERUN"),
    WatchOption("recover", True, _flag("recover"),
                "with rerun=True, a transient fault found at the root's return (check=\"sync\"; multi-rank: "
                "when every rank that tripped can) is recovered: the rerun's output replaces the corrupted "
                "one and a NonFiniteWarning says so; False: report only"),
)
_OPTIONS = {o.name: o for o in WATCH_OPTIONS}

#: watch()'s defaults, read-only (from :data:`WATCH_OPTIONS`).
WATCH_DEFAULTS = types.MappingProxyType({o.name: o.default for o in WATCH_OPTIONS})
#: option -> check(value) -> normalized value; raises OptionError (from :data:`WATCH_OPTIONS`).
WATCH_VALIDATORS = types.MappingProxyType({o.name: o.validate for o in WATCH_OPTIONS})


def _shown(default):
    """A default as the docs write it."""
    if default is STDOUT:
        return "sys.stdout"
    if isinstance(default, BatchSet) and not default:
        return "[]"
    return repr(default)


def options_doc(indent=8):
    """The ``Args:`` entries of the options, as a docstring holds them (the Inspector's)."""
    out = []
    for o in WATCH_OPTIONS:
        text = f"{o.name}: {o.doc.replace('`', '')}. Default {_shown(o.default)}" + (
            f" (or {o.variable})." if o.variable else ".")
        out.append(textwrap.fill(text, 100, initial_indent=" " * indent,
                                 subsequent_indent=" " * (indent + 4)))
    return "\n".join(out)


def options_markdown_table():
    """README.md's table of watch()'s options (the README holds exactly this text)."""
    rows = ["| option | default | variable | meaning |", "|---|---|---|---|"]
    for o in WATCH_OPTIONS:
        variable = f"`{o.variable}`" if o.variable else ""
        rows.append(f"| `{o.name}` | `{_shown(o.default)}` | {variable} | {o.doc} |")
    return "\n".join(rows) + "\n"


_SWITCH = "0 or 1"
_FRAMES = _whole(1, MAX_FRAMES_LIMIT, _MAX_FRAMES_WHY)
_BATCH_MIN0 = _whole(0, MAX_BATCH_NUMBER, _MAX_BATCH_WHY)
_BATCH_MIN1 = _whole(1, MAX_BATCH_NUMBER, _MAX_BATCH_WHY)
CPU_ISA_CHOICES = ("avx512", "avx2", "baseline")   # csrc/cpu/dispatch.cpp's names
BACKEND_CHOICES = ("auto", "native", "torch")

_OPTION_OF_VARIABLE = {o.variable: o for o in WATCH_OPTIONS if o.variable}


def _setting(name, meaning, accepted, parse, default=None, strip=True):
    """A Variable row; one that sets a watch() option takes that option's default and name
    (its row in WATCH_OPTIONS), never a copy of them."""
    option = _OPTION_OF_VARIABLE.get(name)
    if option is not None:
        return Variable(name, meaning, accepted, parse, option.default, option.name, strip)
    return Variable(name, meaning, accepted, parse, default, None, strip)


VARIABLES = (
    _setting("NUMGUARD", "`0`/unset: off, nothing imported; `1`: on", _SWITCH, _switch, False),
    _setting("NUMGUARD_MAX_FRAMES", f"frames kept in the ring (default {WATCH_DEFAULTS['max_frames_to_save']}, "
             f"at most {MAX_FRAMES_LIMIT})", _FRAMES.accepted, _FRAMES),
    _setting("NUMGUARD_TRACE_BATCHES", "batches to trace, e.g. `1,3,10-12`", BATCH_TEXT_ACCEPTED, _batches),
    _setting("NUMGUARD_ABORT_AFTER", "stop after this batch", _BATCH_MIN0.accepted, _BATCH_MIN0),
    _setting("NUMGUARD_BACKWARD", "`0`/`1`: also watch gradients", _SWITCH, _switch),
    _setting("NUMGUARD_OPS",
             "`0`/`1`: record every aten operation of the forward, and of the backward with "
             "`NUMGUARD_BACKWARD=1` (slower; names the first bad operation)", _SWITCH, _switch),
    _setting("NUMGUARD_CHECK", "`sync` (default) or `async`", "sync or async (any case)",
             _choice("sync", "async")),
    _setting("NUMGUARD_CHECK_EVERY", f"check every N-th batch (default {WATCH_DEFAULTS['check_every']})",
             _BATCH_MIN1.accepted, _BATCH_MIN1),
    _setting("NUMGUARD_ON_TRIP", "`raise` (default), `warn`, `dump`", "raise, warn or dump (any case)",
             _choice("raise", "warn", "dump")),
    _setting("NUMGUARD_DUMP_DIR", "where `dump` writes its JSON files", "a folder path", _path),
    _setting("NUMGUARD_DIST_CHECK",
             "`0`/`1`: check shapes and dtypes before every `torch.distributed` collective", _SWITCH,
             _switch, False),
    _setting("NUMGUARD_DIST_TIMEOUT",
             "seconds before a check names the ranks that never arrived (default 60, at most 86400)",
             f"a decimal number of seconds {_TIMEOUT_WHY}", _seconds, 60.0),
    _setting("NUMGUARD_LOG_LEVEL", "level of numguard's loggers (`DEBUG` to `CRITICAL`, or 0 to 50)",
             _LOG_LEVEL_ACCEPTED, _log_level, None),
    _setting("NUMGUARD_BACKEND",
             "`auto` (default), `native` (fail if the kernels cannot load) or `torch` (fallback)",
             "auto, native or torch (any case)", _choice(*BACKEND_CHOICES), "auto"),
    _setting("NUMGUARD_CPU_ISA",
             "highest instruction set the CPU kernels use: `avx512`, `avx2` or `baseline` "
             "(default: the best the CPU has)",
             "avx512, avx2 or baseline (any case; the C++ kernels read it the same way)",
             _choice(*CPU_ISA_CHOICES), None),
    _setting("NUMGUARD_REPLAY",
             "`0`/`1`: keep each module's last inputs and, after a trip, re-run the first bad module "
             "in operation mode to name the operation", _SWITCH, _switch),
    _setting("NUMGUARD_SPIKES",
             "`0`/`1`/`warn`/`raise`: find a module's value far outside its own recent range (`1`: warn)",
             "0, 1, warn or raise (any case)", _spikes_text),
    _setting("NUMGUARD_QUANT",
             "`0`/unset: off; a format (`float8_e4m3fn`, `float8_e5m2`, `mxfp8_e4m3`, `mxfp8_e5m2`, "
             "`nvfp4`): measure each module's outputs as if cast to it (`quant_table()`)",
             ", ".join(QUANT_FORMAT_NAMES) + " or 0 (any case)", _quant_text),
    _setting("NUMGUARD_RERUN",
             "`0`/`1`: after a trip, rerun the batch's forward on the same inputs to tell a transient "
             "fault from a reproducible one", _SWITCH, _switch),
    # --- cross-rank numerics (numguard.distributed.replicas) ---
    _setting("NUMGUARD_REPLICA_CHECK",
             "every N steps, check that the data-parallel replicas of the parameters and their "
             f"gradients are bitwise identical on every rank (default {WATCH_DEFAULTS['replicas']}: off)",
             _BATCH_MIN0.accepted, _BATCH_MIN0),
)
assert {v.option for v in VARIABLES if v.option} == {o.name for o in _OPTION_OF_VARIABLE.values()}, \
    "an option names a variable that has no row in VARIABLES"
_BY_NAME = {v.name: v for v in VARIABLES}


def _raw(environ, var):
    """The text to parse, or None when the variable is unset or blank."""
    value = environ.get(var.name)
    if not var.strip:  # the C++ reader takes only "" as unset
        return value or None
    if value is None or not value.strip():
        return None
    return value.strip()


def variable(name):
    """The :class:`Variable` called ``name`` (KeyError for a name numguard does not read)."""
    return _BY_NAME[name]


def read(name, environ=None):
    """The value of variable ``name`` (its default when unset or blank).

    Raises EnvironmentSettingError naming the variable, the value and the accepted values."""
    environ = os.environ if environ is None else environ
    var = _BY_NAME[name]
    text = _raw(environ, var)
    if text is None:
        return var.default
    try:
        return var.parse(text)
    except _Invalid as exc:
        raise EnvironmentSettingError(name, environ[name], exc.accepted or var.accepted) from None


def _is_set(environ, name):
    return _raw(environ, _BY_NAME[name]) is not None


def enabled(environ=None):
    """True when ``NUMGUARD`` is 1; False when it is unset, empty or 0."""
    return read("NUMGUARD", environ)


def settings_from_env(environ=None):
    """The watch() keyword arguments the ``NUMGUARD_*`` variables set (only those that are set).

    >>> settings_from_env({"NUMGUARD_MAX_FRAMES": "5", "NUMGUARD_TRACE_BATCHES": "1,3-4"})
    {'max_frames_to_save': 5, 'trace_batch_nums': BatchSet.parse('1,3-4')}
    """
    environ = os.environ if environ is None else environ
    return {v.option: read(v.name, environ) for v in VARIABLES
            if v.option is not None and _is_set(environ, v.name)}


def log_level_from_env(environ=None):
    """The level ``NUMGUARD_LOG_LEVEL`` sets for numguard's loggers (a ``logging`` int), or None."""
    return read("NUMGUARD_LOG_LEVEL", environ)


def dist_settings_from_env(environ=None):
    """``{"dist_check": bool, "dist_timeout": seconds or None (unset)}`` from NUMGUARD_DIST_*."""
    environ = os.environ if environ is None else environ
    timeout = read("NUMGUARD_DIST_TIMEOUT", environ) if _is_set(environ, "NUMGUARD_DIST_TIMEOUT") else None
    return {"dist_check": read("NUMGUARD_DIST_CHECK", environ), "dist_timeout": timeout}


def backend_choice(environ=None):
    """``NUMGUARD_BACKEND``: "auto" (default), "native" or "torch"."""
    return read("NUMGUARD_BACKEND", environ)


def cpu_isa_choice(environ=None):
    """``NUMGUARD_CPU_ISA``: "avx512", "avx2", "baseline", or None (unset: the best available)."""
    return read("NUMGUARD_CPU_ISA", environ)


def validate(environ=None):
    """Parse every variable once, so that an invalid one fails before any work. Returns
    ``{name: value}`` for every variable (defaults for the unset ones)."""
    environ = os.environ if environ is None else environ
    return {v.name: read(v.name, environ) for v in VARIABLES}


def parse_batch_list(text, name="NUMGUARD_TRACE_BATCHES"):
    """``"1,3,10-12"`` -> ``BatchSet`` {1, 3, 10, 11, 12}; an invalid text raises
    EnvironmentSettingError naming ``name``."""
    try:
        return _batches(text)
    except _Invalid as exc:
        raise EnvironmentSettingError(name, text, exc.accepted) from None


def markdown_table():
    """README.md's table of the variables (the README holds exactly this text)."""
    rows = ["| variable | meaning |", "|---|---|"]
    rows += [f"| `{v.name}` | {v.meaning} |" for v in VARIABLES]
    return "\n".join(rows) + "\n"




def validate_watch_options(options):
    """Check watch() options strictly; returns a new dict with normalized values (ints as int,
    trace_batch_nums as a BatchSet, headroom as float, 0/1 flags as bool). Keys numguard.env
    does not know pass through unchanged. Raises OptionError naming the first bad option."""
    return {key: WATCH_VALIDATORS[key](value) if key in WATCH_VALIDATORS else value
            for key, value in options.items()}


def resolve_watch_options(passed, environ=None, defaults=None):
    """The watch() options to use: ``passed`` wins, then the variables, then the defaults; then
    :func:`validate_watch_options`.

    Args:
        passed: the watch() keyword arguments as the caller gave them; a value of :data:`UNSET`
            (or a missing key) means the caller left it out. Keys the variables do not cover are
            returned unchanged.
        environ: the environment to read (``os.environ`` when None).
        defaults: the defaults for what neither sets (:data:`WATCH_DEFAULTS` when None).

    Returns a new dict holding every key of ``passed`` and of the defaults, none of them UNSET.
    An invalid variable raises EnvironmentSettingError even when the argument is passed.
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
    return validate_watch_options(options)


def dist_timeout_argument(value, option="timeout"):
    """A ``timeout=`` argument of numguard.distributed, in seconds (a float)."""
    accepted = f"pass a number of seconds {_TIMEOUT_WHY}"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise OptionError(option, value, accepted, where="")
    seconds = _as_float(value)
    if not MIN_DIST_TIMEOUT_S <= seconds <= MAX_DIST_TIMEOUT_S:  # also refuses nan
        raise OptionError(option, value, accepted, where="")
    return seconds


def log_level_argument(value, option="log_level"):
    """A ``log_level=`` argument: a level name (any case) or an int from 0 to 50."""
    if isinstance(value, str):
        try:
            return _log_level(value.strip())
        except _Invalid:
            pass
    elif isinstance(value, numbers.Integral) and not isinstance(value, bool) \
            and 0 <= int(value) <= MAX_LOG_LEVEL:
        return int(value)
    raise OptionError(option, value, "use " + _LOG_LEVEL_ACCEPTED, where="")

