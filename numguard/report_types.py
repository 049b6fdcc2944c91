"""A trip's report as types, without torch: the report, its frames and their lines, and the parts
features add (the operation, the first fault across ranks, the history, the replay, the rerun, the
outliers, the framework's step).

Each type declares its JSON fields once (``_field``: the key, how a value is checked, whether it
must be there), and that one declaration reads (``from_json``), writes (``to_json``) and checks
(numguard.dump) a report. ``to_json`` writes the keys the inspector writes, in the same order, so
a dump file holds the same bytes whether it was written from a type or a dictionary. A key the
file does not have reads as ``ABSENT`` and is not written back; keys no type declares are ignored.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Optional

from .errors import VERDICTS
from .schema import LINE_KINDS, STAT_FIELDS, LineKind

FORMAT = "numguard-report"
VERSION = 1
MISSING = "missing; the file is damaged or not a numguard dump"

__all__ = ["ABSENT", "FORMAT", "VERSION", "ReportFieldError", "Report", "ReportFrame", "ReportLine",
           "Operation", "FirstFault", "FrameworkStep", "History", "ModuleHistory", "HISTORY_SERIES",
           "QuantRow", "QuantTable",
           "Replay", "Rerun", "Outlier"]


class ReportFieldError(ValueError):
    """A report object that does not follow the types. ``where``: the field (``"frames[3].records[2]"``,
    "" for the whole object); ``problem``: what is wrong there."""

    def __init__(self, where, problem):
        self.where, self.problem = where, problem
        super().__init__(f"{where}: {problem}" if where else problem)


class _Absent:
    """A field the JSON object does not have (falsy; never written)."""
    __slots__ = ()

    def __repr__(self):
        return "ABSENT"

    def __bool__(self):
        return False


ABSENT = _Absent()


def show(value, limit=60):
    """How an error shows a bad value: its repr (shortened), and a list's length."""
    text = repr(value)
    if len(text) > limit:
        text = text[:limit - 3] + "..."
    if isinstance(value, list):
        text += f" (a list of {len(value)})"
    return text


# ------------------------------------------------------------------------------------------------
# How a field's value is checked and converted.


@dataclasses.dataclass(frozen=True)
class Value:
    """A plain JSON value: `expected` in words, `test` of the JSON value; `decode`/`encode`
    convert between the JSON value and the typed one (None: the same)."""
    expected: str
    test: Callable[[Any], bool]
    decode: Optional[Callable] = None
    encode: Optional[Callable] = None

    def read(self, value, where):
        if not self.test(value):
            raise ReportFieldError(where, f"expected {self.expected}, got {show(value)}")
        return value if self.decode is None else self.decode(value)

    def write(self, value):
        return value if self.encode is None else self.encode(value)


@dataclasses.dataclass(frozen=True)
class Part:
    """A JSON object read as one of the report types."""
    type: type
    expected: str = "an object"

    def read(self, value, where):
        if not isinstance(value, dict):
            raise ReportFieldError(where, f"expected {self.expected}, got {show(value)}")
        return self.type.from_json(value, where)

    @staticmethod
    def write(value):
        return value.to_json()


@dataclasses.dataclass(frozen=True)
class ListOf:
    """A JSON list, each entry read by `item`."""
    item: Any
    expected: str = "a list"
    min_length: int = 0

    def read(self, value, where):
        if not isinstance(value, list) or len(value) < self.min_length:
            raise ReportFieldError(where, f"expected {self.expected}, got {show(value)}")
        return [self.item.read(v, f"{where}[{i}]") for i, v in enumerate(value)]

    def write(self, value):
        return [self.item.write(v) for v in value]


