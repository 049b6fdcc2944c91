"""numguard's tensor ops: typed wrappers over torch.ops.numguard, fake implementations for
torch.compile, the input rule both backends share, and the choice of backend.

The native extension (`numguard._C`) registers the ops with the PyTorch dispatcher. It is used only
when it was built for the running torch (numguard/_build_info.py, written by setup.py, is checked
before `_C` is imported: a mismatched ABI can abort the process rather than raise) and when its
record, state and dtype layout equals numguard.schema. Otherwise, or with NUMGUARD_BACKEND=torch,
the same functions run on a pure-PyTorch implementation that gives identical records and stays
sync-free; a warning says so once, and fallback_reason() says why.
"""
from __future__ import annotations

import importlib
import importlib.util
import warnings
from typing import Sequence

import torch

from . import _torch_ops, env, schema
from .schema import NUM_STATS, STAT_FIELDS, STATE_INITIAL, STATE_SIZE

# NUMGUARD_CPU_ISA caps the CPU kernels' instruction-set level; unset or empty: the best this CPU
# supports. numguard.env parses it (and NUMGUARD_BACKEND); csrc/cpu/dispatch.cpp accepts the same.
CPU_ISA_CHOICES = env.CPU_ISA_CHOICES
_REBUILD = ("rebuild numguard's extension with `pip install --no-build-isolation -e .` "
            "(or `python setup.py build_ext --inplace`) in its source folder")


# ---------------------------------------------------------------------------------------------
# Loading the extension

def build_mismatch(built_torch: str, built_cuda: str | None, running_torch: str,
                   running_cuda: str | None) -> str | None:
    """Why an extension built for (built_torch, built_cuda) cannot run under (running_torch,
    running_cuda), or None when they are the same build of torch."""
    if built_torch != running_torch:
        return f"numguard's extension was built for torch {built_torch}, running torch {running_torch}: {_REBUILD}"
    if built_cuda != running_cuda:
        return (f"numguard's extension was built against CUDA {built_cuda}, running torch {running_torch} uses "
                f"CUDA {running_cuda}: {_REBUILD}")
    return None


def _native_dtype_rows():
    """numguard.schema.DTYPES in the shape _C.dtypes() reports: (name, max, tiny, headroom limit)
    of each recordable dtype, in order; tiny 0 where there is none, limit 0 where not checked."""
    return [(info.name, float(info.max), float(info.tiny or 0.0), float(info.max) if info.low_precision else 0.0)
            for info in schema.DTYPES.values() if info.recordable]


def schema_mismatch(stat_fields, state_fields, dtypes) -> str | None:
    """How the layout an extension reports (_C.stat_fields(), _C.state_layout(), _C.dtypes())
    differs from numguard.schema, or None when it is the same."""
    diffs = []
    if tuple(stat_fields) != STAT_FIELDS:
        diffs.append(f"stats record fields {tuple(stat_fields)} != {STAT_FIELDS}")
    if tuple(state_fields) != schema.STATE_FIELDS:
        diffs.append(f"recording state fields {tuple(state_fields)} != {schema.STATE_FIELDS}")
    got = [(str(n), float(m), float(t), float(h)) for n, m, t, h in dtypes]
    want = _native_dtype_rows()
    if got != want:
        wrong = [f"{g} != {w}" for g, w in zip(got, want) if g != w]
        if len(got) != len(want):
            wrong.append(f"dtypes {[g[0] for g in got]} != {[w[0] for w in want]}")
        diffs.append("dtype table (name, max, tiny, headroom limit): " + "; ".join(wrong))
    if not diffs:
        return None
    return f"numguard's extension does not match numguard.schema ({'; '.join(diffs)}): {_REBUILD}"


def fingerprint_mismatch(layout) -> str | None:
    """How the fingerprint an extension computes (_C.fingerprint_layout()) differs from
    numguard.schema.FINGERPRINT_LAYOUT, or None when it is the same."""
    if layout is None:
        return f"numguard's extension has no replica fingerprint kernel (built before it existed): {_REBUILD}"
    got = tuple(int(v) & 0xFFFF_FFFF_FFFF_FFFF for v in layout)
    if got != schema.FINGERPRINT_LAYOUT:
        return (f"numguard's extension computes fingerprint layout {got}, numguard.schema says "
                f"{schema.FINGERPRINT_LAYOUT}: {_REBUILD}")
    return None


