"""numguard's data layout, in one place and without torch: the stats record, the recording state
next to a ring, the dtypes the kernels record, and the kinds of report lines.

The native extension states the same layout (csrc/include/numguard/stats_reduce.h and
host_checks.h) and reports it through numguard._C; numguard.ops compares the two when it loads the
extension and falls back to the pure-PyTorch implementation when they disagree. Everything here is
plain Python so that report rendering, dump files and tools can read records without importing
torch.
"""
from __future__ import annotations

import enum
from typing import NamedTuple, Optional, Union

# ---------------------------------------------------------------------------------------------
# Stats record: float64[NUM_STATS], fields in this order.

STAT_FIELDS = ("abs_min", "abs_max", "min_nonzero", "nan", "pos_inf", "neg_inf", "zero", "subnormal")
ABS_MIN, ABS_MAX, MIN_NONZERO, NAN, POS_INF, NEG_INF, ZERO, SUBNORMAL = range(len(STAT_FIELDS))
NUM_STATS = len(STAT_FIELDS)

# ---------------------------------------------------------------------------------------------
# Recording state: int64[STATE_SIZE] next to a ring (numguard.ops.new_ring, record_).

STATE_FIELDS = ("tripped", "first_trip_position", "headroom_hit", "first_headroom_position")
TRIPPED, FIRST_TRIP_POSITION, HEADROOM_HIT, FIRST_HEADROOM_POSITION = range(len(STATE_FIELDS))
STATE_SIZE = len(STATE_FIELDS)
# An untripped state: flags 0, positions -1 ("none yet").
STATE_INITIAL = (0, -1, 0, -1)

# ---------------------------------------------------------------------------------------------
# Dtypes, keyed by torch's name without the "torch." prefix (str(dtype)[6:]).


class DtypeInfo(NamedTuple):
    name: str
    max: Optional[Union[float, int]]  # largest finite value (finfo.max / iinfo.max); None if not a real number type
    tiny: Optional[float]             # smallest positive normal (finfo.tiny); None for integers and bool
    recordable: bool                  # the kernels compute records for it (both backends)
    low_precision: bool               # record_ checks its headroom (abs max against `max`)


def _float(name, max_, tiny, recordable=True, low_precision=False):
    return DtypeInfo(name, max_, tiny, recordable, low_precision)


def _int(name, bits, signed):
    return DtypeInfo(name, (1 << (bits - 1)) - 1 if signed else (1 << bits) - 1, None, True, False)


def _rejected(name, max_=None, tiny=None):
    return DtypeInfo(name, max_, tiny, False, False)


DTYPES = {info.name: info for info in (
    _float("float64", 1.7976931348623157e308, 2.2250738585072014e-308),
    _float("float32", 3.4028234663852886e38, 1.1754943508222875e-38),
    _float("float16", 65504.0, 6.103515625e-05, low_precision=True),
    _float("bfloat16", 3.3895313892515355e38, 1.1754943508222875e-38, low_precision=True),
    _float("float8_e4m3fn", 448.0, 0.015625, low_precision=True),
    _float("float8_e5m2", 57344.0, 6.103515625e-05, low_precision=True),
    _int("int8", 8, True), _int("int16", 16, True), _int("int32", 32, True), _int("int64", 64, True),
    _int("uint8", 8, False), _int("uint16", 16, False), _int("uint32", 32, False), _int("uint64", 64, False),
    DtypeInfo("bool", 1, None, True, False),
    # Known, not recorded: formats whose zero, NaN and infinity encodings differ from the IEEE-like
    # ones the kernels decode (fnuz: one NaN at -0, no infinities; e8m0: exponent only, no zero).
    _rejected("float8_e4m3fnuz", 240.0, 0.0078125),
    _rejected("float8_e5m2fnuz", 57344.0, 3.0517578125e-05),
    _rejected("float8_e8m0fnu", 1.7014118346046923e38, 5.877471754111438e-39),
    _rejected("float4_e2m1fn_x2"),
    _rejected("complex32"), _rejected("complex64"), _rejected("complex128"),
)}

# Recordable dtype names in the kernels' order (the list error messages show).
RECORDABLE_DTYPES = tuple(name for name, info in DTYPES.items() if info.recordable)
LOW_PRECISION_DTYPES = tuple(name for name, info in DTYPES.items() if info.low_precision)

# ---------------------------------------------------------------------------------------------
# Report lines: what a labelled value of a frame was (numguard.report renders each kind).

KIND_TENSOR = "tensor"
KIND_NONE = "none"
KIND_NOT_A_TENSOR = "not a tensor"
LINE_KINDS = (KIND_TENSOR, KIND_NONE, KIND_NOT_A_TENSOR)  # indexed by LineKind


class LineKind(enum.IntEnum):
    """What a line's value was: the low bits (LINE_KIND_MASK) of the per-line code the inspector
    keeps for each frame (numguard.inspector.frames writes the codes, the native and the Python
    recorders keep them, csrc/history.cpp reads them)."""
    TENSOR = 0
    NONE = 1
    NOT_A_TENSOR = 2

    @classmethod
    def of(cls, code: int) -> "LineKind":
        """The kind of a line code (its flags dropped)."""
        return cls(code & LINE_KIND_MASK)

    @classmethod
    def named(cls, name: str) -> "LineKind":
        """The kind a report writes as `name` ("tensor", "none", "not a tensor")."""
        return cls(LINE_KINDS.index(name))

    @property
    def report_name(self) -> str:
        return LINE_KINDS[self]