@dataclasses.dataclass(frozen=True)
class Lines:
    """A frame's lines: one JSON list per ReportLine field (``labels``, ``kinds``, ...), all of the
    same length, each entry read by that field's Value."""

    def read_from(self, obj, prefix, where):
        columns = {}
        # Required columns first: a file's first problem is named in the order dumps always checked.
        for name, key, spec, required in sorted(_layout(ReportLine), key=lambda field: not field[3]):
            if key not in obj:
                if required:
                    raise ReportFieldError(prefix + key, MISSING)
                continue
            values = obj[key]
            if not isinstance(values, list):
                raise ReportFieldError(prefix + key, f"expected a list with one entry per line, got {show(values)}")
            columns[name] = (key, [spec.read(v, f"{prefix}{key}[{i}]") for i, v in enumerate(values)])
        lengths = {key: len(values) for key, values in columns.values()}
        if len(set(lengths.values())) > 1:
            counts = ", ".join(f"{key} has {n}" for key, n in lengths.items())
            raise ReportFieldError(where, f"the per-line lists differ in length ({counts}); "
                                          "each line needs one entry in each")
        count = next(iter(lengths.values()))
        return tuple(ReportLine(**{name: values[i] for name, (_, values) in columns.items()})
                     for i in range(count))

    @staticmethod
    def write_into(out, lines):
        for name, key, spec, _ in _layout(ReportLine):
            out[key] = [spec.write(getattr(line, name)) for line in lines]


