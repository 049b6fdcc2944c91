"""``check_shapes``: every rank describes what it is about to pass to a collective (structure,
shapes, dtypes, operation, other arguments, call site) in ONE fixed-size int64 record, without
pickling.

How ranks agree (NOTE: [agreement by all_reduce]): a healthy check is ONE all_reduce(MAX) of two
int64 (the record's 62-bit hash and its negation) on numguard's own process group; the ranks
all-gather the full records (one [world, 256] int64 all_gather into a preallocated buffer) only
when the hashes differ, to write the message. Measured on gloo (benchmarks/bench_distributed.py),
the all_reduce of 16 bytes costs less than all-gathering 2 KiB per rank on every check
(``FAST_PATH = "all_gather"`` does that, for comparison).

NOTE: [check record layout]
Each rank sends ``RECORD_WORDS`` (256) int64 words, rank-major in the gathered buffer:

====== =========================================================================================
word    meaning
====== =========================================================================================
0       magic + layout version
1       64-bit hash of the full description (tokens below, all of them, and the op name)
2       the same hash with every dtype zeroed (tells a dtype-only mismatch from a shape mismatch)
3       hash of the op name
4       hash of ``details`` (other arguments that must agree, e.g. ``src=0``)
5       number of leaves (tensors, None, scalars)
6       number of description tokens (may exceed the space below: then only the hash compares)
7       number of text bytes
8-39    text: op name, NUL, call site, NUL, details (utf-8, truncated to 256 bytes). The call
        site is shown, never compared: ranks may reach one collective from different lines,
        e.g. ``if rank == 0: broadcast(x) else: broadcast(y)``
40-255  description tokens, as many as fit
====== =========================================================================================

Description tokens, depth first: a tensor is ``1, dtype code, ndim, dims...``; a list ``2, n``;
a tuple ``3, n``; a dict ``4, n`` then, per item in canonical order (NOTE: [dict order]), a
63-bit hash of ``repr(key)`` and the value; None ``5``; any other leaf ``6, type code`` (scalar
values are not compared).
The record is built with ``struct`` in a preallocated buffer; only on a mismatch are the tokens
decoded to write the message.
"""
from __future__ import annotations

import hashlib
import struct
from array import array
from collections import Counter

import torch
import torch.distributed

from . import coordination as _co
from .errors import DistributedOperationException

RECORD_WORDS = 256
_HEADER = 8
_TEXT_WORDS = 32
_TOKENS_AT = _HEADER + _TEXT_WORDS
TOKEN_CAPACITY = RECORD_WORDS - _TOKENS_AT
_MAGIC = 0x4E47_5348_0001  # "NGSH", layout version 1

_TENSOR, _LIST, _TUPLE, _DICT, _NONE, _OTHER = 1, 2, 3, 4, 5, 6
_HASH_MASK = (1 << 62) - 1
_MAX = torch.distributed.ReduceOp.MAX

#: How ranks agree: ``"all_reduce"`` (default: one all_reduce(MAX) of two int64 per check; the
#: records are all-gathered only on a mismatch) or ``"all_gather"`` (every check all-gathers the
#: full records). See NOTE: [agreement by all_reduce] and benchmarks/bench_distributed.py.
FAST_PATH = "all_reduce"

_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8,
    torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128,
]
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
              "uint16", "uint32", "uint64", "complex32", "float8_e8m0fnu", "float4_e2m1fn_x2"):
    if hasattr(torch, _name):
        _DTYPES.append(getattr(torch, _name))
_DTYPE_CODE = {dt: i + 1 for i, dt in enumerate(_DTYPES)}
_CODE_DTYPE = {i + 1: dt for i, dt in enumerate(_DTYPES)}
_SCALAR_CODE = {int: 1, float: 2, bool: 3, str: 4, bytes: 5, complex: 6}
_CODE_SCALAR = {v: k.__name__ for k, v in _SCALAR_CODE.items()}


def _hash64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


def _key_hash(key) -> int:
    return _hash64(repr(key).encode("utf-8", "replace")) >> 1


def _dtype_code(dt) -> int:
    code = _DTYPE_CODE.get(dt)
    if code is None:
        code = 1000 + (_hash64(str(dt).encode()) & 0xFFFF)
    return code