def _build_info_mismatch() -> str | None:
    """Compare numguard/_build_info.py with the running torch, before `_C` is imported."""
    if importlib.util.find_spec(f"{__package__}._C") is None:
        return None  # no extension at all: importing it below gives the usual ImportError
    try:
        build_info = importlib.import_module(f"{__package__}._build_info")
    except ImportError:
        return (f"numguard._C exists but numguard/_build_info.py, which says which torch it was built for, "
                f"is missing (a build from before numguard recorded it, or a copied .so): {_REBUILD}")
    return build_mismatch(build_info.TORCH_VERSION, build_info.CUDA_VERSION, torch.__version__, torch.version.cuda)


def _load_native():
    """Return (module, None) when the extension serves the ops, else (None, reason)."""
    choice = env.backend_choice()
    env.cpu_isa_choice()  # a bad value fails on every backend
    if choice == "torch":
        return None, "NUMGUARD_BACKEND=torch"
    native, reason = None, _build_info_mismatch()
    if reason is None:
        try:
            from . import _C as native  # importing runs the op registrations
        except Exception as exc:  # any failure to load leaves numguard usable on the fallback
            reason = f"{type(exc).__name__}: {exc}"
        else:
            reason = (schema_mismatch(native.stat_fields(), native.state_layout(), native.dtypes())
                      or fingerprint_mismatch(getattr(native, "fingerprint_layout", lambda: None)()))
    if reason is None:
        return native, None
    if choice == "native":
        raise ImportError(f"NUMGUARD_BACKEND=native but numguard's extension cannot be used: {reason}")
    return None, reason


_native, _fallback_reason = _load_native()
if _native is None and _fallback_reason != "NUMGUARD_BACKEND=torch":
    warnings.warn(f"numguard: native kernels unavailable ({_fallback_reason}); using the pure-PyTorch "
                  "implementation (same results, slower)"
                  + ("." if _REBUILD in _fallback_reason else f". To get the kernels, {_REBUILD}."),
                  RuntimeWarning, stacklevel=2)


def backend() -> str:
    """'native' when the compiled kernels serve the ops, 'torch' on the pure-PyTorch fallback."""
    return "native" if _native is not None else "torch"


def fallback_reason() -> str | None:
    """Why the native kernels are not in use, or None when they are."""
    return _fallback_reason


def native_module():
    """The loaded extension module, or None."""
    return _native


if _native is not None:
    @torch.library.register_fake("numguard::tensor_stats")
    def _tensor_stats_fake(x):
        return x.new_empty((NUM_STATS,), dtype=torch.float64)

    @torch.library.register_fake("numguard::multi_tensor_stats")
    def _multi_tensor_stats_fake(xs):
        if not xs:
            return torch.empty((0, NUM_STATS), dtype=torch.float64)
        return xs[0].new_empty((len(xs), NUM_STATS), dtype=torch.float64)

    @torch.library.register_fake("numguard::record_")
    def _record_fake(ring, state, xs, position, headroom, context=0, quant_sums=None, quant_row=0, quant_format=-1,
                     quant_xs=(), quant_records=None):
        return None

    @torch.library.register_fake("numguard::record_at_cursor_")
    def _record_at_cursor_fake(ring, state, cursor, log, xs, slot, headroom, context=0):
        return None


# ---------------------------------------------------------------------------------------------
# Dtypes and the input rule (the native kernels apply the same rule with the same messages:
# csrc/include/numguard/host_checks.h)

_DTYPE_TABLE = {getattr(torch, name): info for name, info in schema.DTYPES.items() if hasattr(torch, name)}


def dtype_entry(dtype: torch.dtype) -> schema.DtypeInfo | None:
    """numguard.schema.DTYPES' entry for a torch dtype, or None for a dtype it does not list."""
    return _DTYPE_TABLE.get(dtype)


def headroom_limits(xs: Sequence[torch.Tensor]) -> list[float]:
    """Per tensor: the largest finite value of its dtype when record_ checks its headroom, else 0."""
    limits = []
    for x in xs:
        entry = _DTYPE_TABLE.get(x.dtype)
        limits.append(float(entry.max) if entry is not None and entry.low_precision else 0.0)
    return limits