def _field(spec, *, key=None, required=False, default=ABSENT):
    """A report field: its JSON `key` (default: the attribute's name) read by `spec`; a required
    one without a default must be given."""
    metadata = {"spec": spec, "key": key, "required": required}
    if required and default is ABSENT:
        return dataclasses.field(metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


@functools.lru_cache(maxsize=None)
def _layout(cls):
    """(attribute, JSON key, spec, required) of each field of a report type, in JSON order."""
    return tuple((f.name, f.metadata["key"] or f.name, f.metadata["spec"], f.metadata["required"])
                 for f in dataclasses.fields(cls))


class _JsonObject:
    """Reading and writing of a report type from its field declarations."""

    @classmethod
    def from_json(cls, data: dict, where: str = ""):
        """The typed object of the JSON object `data` (as json.load gives it); ReportFieldError
        names the first field that is missing or of the wrong type. `where`: the place of `data`
        in its report, for the errors (``"frames[2]"``)."""
        if not isinstance(data, dict):
            raise ReportFieldError(where, f"expected an object, got {type(data).__name__} {show(data)}")
        prefix = f"{where}." if where else ""
        values = {}
        for name, key, spec, required in _layout(cls):
            if isinstance(spec, Lines):
                values[name] = spec.read_from(data, prefix, where)
            elif key in data:
                values[name] = spec.read(data[key], prefix + key)
            elif required:
                raise ReportFieldError(prefix + key, MISSING)
        return cls(**values)

    def to_json(self) -> dict:
        """The JSON object (plain dicts and lists), keys in the order the inspector writes them."""
        out = {}
        for name, key, spec, _ in _layout(type(self)):
            value = getattr(self, name)
            if isinstance(spec, Lines):
                spec.write_into(out, value)
            elif value is not ABSENT:
                out[key] = spec.write(value)
        return out


# ------------------------------------------------------------------------------------------------
# Values.


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _or_null(check):
    return lambda v: v is None or check(v)


def _count(v):  # a record's counts: whole, finite, >= 0 (JSON may write them as 3.0)
    return _is_number(v) and math.isfinite(v) and v >= 0 and float(v).is_integer()


def _is_record(v):
    return v is None or (isinstance(v, list) and len(v) == len(STAT_FIELDS)
                         and all(_is_number(x) for x in v[:3]) and all(_count(x) for x in v[3:]))


def _is_shape(v):
    return isinstance(v, list) and all(_is_int(d) and d >= 0 for d in v)


STR = Value("a string", lambda v: isinstance(v, str))
STR_OR_NULL = Value("a string or null", _or_null(lambda v: isinstance(v, str)))
BOOL = Value("true or false", lambda v: isinstance(v, bool))
BOOL_OR_NULL = Value("true, false or null", _or_null(lambda v: isinstance(v, bool)))
INT = Value("a whole number", _is_int)
INT_OR_NULL = Value("a whole number or null", _or_null(_is_int))
BATCH = Value("a whole number >= 0", lambda v: _is_int(v) and v >= 0)
BATCH_OR_NULL = Value("a whole number >= 0 or null", _or_null(BATCH.test))
POSITIVE = Value("a whole number >= 1", lambda v: _is_int(v) and v >= 1)
NUMBER = Value("a number", _is_number)
NUMBER_OR_NULL = Value("a number or null", _or_null(_is_number))
ANY = Value("any value", lambda v: True)
RANK_PAIR = Value("a [rank, module or null] pair",
                  lambda v: isinstance(v, list) and len(v) == 2 and _is_int(v[0]) and STR_OR_NULL.test(v[1]))
LINE_KIND = Value("'tensor', 'none' or 'not a tensor'", lambda v: v in LINE_KINDS,
                  decode=LineKind.named, encode=lambda kind: kind.report_name)
RECORD = Value("8 numbers or null (abs_min, abs_max, min_nonzero, then 5 counts >= 0)", _is_record)
SHAPE = Value("a list of whole numbers >= 0, or null", _or_null(_is_shape))
VERDICT = Value(f"one of {', '.join(map(repr, VERDICTS))} or null", lambda v: v is None or v in VERDICTS)
SERIES = ListOf(NUMBER_OR_NULL)


# ------------------------------------------------------------------------------------------------
# The report's parts.


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReportLine(_JsonObject):
    """One line of a frame: a weight, an input, an output, a keyword input or a container's entry.
    `record`: the stats record (schema.STAT_FIELDS) of a tensor line, else None; `extra`: a line
    Transformers does not print."""
    label: str = _field(STR, key="labels", required=True)
    kind: LineKind = _field(LINE_KIND, key="kinds", required=True)
    extra: bool = _field(BOOL, default=False)
    dtype: Optional[str] = _field(STR_OR_NULL, key="dtypes", default=None)
    shape: Optional[list] = _field(SHAPE, key="shapes", default=None)
    record: Optional[list] = _field(RECORD, key="records", required=True)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReportFrame(_JsonObject):
    """One module call (or record_frame call, or operation with ops=True), oldest first in a report.
    `batch_start`: Transformers' "*** Starting batch number=N ***" before it; `hf`: a frame
    Transformers prints; `in_report`: among the frames the text shows; `offender`: the last frame,
    the one that tripped; `op`, `site`, `backward_of`: an operation frame's aten op, call site and
    autograd node."""
    name: str = _field(STR, required=True)
    class_name: str = _field(STR, key="class", required=True)
    section: str = _field(STR)
    batch: Optional[int] = _field(BATCH_OR_NULL)
    batch_start: Optional[int] = _field(BATCH_OR_NULL)
    hf: bool = _field(BOOL)
    lines: tuple = _field(Lines(), required=True)
    op: str = _field(STR)
    site: str = _field(STR)
    backward_of: str = _field(STR)
    in_report: bool = _field(BOOL)
    offender: bool = _field(BOOL)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Operation(_JsonObject):
    """The operation that made the first NaN/Inf (watch(ops=True)), the module that ran it, and
    the largest input and the output as ``x.abs().max()`` shows them."""
    op: str = _field(STR)
    module: Optional[str] = _field(STR_OR_NULL)
    class_name: str = _field(STR, key="class")
    site: str = _field(STR)
    backward_of: Optional[str] = _field(STR_OR_NULL)
    input_abs_max: Optional[float] = _field(NUMBER_OR_NULL)
    output_abs_max: Optional[float] = _field(NUMBER_OR_NULL)


@dataclasses.dataclass(frozen=True, kw_only=True)
class FirstFault(_JsonObject):
    """The earliest NaN/Inf across ranks (`kind`: one of schema.FAULT_KINDS or None); `this_rank`
    false: this rank's own came later, carried by a collective."""
    rank: int = _field(INT, required=True)
    module: Optional[str] = _field(STR_OR_NULL)
    labels: list = _field(ListOf(STR))
    kind: Optional[str] = _field(STR_OR_NULL)
    batch: Optional[int] = _field(INT_OR_NULL)
    this_rank: bool = _field(BOOL)


@dataclasses.dataclass(frozen=True, kw_only=True)
class FrameworkStep(_JsonObject):
    """A training framework's step counter at the trip (its name and value)."""
    name: str = _field(STR)
    value: Any = _field(ANY)


# The per-batch series of a module's history: the columns of the inspector's history table, in its
# order (numguard.inspector.history indexes them), each a ModuleHistory field.
HISTORY_SERIES = ("out_abs_max", "in_abs_max", "min_nonzero", "grad_abs_max", "grad_min_nonzero",
                  "grad_subnormal_share")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModuleHistory(_JsonObject):
    """One module's values over the history's batches (None where it has none)."""
    name: str = _field(STR)
    class_name: str = _field(STR, key="class")
    dtype: Optional[str] = _field(STR_OR_NULL)
    grad_dtype: Optional[str] = _field(STR_OR_NULL)
    out_abs_max: list = _field(SERIES)
    in_abs_max: list = _field(SERIES)
    min_nonzero: list = _field(SERIES)
    grad_abs_max: list = _field(SERIES)
    grad_min_nonzero: list = _field(SERIES)
    grad_subnormal_share: list = _field(SERIES)


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantRow(_JsonObject):
    """One row of watch(quant=...)'s what-if table: a module's quantity ("output", "grad_output"),
    its underflow and saturated fractions of the non-zero elements, MSE, and batches measured. A
    real float8 cast's row ("real output") names its `format`, and its MSE is null."""
    module: str = _field(STR, required=True)
    quantity: str = _field(STR, required=True)
    underflow: float = _field(NUMBER)
    saturated: float = _field(NUMBER)
    mse: Optional[float] = _field(NUMBER_OR_NULL)
    batches: int = _field(BATCH)
    format: Optional[str] = _field(STR_OR_NULL)
    series: list = _field(SERIES)   # its underflow fraction in each of the table's batches


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantTable(_JsonObject):
    """watch(quant=...)'s what-if: the format and its table, worst first (Inspector.quant_table())."""
    format: str = _field(STR, required=True)
    batches: list = _field(ListOf(INT))   # the batches of the rows' series, oldest first
    rows: list = _field(ListOf(Part(QuantRow)))


@dataclasses.dataclass(frozen=True, kw_only=True)
class History(_JsonObject):
    """The per-module history precision advice reads (batches oldest first), and the loss scale the
    gradients were seen at ("GradScaler", or "assumed" 1)."""
    window: int = _field(BATCH)
    batches: list = _field(ListOf(INT))
    modules: list = _field(ListOf(Part(ModuleHistory)))
    loss_scale: Optional[float] = _field(NUMBER_OR_NULL)
    loss_scale_source: str = _field(STR)
    quant: QuantTable = _field(Part(QuantTable))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Replay(_JsonObject):
    """watch(replay=True)'s re-run of the first bad module: whether it reproduced, the operation
    it named (and the module that ran it), or why not."""
    module: Optional[str] = _field(STR_OR_NULL)
    class_name: Optional[str] = _field(STR_OR_NULL, key="class")
    reproduced: bool = _field(BOOL)
    op: Optional[str] = _field(STR_OR_NULL)
    site: Optional[str] = _field(STR_OR_NULL)
    op_module: Optional[str] = _field(STR_OR_NULL)
    op_class: Optional[str] = _field(STR_OR_NULL)
    reason: str = _field(STR)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rerun(_JsonObject):
    """watch(rerun=True)'s rerun of the batch (numguard.inspector.rerun): the verdict (None: no
    rerun ran, `reason` says why), whether its output replaced the corrupted one, whether it was
    bit for bit the first run's, and the module a reproducible fault is in; in a multi-rank job
    the rank, host and device whose batch was rerun and the peer that ran it too
    (numguard.distributed.peer_rerun)."""
    verdict: Optional[str] = _field(VERDICT)
    batch: Optional[int] = _field(BATCH_OR_NULL)
    reason: str = _field(STR)
    recovered: bool = _field(BOOL)
    identical: Optional[bool] = _field(BOOL_OR_NULL)
    watched_abs_max: Optional[float] = _field(NUMBER_OR_NULL)
    module: Optional[str] = _field(STR_OR_NULL)
    class_name: Optional[str] = _field(STR_OR_NULL, key="class")
    detail: str = _field(STR)
    rank: Optional[int] = _field(INT_OR_NULL)       # multi-rank: the rank whose batch was rerun
    host: Optional[str] = _field(STR_OR_NULL)
    device: Optional[str] = _field(STR_OR_NULL)
    peer: Optional[int] = _field(INT_OR_NULL)       # the data-parallel peer that ran it too


@dataclasses.dataclass(frozen=True, kw_only=True)
class Outlier(_JsonObject):
    """A rank numguard.distributed.last_outliers() named: its metric ("activations", "gradients"
    or "step_time") against the median of the other ranks."""
    rank: int = _field(INT, required=True)
    host: Optional[str] = _field(STR_OR_NULL)
    metric: str = _field(STR, required=True)
    field: str = _field(STR)
    value: Optional[float] = _field(NUMBER_OR_NULL)
    median_of_others: Optional[float] = _field(NUMBER_OR_NULL)
    ratio: Optional[float] = _field(NUMBER_OR_NULL)
    flagged_checks: int = _field(INT)
    window: int = _field(INT)
    batch: Optional[int] = _field(INT_OR_NULL)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Report(_JsonObject):
    """A trip's report (numguard.dump's schema). `batch_number`: the number Transformers' header
    shows; `batch`: the 0-indexed batch of the offending frame; `found_at_batch`: the batch whose
    check found it; `module`, `class_name`, `labels`: the offending frame's module, class and
    non-finite lines; `ranks`: [rank, module] of every rank that tripped; `frames`: oldest first,
    the last one the offender. The rest are the parts features add, ABSENT when they did not."""
    format: str = _field(Value(repr(FORMAT), lambda v: v == FORMAT), required=True, default=FORMAT)
    version: int = _field(Value(f"a whole number from 1 to {VERSION}", lambda v: _is_int(v) and 1 <= v <= VERSION),
                          required=True, default=VERSION)
    batch_number: int = _field(BATCH, required=True)
    batch: Optional[int] = _field(BATCH_OR_NULL)
    found_at_batch: Optional[int] = _field(BATCH_OR_NULL)
    check: str = _field(STR)
    check_every: int = _field(POSITIVE)
    where: Optional[str] = _field(STR_OR_NULL)
    rank: Optional[int] = _field(BATCH_OR_NULL)
    ranks: list = _field(ListOf(RANK_PAIR))
    module: Optional[str] = _field(STR_OR_NULL)
    class_name: str = _field(STR, key="class")
    labels: list = _field(ListOf(STR))
    section: str = _field(STR)
    max_frames_to_save: int = _field(POSITIVE)
    headroom: float = _field(NUMBER)
    backend: str = _field(STR)
    frames: list = _field(ListOf(Part(ReportFrame, "a frame (an object)"), "a non-empty list of frames", 1),
                          required=True)
    operation: Operation = _field(Part(Operation))
    history: History = _field(Part(History))
    replay: Replay = _field(Part(Replay))
    rerun: Rerun = _field(Part(Rerun))
    first_fault: FirstFault = _field(Part(FirstFault))
    framework_step: FrameworkStep = _field(Part(FrameworkStep))
    outliers: list = _field(ListOf(Part(Outlier, "an outlier (an object with a whole-number rank and a metric)")))