class TensorSpec:
    """What a collective needs to agree on when a tensor's full shape may legitimately differ
    between ranks: dtype and the dims that must match (``-1`` marks a dim that may differ)."""

    __slots__ = ("shape", "dtype")

    def __init__(self, shape, dtype):
        self.shape = tuple(shape)
        self.dtype = dtype


# NOTE: [dict order]
# Dicts are described in canonical order, sorted by repr(key): dicts equal as dicts compare equal
# whatever order their keys were inserted in (ranks often build them differently: a comprehension
# over a set, keys added as they become ready). Insertion order still matters to code that pairs
# values by position: torch's object collectives pickle a dict in insertion order (the receiver
# gets the sender's order), and `for k, v in d.items(): dist.all_reduce(v)` pairs the k-th value
# of each rank. Such a loop must iterate in a canonical order (`for k in sorted(d)`); with
# guard_collectives() each of its all_reduces is checked on its own, which catches it when the
# paired values differ in shape or dtype.
def _dict_items(obj: dict):
    return sorted(obj.items(), key=lambda item: repr(item[0]))


def _describe(obj, tokens: list, dtype_at: list) -> int:
    """Append ``obj``'s tokens; return its number of leaves."""
    if isinstance(obj, (torch.Tensor, TensorSpec)):
        shape = obj.shape
        tokens.append(_TENSOR)
        dtype_at.append(len(tokens))
        tokens.append(_dtype_code(obj.dtype))
        tokens.append(len(shape))
        tokens.extend(shape)
        return 1
    if isinstance(obj, (list, tuple)):
        tokens.append(_TUPLE if isinstance(obj, tuple) else _LIST)
        tokens.append(len(obj))
        n = 0
        for item in obj:
            n += _describe(item, tokens, dtype_at)
        return n
    if isinstance(obj, dict):
        tokens.append(_DICT)
        tokens.append(len(obj))
        n = 0
        for key, item in _dict_items(obj):
            tokens.append(_key_hash(key))
            n += _describe(item, tokens, dtype_at)
        return n
    if obj is None:
        tokens.append(_NONE)
        return 1
    tokens.append(_OTHER)
    code = _SCALAR_CODE.get(type(obj))
    if code is None:
        code = 100 + (_hash64(type(obj).__qualname__.encode()) & 0xFFFF)
    tokens.append(code)
    return 1


def description_hash(obj, op: str, details: str = "") -> int:
    """The full-description hash of NOTE: [check record layout] (word 1), without the record."""
    tokens: list = []
    _describe(obj, tokens, [])
    return _full_hash(array("q", tokens).tobytes(), op.encode("utf-8", "replace"),
                      details.encode("utf-8", "replace"))


def _full_hash(packed: bytes, op_b: bytes, det_b: bytes) -> int:
    return _hash64(packed + b"\0" + op_b + b"\0" + det_b)