LINE_KIND_MASK = 0b011
# Set in a line code for a line Transformers does not print (a keyword input, a container's contents).
LINE_EXTRA = 0b100

# ---------------------------------------------------------------------------------------------
# Fault kinds: what a rank's first non-finite value was, in the order they happen within a
# training step. A collective later in the step (DDP's gradient all_reduce, FSDP's reduce-scatter)
# carries a NaN/Inf from the rank that made it to every other rank, so across ranks the earliest
# kind names the fault (numguard.distributed.trip_exchange.earliest_fault). In the trip details
# record a kind is sent as its index + 1 (0: unknown, after every kind).

FAULT_FORWARD = "forward"                        # a forward frame: activations, inputs, weights
FAULT_GRADIENT = "gradient"                      # a gradient tapped in the backward (grad_input/grad_output)
FAULT_PARAMETER_GRADIENT = "parameter gradient"  # parameter .grad before the optimizer step
FAULT_KINDS = (FAULT_FORWARD, FAULT_GRADIENT, FAULT_PARAMETER_GRADIENT)

# ---------------------------------------------------------------------------------------------
# Low-precision what-if (numguard.quant_stats): float64[NUM_QUANT_FIELDS] per tensor, fields in
# this order. Non-finite elements are counted and left out of every other field.
QUANT_FIELDS = (
    "nonfinite",         # NaN/Inf elements
    "nonzero",           # finite non-zero elements
    "underflow",         # non-zero elements whose quantized value is +-0
    "saturated",         # elements beyond the format's max after scaling (the cast clamps them)
    "amax",              # max |x| over the finite elements
    "sq_error",          # sum over finite elements of (dequantized - x)^2
    "blocks",            # scaling blocks (1 for a per-tensor format)
    "saturated_blocks",  # blocks with at least one saturated element
    "scale_exp_min",     # smallest / largest exponent of the (block) scales (+inf / -inf: none)
    "scale_exp_max",
)
NUM_QUANT_FIELDS = len(QUANT_FIELDS)
(Q_NONFINITE, Q_NONZERO, Q_UNDERFLOW, Q_SATURATED, Q_AMAX, Q_SQ_ERROR, Q_BLOCKS, Q_SATURATED_BLOCKS,
 Q_SCALE_EXP_MIN, Q_SCALE_EXP_MAX) = range(NUM_QUANT_FIELDS)


class QuantFormat(NamedTuple):
    """A low-precision format numguard.quant_stats models."""
    name: str
    element: str        # the element format: a torch float8 dtype's name, or "float4_e2m1"
    element_max: float  # its largest finite magnitude (the cast saturates there)
    element_emax: int   # the exponent of its largest power of two (OCP MX's emax_elem)
    block: int          # elements per scaling block (0: one per-tensor scale)
    scale: str          # how blocks are scaled: "tensor", "e8m0" (OCP MX) or "e4m3" (NVFP4)


QUANT_FORMATS = {f.name: f for f in (
    QuantFormat("float8_e4m3fn", "float8_e4m3fn", 448.0, 8, 0, "tensor"),
    QuantFormat("float8_e5m2", "float8_e5m2", 57344.0, 15, 0, "tensor"),
    QuantFormat("mxfp8_e4m3", "float8_e4m3fn", 448.0, 8, 32, "e8m0"),   # OCP Microscaling v1.0
    QuantFormat("mxfp8_e5m2", "float8_e5m2", 57344.0, 15, 32, "e8m0"),
    QuantFormat("nvfp4", "float4_e2m1", 6.0, 2, 16, "e4m3"),
)}
E8M0_EXP_RANGE = (-127, 127)
NVFP4_BLOCK_SCALE_MAX = 448.0  # the e4m3 block scale saturates there


# Replica fingerprints (numguard.ops.multi_tensor_fingerprint; NOTE: [fingerprint] in
# csrc/include/numguard/fingerprint.h): per tensor, the wrapping 64-bit sum over its elements of
# mix64(bits ^ (flat_index * FINGERPRINT_INDEX_STEP)), mix64 being splitmix64's finalizer with
# FINGERPRINT_MIX_MULTIPLIERS. Stored as int64 (the uint64 bits).

FINGERPRINT_VERSION = 1
FINGERPRINT_INDEX_STEP = 0x9E3779B97F4A7C15
FINGERPRINT_MIX_MULTIPLIERS = (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)
FINGERPRINT_LAYOUT = (FINGERPRINT_VERSION, FINGERPRINT_INDEX_STEP) + FINGERPRINT_MIX_MULTIPLIERS
# Recording inside compiled graphs (numguard.ops.record_at_cursor_; csrc/include/numguard/graph_record.h):
# a device cursor int64[GRAPH_CURSOR_SIZE] and a log int64[L, GRAPH_LOG_WIDTH] of the calls.

GRAPH_CURSOR_FIELDS = ("position", "calls", "batch")
CURSOR_POSITION, CURSOR_CALLS, CURSOR_BATCH = range(len(GRAPH_CURSOR_FIELDS))
GRAPH_CURSOR_SIZE = len(GRAPH_CURSOR_FIELDS)
GRAPH_LOG_FIELDS = ("slot", "start", "batch")
LOG_SLOT, LOG_START, LOG_BATCH = range(len(GRAPH_LOG_FIELDS))
GRAPH_LOG_WIDTH = len(GRAPH_LOG_FIELDS)
# Graph positions start here, so a trip position in the shared state says which ring it is in
# (host positions of eager frames stay far below).
GRAPH_POSITION_BASE = 1 << 62