def check_tensor(x, what: str = "x") -> None:
    """Reject what has no meaningful stats, naming the argument, what it is and what is accepted.
    Checks run in the order the native kernels run them, so both backends give the same error."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"numguard: {what} must be a torch.Tensor, got {type(x).__name__}")
    if x.is_nested:
        raise ValueError(f"numguard: {what} is a nested tensor (layout {x.layout}); only dense (strided) tensors "
                         f"are supported: pass its tensors ({what}.unbind()) one by one")
    if x.layout != torch.strided:
        raise ValueError(f"numguard: {what} has layout {x.layout}; only dense (strided) tensors are supported: "
                         f"pass {what}.to_dense()")
    if x.is_quantized:
        raise TypeError(f"numguard: {what} is a quantized tensor ({x.dtype}); only unquantized tensors are "
                        f"supported: pass {what}.dequantize()")
    entry = _DTYPE_TABLE.get(x.dtype)
    if entry is None or not entry.recordable:
        if x.is_complex():
            raise TypeError(f"numguard: {what} has complex dtype {x.dtype}; stats are defined for real tensors: "
                            f"pass torch.view_as_real({what}) to check its real and imaginary parts")
        raise TypeError(f"numguard: {what} has dtype {x.dtype}, which numguard does not support; supported dtypes: "
                        f"{', '.join(schema.RECORDABLE_DTYPES)}")
    if x.device.type == "meta":
        raise ValueError(f"numguard: {what} is a meta tensor (shape {tuple(x.shape)}), which has no "
                         "values to check: pass a tensor on a real device")


def check_same_device(xs: Sequence[torch.Tensor], what: str = "xs") -> None:
    for i, x in enumerate(xs):
        check_tensor(x, f"{what}[{i}]")
    if xs:
        device = xs[0].device
        for i, x in enumerate(xs):
            if x.device != device:
                raise ValueError(f"numguard: {what}[{i}] is on {x.device} but {what}[0] is on {device}; "
                                 "all tensors of one call must be on one device: split the call per device")


def _check_for_native(xs: list, what: str = "xs") -> None:
    """The native kernels check dtype, layout and devices themselves with the same messages; what
    they never see is a meta or non-tensor argument (meta goes to the fake kernel), so only those
    are screened here: a per-call cost of a few attribute reads, not a full Python validation."""
    for x in xs:
        if not isinstance(x, torch.Tensor) or x.is_meta:
            check_same_device(xs, what)


def _explain_native_error(xs: list) -> None:
    """After a native op failed: raise numguard's own error when an argument breaks the input rule
    (e.g. a Python tensor subclass such as a jagged nested tensor, which the dispatcher hands to the
    subclass before any numguard kernel sees it); return when none does, to re-raise the original."""
    check_same_device(xs)


# ---------------------------------------------------------------------------------------------
# The ops

def tensor_stats(x: torch.Tensor) -> torch.Tensor:
    """float64[8] stats record of `x` on x.device (fields: STAT_FIELDS). No host sync."""
    check_tensor(x)
    if _native is None:
        return _torch_ops.tensor_stats(x)
    return torch.ops.numguard.tensor_stats.default(x)


def multi_tensor_stats(xs: Sequence[torch.Tensor], checked: bool = False) -> torch.Tensor:
    """float64[len(xs), 8]: the record of each tensor, all on one device. No host sync.
    `checked`: the caller knows every item is a tensor and none is meta (numguard's weight table)."""
    xs = list(xs)
    if _native is None:
        check_same_device(xs)
        return _torch_ops.multi_tensor_stats(xs)
    if not checked:
        _check_for_native(xs)
    if not xs:  # no tensor argument: the dispatcher could not pick a device
        return torch.empty((0, NUM_STATS), dtype=torch.float64)
    try:
        return torch.ops.numguard.multi_tensor_stats.default(xs)
    except RuntimeError:
        _explain_native_error(xs)
        raise


def new_ring(num_records: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """A (ring, state) pair for record_: ring float64[num_records, 8], state int64[4] untripped."""
    if not isinstance(num_records, int) or num_records < 1:
        raise ValueError(f"numguard: a ring needs at least one record, got num_records={num_records!r}")
    ring = torch.zeros((num_records, NUM_STATS), dtype=torch.float64, device=device)
    state = torch.empty(STATE_SIZE, dtype=torch.int64, device=device)
    reset_state(state)
    return ring, state


def reset_state(state: torch.Tensor) -> None:
    """Untrip a recording state in place (device-side fills, no host sync)."""
    for index, value in enumerate(STATE_INITIAL):
        state[index].fill_(value)


def record_(ring: torch.Tensor, state: torch.Tensor, xs: Sequence[torch.Tensor], position: int,
            headroom: float = 0.0, context: int = 0) -> None:
    """Record xs into ring[(position + i) % len(ring)] unless the ring is frozen by an earlier trip;
    trip `state` on NaN/Inf (first offending position kept), flag headroom. The first `context`
    xs are a call's inputs: their NaN/Inf trips only with a later one's (NOTE: [context records]
    in csrc/include/numguard/fingerprint.h). No host sync."""
    xs = list(xs)
    if _native is None:
        check_same_device(xs)
        _torch_ops.record_(ring, state, xs, position, headroom, headroom_limits(xs) if headroom > 0 else None,
                           context)
        return
    _check_for_native(xs)
    try:
        torch.ops.numguard.record_.default(ring, state, xs, position, headroom, context)
    except RuntimeError:
        _explain_native_error(xs)
        raise


# ---------------------------------------------------------------------------------------------
# Replica fingerprints (NOTE: [fingerprint] in csrc/include/numguard/fingerprint.h)

if _native is not None:
    @torch.library.register_fake("numguard::multi_tensor_fingerprint")
    def _multi_tensor_fingerprint_fake(xs):
        if not xs:
            return torch.empty((0,), dtype=torch.int64)
        return xs[0].new_empty((len(xs),), dtype=torch.int64)


def multi_tensor_fingerprint(xs: Sequence[torch.Tensor]) -> torch.Tensor:
    """int64[len(xs)] on the tensors' device: each tensor's exact 64-bit digest of its bits
    (numguard.schema.FINGERPRINT_LAYOUT; equal digests <=> bitwise-equal tensors, up to a 2^-64
    chance), independent of memory layout, thread count and chunking. No host sync."""
    xs = [x.detach() if isinstance(x, torch.Tensor) else x for x in xs]
    if _native is None:
        check_same_device(xs)
        return _torch_ops.multi_tensor_fingerprint(xs)
    _check_for_native(xs)
    if not xs:
        return torch.empty((0,), dtype=torch.int64)
    try:
        return torch.ops.numguard.multi_tensor_fingerprint.default(xs)
    except RuntimeError:
        _explain_native_error(xs)
        raise
# Recording inside a compiled graph (numguard.inspector.graph)

def new_graph_cursor(log_rows: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """A (cursor, log) pair for record_at_cursor_: cursor int64[3] at GRAPH_POSITION_BASE, no call
    logged, batch 0; log int64[log_rows, 3] of (slot, start, batch) rows, -1 while unused."""
    if not isinstance(log_rows, int) or log_rows < 1:
        raise ValueError(f"numguard: a graph log needs at least one row, got log_rows={log_rows!r}")
    cursor = torch.zeros(schema.GRAPH_CURSOR_SIZE, dtype=torch.int64, device=device)
    cursor[schema.CURSOR_POSITION].fill_(schema.GRAPH_POSITION_BASE)
    log = torch.full((log_rows, schema.GRAPH_LOG_WIDTH), -1, dtype=torch.int64, device=device)
    return cursor, log


def record_at_cursor_(ring: torch.Tensor, state: torch.Tensor, cursor: torch.Tensor, log: torch.Tensor,
                      xs: Sequence[torch.Tensor], slot: int, headroom: float = 0.0, context: int = 0) -> None:
    """record_ at the position cursor[0] holds on the device, for frames recorded inside a compiled
    graph: unless the ring is frozen, log (slot, start, cursor[2]) at log row cursor[1] % len(log)
    and advance the cursor by len(xs) records and one call. Traceable by torch.compile (no Python
    branch on values); no host sync. `xs` must already be recordable tensors on the ring's device;
    `context` as in record_."""
    xs = list(xs)
    if _native is None:
        _torch_ops.record_at_cursor_(ring, state, cursor, log, xs, slot, headroom,
                                     headroom_limits(xs) if headroom > 0 else None, context)
        return
    torch.ops.numguard.record_at_cursor_.default(ring, state, cursor, log, xs, slot, headroom, context)