def encode(obj, op: str, site: str, buf: bytearray, details: str = "") -> int:
    """Write ``obj``'s check record (see NOTE: [check record layout]) into ``buf``; return the
    full-description hash."""
    tokens: list = []
    dtype_at: list = []
    n_leaves = _describe(obj, tokens, dtype_at)
    op_b = op.encode("utf-8", "replace")
    det_b = details.encode("utf-8", "replace")
    packed = array("q", tokens).tobytes()
    full = _full_hash(packed, op_b, det_b)
    if dtype_at:
        for i in dtype_at:
            tokens[i] = 0
        shape_hash = _full_hash(array("q", tokens).tobytes(), op_b, det_b)
    else:
        shape_hash = full
    text = (op_b + b"\0" + site.encode("utf-8", "replace") + b"\0" + det_b)[: _TEXT_WORDS * 8]
    struct.pack_into("<8q", buf, 0, _MAGIC, full, shape_hash, _hash64(op_b), _hash64(det_b),
                     n_leaves, len(packed) // 8, len(text))
    buf[_HEADER * 8: _HEADER * 8 + len(text)] = text
    room = TOKEN_CAPACITY * 8
    at = _TOKENS_AT * 8
    buf[at: at + min(len(packed), room)] = packed[:room]
    return full


# ---------------------------------------------------------------------------------------------
# Decoding (mismatch path only)

class _Record:
    def __init__(self, out: bytearray, r: int):
        base = r * RECORD_WORDS * 8
        (self.magic, self.full, self.shape_hash, self.op_hash, self.details_hash, self.n_leaves,
         self.n_tokens, n_text) = struct.unpack_from("<8q", out, base)
        text = bytes(out[base + _HEADER * 8: base + _HEADER * 8 + max(0, min(n_text, 256))])
        op, _, rest = text.partition(b"\0")
        site, _, details = rest.partition(b"\0")
        self.op = op.decode("utf-8", "replace")
        self.site = site.decode("utf-8", "replace")
        self.details = details.decode("utf-8", "replace")
        self.complete = 0 <= self.n_tokens <= TOKEN_CAPACITY
        n = min(max(self.n_tokens, 0), TOKEN_CAPACITY)
        self.tokens = list(struct.unpack_from(f"<{n}q", out, base + _TOKENS_AT * 8))
        self.valid = self.magic == _MAGIC


class _Leaf:
    __slots__ = ("path", "kind", "dtype", "shape")

    def __init__(self, path, kind, dtype=None, shape=None):
        self.path, self.kind, self.dtype, self.shape = path, kind, dtype, shape


def _dtype_name(code: int) -> str:
    dt = _CODE_DTYPE.get(code)
    return str(dt) if dt is not None else f"<dtype #{code}>"


def _parse(tokens, pos, path, leaves, keys):
    """Parse one value at ``tokens[pos]``; return (new pos, shapes text, dtypes text, structure
    text). Raises IndexError on a malformed or truncated token list."""
    kind = tokens[pos]
    if kind == _TENSOR:
        code, ndim = tokens[pos + 1], tokens[pos + 2]
        dims = tokens[pos + 3: pos + 3 + ndim]
        if ndim < 0 or len(dims) != ndim:
            raise IndexError
        leaves.append(_Leaf(path, "tensor", code, tuple(dims)))
        return pos + 3 + ndim, _fmt_shape(dims), _dtype_name(code), "T"
    if kind in (_LIST, _TUPLE, _DICT):
        n = tokens[pos + 1]
        if n < 0:
            raise IndexError
        pos += 2
        shapes, dtypes, structs = [], [], []
        for i in range(n):
            if kind == _DICT:
                kh = tokens[pos]
                name = keys.get(kh, f"<key #{kh & 0xFFFFFF:06x}>")
                pos, s, d, t = _parse(tokens, pos + 1, f"{path}[{name}]", leaves, keys)
                s, d, t = f"{name}: {s}", f"{name}: {d}", f"{kh}:{t}"
            else:
                pos, s, d, t = _parse(tokens, pos, f"{path}[{i}]", leaves, keys)
            shapes.append(s)
            dtypes.append(d)
            structs.append(t)
        o, c = {_LIST: "[]", _TUPLE: "()", _DICT: "{}"}[kind]
        tail = "," if kind == _TUPLE and n == 1 else ""
        return (pos, o + ", ".join(shapes) + tail + c, o + ", ".join(dtypes) + tail + c,
                o + ",".join(structs) + c)
    if kind == _NONE:
        leaves.append(_Leaf(path, "None"))
        return pos + 1, "None", "None", "N"
    if kind == _OTHER:
        name = _CODE_SCALAR.get(tokens[pos + 1], "object")
        leaves.append(_Leaf(path, name))
        return pos + 2, name, name, name
    raise IndexError


def _local_keys(obj, keys: dict) -> None:
    if isinstance(obj, dict):
        for k, v in obj.items():
            keys[_key_hash(k)] = repr(k)
            _local_keys(v, keys)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _local_keys(v, keys)


def _fmt_shape(shape) -> str:
    return "[" + ", ".join("*" if d == -1 else str(d) for d in shape) + "]"


def mismatch_message(out: bytearray, world: int, obj, op: str, me: int | None = None) -> str:
    """The message every rank raises. It depends only on the gathered records, so every rank
    reports the same differences; dict keys this rank does not have show as ``<key #hash>``, and
    a description too large for the record is shown in full only by its own rank (``me``)."""
    records = [_Record(out, r) for r in range(world)]
    keys: dict = {}
    _local_keys(obj, keys)
    if me is not None and records[me].valid and not records[me].complete:
        # Too large for the record: this rank can still show its own description in full.
        tokens: list = []
        _describe(obj, tokens, [])
        records[me].tokens, records[me].complete = tokens, True
    parsed = []
    for rec in records:
        leaves: list = []
        if rec.valid and rec.complete:
            try:
                end, s, d, t = _parse(rec.tokens, 0, "input", leaves, keys)
                if end != len(rec.tokens):
                    raise IndexError
                parsed.append((s, d, leaves, t))
                continue
            except IndexError:
                pass
        if not rec.valid:
            parsed.append(("<not a numguard shape record>", "<unknown>", None, None))
        else:
            parsed.append((f"<{rec.n_leaves} leaves: too large to show>", "<too large to show>",
                           None, None))
    operation = records[0].op if records[0].valid else op
    lines = [
        "Cannot apply desired operation due to shape mismatches. "
        "All shapes across devices must be valid.",
        "",
        f"Operation: `{operation}`",
        "Input shapes:",
    ]
    lines += [f"  - Process {r}: {parsed[r][0]}" for r in range(world)]
    lines.append("Input dtypes:")
    lines += [f"  - Process {r}: {parsed[r][1]}" for r in range(world)]
    if any(rec.details for rec in records):
        lines.append("Arguments:")
        lines += [f"  - Process {r}: {rec.details}" for r, rec in enumerate(records)]

    # Reference: the most common full description (lowest rank on ties).
    counts = Counter(rec.full for rec in records)
    ref = min(range(world), key=lambda r: (-counts[records[r].full], r))
    rref = records[ref]
    diffs = []
    for r, rec in enumerate(records):
        if r == ref or (rec.valid and rec.full == rref.full):
            continue
        if not rec.valid:
            diffs.append(f"  - Process {r}: sent a record numguard cannot read (a different "
                         "numguard version, or a different collective at this point)")
            continue
        if rec.op_hash != rref.op_hash:
            # Another collective: its arguments and inputs differ as a matter of course.
            diffs.append(f"  - Process {r}: operation `{rec.op}` instead of `{rref.op}` (the "
                         "ranks are at different collectives)")
            continue
        if rec.details_hash != rref.details_hash:
            diffs.append(f"  - Process {r}: arguments `{rec.details}` instead of `{rref.details}`")
        la, lb = parsed[ref][2], parsed[r][2]
        if la is None or lb is None:
            what = "dtypes" if rec.shape_hash == rref.shape_hash else "shapes or structure"
            diffs.append(f"  - Process {r}: {what} (too many tensors to compare one by one)")
            continue
        if parsed[ref][3] != parsed[r][3] or len(la) != len(lb):
            if len(la) != len(lb):
                how = f"{len(lb)} leaves instead of {len(la)}"
            else:
                how = "container types or dict keys differ"
            diffs.append(f"  - Process {r}: structure ({how})")
            continue
        for a, b in zip(la, lb):
            if a.kind != b.kind:
                diffs.append(f"  - Process {r}: {b.path} is {b.kind} instead of {a.kind}")
                continue
            if a.kind != "tensor":
                continue
            if a.shape != b.shape:
                if len(a.shape) != len(b.shape):
                    how = f"ndim {len(b.shape)} instead of {len(a.shape)}"
                elif _prod(a.shape) == _prod(b.shape):
                    how = "same number of elements, different shape"
                else:
                    idx = [i for i, (x, y) in enumerate(zip(a.shape, b.shape)) if x != y]
                    verb = "differs" if len(idx) == 1 else "differ"
                    how = "dim " + ", ".join(map(str, idx)) + " " + verb
                diffs.append(f"  - Process {r}: shape of {b.path} is {_fmt_shape(b.shape)} "
                             f"instead of {_fmt_shape(a.shape)} ({how})")
            if a.dtype != b.dtype:
                diffs.append(f"  - Process {r}: dtype of {b.path} is {_dtype_name(b.dtype)} "
                             f"instead of {_dtype_name(a.dtype)}")
    lines.append(f"What differs (compared with process {ref}):")
    lines += diffs or ["  - (descriptions differ but no field-level difference was found)"]
    lines.append("Call sites:")
    lines += [f"  - Process {r}: {rec.site or '<unknown>'}" for r, rec in enumerate(records)]
    return "\n".join(lines)


def _prod(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def check_shapes(obj, op: str | None = None, group=None, timeout: float | None = None,
                 details: str = "") -> None:
    """Check that every rank of ``group`` passes the same structure, shapes and dtypes.

    Args:
        obj: a tensor, or any nesting of lists/tuples/dicts of tensors (None and scalars allowed
            as leaves; scalar values are not compared, only their types).
        op: name shown in the message (e.g. ``"torch.distributed.all_reduce"``); ranks must agree
            on it too.
        group: process group (default group when None).
        timeout: seconds to wait for every rank (``NUMGUARD_DIST_TIMEOUT``, default 60).
        details: other arguments ranks must agree on, as text (e.g. ``"src=0"``); compared, and
            shown when they differ.

    Runs one all_reduce of two int64 (the hash of this rank's record, see NOTE: [check record
    layout]) on numguard's own gloo group over the same ranks (NOTE: [own process group] in
    coordination.py); only when the hashes differ, one all_gather of the fixed-size records. On a
    mismatch every rank raises :class:`DistributedOperationException` listing the same
    differences; a rank that does not arrive in time makes the others raise
    :class:`DistributedTimeoutError` naming it, after which numguard stops checking the group
    (warned once). Dicts compare by key, whatever their insertion order (NOTE: [dict order]).
    Does nothing without an initialized process group, with one rank, or on a rank outside
    ``group``.
    """
    if not _co.is_initialized():
        return
    if group is not None and _c10d_not_in_group(group):
        return
    st = _co.group_state(group)
    if st.world == 1:
        return
    op_name = op if op is not None else "numguard.distributed.check_shapes"
    if st.broken is not None:
        st.warn_once("broken", (
            f"numguard.distributed: `{op_name}` and later collectives of process group "
            f"{st.name!r} are not checked: numguard stopped using the group after: {st.broken}"))
        return
    site = _co.call_site()
    with _co.exclusive(st, f"the check of `{op_name}`"):
        _check(st, obj, op_name, site, timeout, details)


def _check(st, obj, op_name: str, site: str, timeout, details: str) -> None:
    if FAST_PATH == "all_reduce":
        full = description_hash(obj, op_name, details)
        # NOTE: [agreement by all_reduce] MAX of (h, -h) gives (max h, -min h): equal hashes on
        # every rank iff max == min. Only when they differ do the ranks (all of them, since they
        # all see the same result) gather the full records to write the message.
        h = (full ^ _MAGIC) & _HASH_MASK
        rb, rh, rd = st.reduce_buffers(2)
        struct.pack_into("<2q", rb, 0, h, -h)
        if rd is not rh:
            rd.copy_(rh)
        _co.timed_all_reduce(st, rd, _MAX, f"`{op_name}`", site, timeout)
        if rd is not rh:
            rh.copy_(rd)
        hi, neg_lo = struct.unpack_from("<2q", rb, 0)
        if hi == -neg_lo:
            return
    encode(obj, op_name, site, st.gather_buffers(RECORD_WORDS)[0], details)
    out = _co.timed_all_gather(st, RECORD_WORDS, f"`{op_name}`", site, timeout)
    stride = RECORD_WORDS * 8
    magic0, full0 = struct.unpack_from("<2q", out, 0)
    for r in range(1, st.world):
        magic, full = struct.unpack_from("<2q", out, r * stride)
        if magic != magic0 or full != full0:
            raise DistributedOperationException(
                mismatch_message(out, st.world, obj, op_name, st.rank))
    if magic0 != _MAGIC:
        raise DistributedOperationException(mismatch_message(out, st.world, obj, op_name, st.rank))


def _c10d_not_in_group(group) -> bool:
    from torch.distributed import distributed_c10d

    return distributed_c10d._rank_not_in_group(group)
