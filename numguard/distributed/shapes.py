"""``check_shapes``: every rank describes what it is about to pass to a collective (structure,
shapes, dtypes, operation, other arguments, call site) in ONE fixed-size int64 record, without
pickling.

How ranks agree (NOTE: [agreement by all_reduce]): a healthy check is ONE all_reduce(MAX) of two
int64 (the record's 62-bit hash and its negation) on numguard's own process group; the ranks
all-gather the full records (one [world, 256] int64 all_gather into a preallocated buffer) only
when the hashes differ, to write the message, and then the readable names of their dict keys
(one [world, 512] int64 all_gather, NOTE: [key names]). Measured on gloo
(benchmarks/bench_distributed.py), the all_reduce of 16 bytes costs less than all-gathering
2 KiB per rank on every check (``FAST_PATH = "all_gather"`` does that, for comparison).

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
6       number of description tokens (may exceed the space below: then only the hashes compare)
7       number of text bytes
8       hash of the structure alone: container types, lengths, dict keys in order, leaf types
        (tells a structure mismatch from a shape one when the tokens do not fit)
9       the same with every dict's keys sorted (equal to the other rank's while word 8 differs:
        the same keys in another order)
10-39   text: op name, NUL, call site, NUL, details (utf-8, truncated to 240 bytes). The call
        site is shown, never compared: ranks may reach one collective from different lines,
        e.g. ``if rank == 0: broadcast(x) else: broadcast(y)``
40-255  description tokens, as many as fit
====== =========================================================================================

Description tokens, depth first: a tensor is ``1, dtype code, ndim, dims...``; a list ``2, n``;
a tuple ``3, n``; a dict (any Mapping) ``4, n`` then, per item in insertion order (NOTE: [dict
order]), a 63-bit hash of ``repr(key)`` and the value; None ``5``; any other leaf ``6, type code``
(scalar values are not compared).
The record is built with ``struct`` in a preallocated buffer; only on a mismatch are the tokens
decoded to write the message.
"""
from __future__ import annotations

import hashlib
import struct
from array import array
from collections import Counter
from collections.abc import Mapping

import torch
import torch.distributed

from . import channel as _channel
from . import collectives as _collectives
from .errors import DistributedOperationException

RECORD_WORDS = 256
_HEADER = 10
_TEXT_WORDS = 30
_TOKENS_AT = _HEADER + _TEXT_WORDS
TOKEN_CAPACITY = RECORD_WORDS - _TOKENS_AT
_MAGIC = 0x4E47_5348_0002  # "NGSH", layout version 2 (dicts in insertion order, structure hashes)
#: int64 words per rank of the key-name exchange (mismatch path only, NOTE: [key names])
KEY_WORDS = 512
_KEY_TEXT = 120  # bytes of one key's repr shown at most

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
    if dt is None:
        return 0  # a TensorSpec that lets the dtype differ
    code = _DTYPE_CODE.get(dt)
    if code is None:
        code = 1000 + (_hash64(str(dt).encode()) & 0xFFFF)
    return code


class TensorSpec:
    """What a collective needs to agree on when a tensor's full shape may legitimately differ
    between ranks: dtype (None: any) and the dims that must match (``-1`` marks a dim that may
    differ)."""

    __slots__ = ("shape", "dtype")

    def __init__(self, shape, dtype):
        self.shape = tuple(shape)
        self.dtype = dtype


# NOTE: [dict order]
# Dicts (any Mapping) are described in insertion order, and two ranks whose dicts hold the same
# keys in different orders disagree: Accelerate's operations (recursively_apply walks
# ``data.items()``) and any ``for k, v in d.items(): dist.all_reduce(v)`` pair the k-th value of
# each rank, so rank 0's "a" would be gathered with rank 1's "b", a wrong result with no error
# (Accelerate's own debug mode compares the dicts with ``==`` and lets that through). Code that
# pairs values by key (torch's object collectives pickle whole dicts) can pass
# ``check_shapes(..., key_order=False)``, which describes dicts sorted by repr(key).
def _dict_items(obj, key_order: bool):
    if key_order:
        return obj.items()
    return sorted(obj.items(), key=lambda item: repr(item[0]))


def _describe(obj, tokens: list, dtype_at: list, key_order: bool = True) -> int:
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
            n += _describe(item, tokens, dtype_at, key_order)
        return n
    if isinstance(obj, (dict, Mapping)):
        tokens.append(_DICT)
        tokens.append(len(obj))
        n = 0
        for key, item in _dict_items(obj, key_order):
            tokens.append(_key_hash(key))
            n += _describe(item, tokens, dtype_at, key_order)
        return n
    if obj is None:
        tokens.append(_NONE)
        return 1
    tokens.append(_OTHER)
    tokens.append(_other_code(obj))
    return 1


def _other_code(obj) -> int:
    code = _SCALAR_CODE.get(type(obj))
    if code is None:
        code = 100 + (_hash64(type(obj).__qualname__.encode()) & 0xFFFF)
    return code


def _structure(obj, tokens: list, sort_keys: bool) -> None:
    """Append the tokens of ``obj``'s structure alone (words 8 and 9 of the record): containers,
    lengths, dict keys, leaf kinds; no shapes, no dtypes."""
    if isinstance(obj, (torch.Tensor, TensorSpec)):
        tokens.append(_TENSOR)
    elif isinstance(obj, (list, tuple)):
        tokens.append(_TUPLE if isinstance(obj, tuple) else _LIST)
        tokens.append(len(obj))
        for item in obj:
            _structure(item, tokens, sort_keys)
    elif isinstance(obj, (dict, Mapping)):
        tokens.append(_DICT)
        tokens.append(len(obj))
        items = [(_key_hash(k), v) for k, v in obj.items()]
        if sort_keys:
            items.sort(key=lambda item: item[0])
        for kh, item in items:
            tokens.append(kh)
            _structure(item, tokens, sort_keys)
    elif obj is None:
        tokens.append(_NONE)
    else:
        tokens.append(_OTHER)
        tokens.append(_other_code(obj))


def description_hash(obj, op: str, details: str = "", key_order: bool = True) -> int:
    """The full-description hash of NOTE: [check record layout] (word 1), without the record."""
    tokens: list = []
    _describe(obj, tokens, [], key_order)
    return _full_hash(array("q", tokens).tobytes(), op.encode("utf-8", "replace"),
                      details.encode("utf-8", "replace"))


def _full_hash(packed: bytes, op_b: bytes, det_b: bytes) -> int:
    return _hash64(packed + b"\0" + op_b + b"\0" + det_b)


def encode(obj, op: str, site: str, buf: bytearray, details: str = "",
           key_order: bool = True) -> int:
    """Write ``obj``'s check record (see NOTE: [check record layout]) into ``buf``; return the
    full-description hash."""
    tokens: list = []
    dtype_at: list = []
    n_leaves = _describe(obj, tokens, dtype_at, key_order)
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
    structure: list = []
    _structure(obj, structure, sort_keys=not key_order)
    sorted_structure: list = []
    _structure(obj, sorted_structure, sort_keys=True)
    text = (op_b + b"\0" + site.encode("utf-8", "replace") + b"\0" + det_b)[: _TEXT_WORDS * 8]
    struct.pack_into("<10q", buf, 0, _MAGIC, full, shape_hash, _hash64(op_b), _hash64(det_b),
                     n_leaves, len(packed) // 8, len(text),
                     _hash64(array("q", structure).tobytes()),
                     _hash64(array("q", sorted_structure).tobytes()))
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
         self.n_tokens, n_text, self.structure_hash,
         self.sorted_structure_hash) = struct.unpack_from("<10q", out, base)
        text = bytes(out[base + _HEADER * 8: base + _HEADER * 8 + max(0, min(n_text, _TEXT_WORDS * 8))])
        op, _, rest = text.partition(b"\0")
        site, _, details = rest.partition(b"\0")
        self.op = op.decode("utf-8", "replace")
        self.site = site.decode("utf-8", "replace")
        self.details = details.decode("utf-8", "replace")
        self.complete = 0 <= self.n_tokens <= TOKEN_CAPACITY
        n = min(max(self.n_tokens, 0), TOKEN_CAPACITY)
        self.tokens = list(struct.unpack_from(f"<{n}q", out, base + _TOKENS_AT * 8))
        self.valid = self.magic == _MAGIC


class _Node:
    """One value of a decoded description: ``kind`` is "tensor", "list", "tuple", "dict", "None"
    or the name of a scalar type; containers hold ``items`` as (key hash or None, node)."""

    __slots__ = ("kind", "dtype", "dims", "items")

    def __init__(self, kind, dtype=None, dims=None, items=None):
        self.kind, self.dtype, self.dims, self.items = kind, dtype, dims, items


_CONTAINER_KINDS = {_LIST: "list", _TUPLE: "tuple", _DICT: "dict"}
_BRACKETS = {"list": "[]", "tuple": "()", "dict": "{}"}


def _parse(tokens, pos):
    """Parse one value at ``tokens[pos]``; return (node, new pos). Raises IndexError on a
    malformed or truncated token list."""
    kind = tokens[pos]
    if kind == _TENSOR:
        code, ndim = tokens[pos + 1], tokens[pos + 2]
        dims = tokens[pos + 3: pos + 3 + ndim]
        if ndim < 0 or len(dims) != ndim:
            raise IndexError
        return _Node("tensor", code, tuple(dims)), pos + 3 + ndim
    if kind in _CONTAINER_KINDS:
        n = tokens[pos + 1]
        if n < 0:
            raise IndexError
        pos += 2
        items = []
        for _ in range(n):
            key = None
            if kind == _DICT:
                key = tokens[pos]
                pos += 1
            child, pos = _parse(tokens, pos)
            items.append((key, child))
        return _Node(_CONTAINER_KINDS[kind], items=items), pos
    if kind == _NONE:
        return _Node("None"), pos + 1
    if kind == _OTHER:
        return _Node(_CODE_SCALAR.get(tokens[pos + 1], "object")), pos + 2
    raise IndexError


def _dtype_name(code: int) -> str:
    if code == 0:
        return "*"
    dt = _CODE_DTYPE.get(code)
    return str(dt) if dt is not None else f"<dtype #{code}>"


def _key_name(kh: int, names: dict) -> str:
    return names.get(kh, f"<key #{kh & 0xFFFFFF:06x}>")


def _render(node: _Node, names: dict, leaf) -> str:
    if node.kind in _BRACKETS:
        parts = [(_key_name(k, names) + ": " if node.kind == "dict" else "") + _render(c, names, leaf)
                 for k, c in node.items]
        o, c = _BRACKETS[node.kind]
        tail = "," if node.kind == "tuple" and len(parts) == 1 else ""
        return o + ", ".join(parts) + tail + c
    return leaf(node)


def _shape_text(node: _Node) -> str:
    return _fmt_shape(node.dims) if node.kind == "tensor" else node.kind


def _dtype_text(node: _Node) -> str:
    return _dtype_name(node.dtype) if node.kind == "tensor" else node.kind


def _leaves(node: _Node, path: str, names: dict, out: list) -> list:
    if node.kind in _BRACKETS:
        for i, (k, child) in enumerate(node.items):
            sub = f"[{_key_name(k, names)}]" if node.kind == "dict" else f"[{i}]"
            _leaves(child, path + sub, names, out)
    else:
        out.append((path, node))
    return out


def _what(node: _Node) -> str:
    if node.kind == "tensor":
        return "a tensor"
    if node.kind in ("list", "tuple"):
        return f"a {node.kind} of {len(node.items)}"
    if node.kind == "dict":
        return "a dict"
    return node.kind


_ORDER_HINT = ("Accelerate's operations and loops over .items() pair values by position, so "
               "values would be gathered under other keys; build the dicts in one key order, or "
               "sort them")


def _structure_diffs(a: _Node, b: _Node, path: str, names: dict, out: list) -> None:
    """Append how ``b``'s structure differs from ``a``'s (first difference on each branch)."""
    if a.kind != b.kind:
        out.append(f"{path} is {_what(b)} instead of {_what(a)}")
        return
    if a.kind in ("list", "tuple"):
        if len(a.items) != len(b.items):
            out.append(f"{path} is {_what(b)} instead of {len(a.items)}")
            return
        for i, ((_, ca), (_, cb)) in enumerate(zip(a.items, b.items)):
            _structure_diffs(ca, cb, f"{path}[{i}]", names, out)
        return
    if a.kind != "dict":
        return
    ka, kb = [k for k, _ in a.items], [k for k, _ in b.items]
    if ka != kb:
        def listed(keys):
            return "[" + ", ".join(_key_name(k, names) for k in keys) + "]"
        if sorted(ka) == sorted(kb):
            out.append(f"keys of {path} are in another order: {listed(kb)} instead of "
                       f"{listed(ka)} ({_ORDER_HINT})")
        else:
            missing = [k for k in ka if k not in set(kb)]
            extra = [k for k in kb if k not in set(ka)]
            how = []
            if missing:
                how.append("missing " + ", ".join(_key_name(k, names) for k in missing))
            if extra:
                how.append("extra " + ", ".join(_key_name(k, names) for k in extra))
            if not how:
                how.append("the same keys, some more than once")
            out.append(f"keys of {path} are {listed(kb)} instead of {listed(ka)} "
                       f"({'; '.join(how)})")
        return
    for (k, ca), (_, cb) in zip(a.items, b.items):
        _structure_diffs(ca, cb, f"{path}[{_key_name(k, names)}]", names, out)


def _local_keys(obj, keys: dict) -> None:
    if isinstance(obj, (dict, Mapping)):
        for k, v in obj.items():
            keys.setdefault(_key_hash(k), repr(k))
            _local_keys(v, keys)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _local_keys(v, keys)


# NOTE: [key names]
# The records carry dict keys as hashes only. On a mismatch every rank then sends the readable
# names of its own keys (hash, length, repr truncated to _KEY_TEXT bytes; as many as fit in
# KEY_WORDS int64) in one more fixed-size all_gather, so that every rank can name every rank's
# keys and all raise the same message. Keys beyond the buffer show as ``<key #hash>``.
def pack_key_names(obj, buf: bytearray) -> None:
    """Write ``obj``'s dict key names into ``buf`` (KEY_WORDS int64; NOTE: [key names])."""
    keys: dict = {}
    _local_keys(obj, keys)
    buf[:] = bytes(len(buf))
    pos, count, truncated = 8, 0, 0
    for kh, name in keys.items():
        text = name.encode("utf-8", "replace")
        cut = len(text) > _KEY_TEXT
        text = text[:_KEY_TEXT]
        if pos + 11 + len(text) > len(buf):
            truncated = 1
            break
        struct.pack_into("<qHB", buf, pos, kh, len(text), cut)
        buf[pos + 11: pos + 11 + len(text)] = text
        pos += 11 + len(text)
        count += 1
    struct.pack_into("<ii", buf, 0, count, truncated)


def unpack_key_names(out: bytearray, world: int) -> dict:
    """Key hash -> name from every rank's part of a key-name exchange (ranks in order)."""
    names: dict = {}
    stride = KEY_WORDS * 8
    for r in range(world):
        base = r * stride
        count, _ = struct.unpack_from("<ii", out, base)
        pos = base + 8
        for _ in range(max(0, count)):
            if pos + 11 > base + stride:
                break
            kh, n, cut = struct.unpack_from("<qHB", out, pos)
            if pos + 11 + n > base + stride:
                break
            text = bytes(out[pos + 11: pos + 11 + n]).decode("utf-8", "replace")
            names.setdefault(kh, text + ("..." if cut else ""))
            pos += 11 + n
    return names


def _fmt_shape(shape) -> str:
    return "[" + ", ".join("*" if d == -1 else str(d) for d in shape) + "]"


def mismatch_message(out: bytearray, world: int, obj, op: str, me: int | None = None,
                     key_names: dict | None = None, key_order: bool = True) -> str:
    """The message every rank raises. It depends only on the gathered records and ``key_names``
    (every rank's dict keys, from the exchange of NOTE: [key names]), so every rank reports the
    same differences; without ``key_names``, keys this rank does not have show as
    ``<key #hash>``. A description too large for the record is shown in full only by its own
    rank (``me``)."""
    records = [_Record(out, r) for r in range(world)]
    keys: dict = dict(key_names or {})
    _local_keys(obj, keys)  # only adds keys the exchange could not carry
    if me is not None and records[me].valid and not records[me].complete:
        # Too large for the record: this rank can still show its own description in full.
        tokens: list = []
        _describe(obj, tokens, [], key_order)
        records[me].tokens, records[me].complete = tokens, True
    trees, shapes_text, dtypes_text = [], [], []
    for rec in records:
        tree = None
        if rec.valid and rec.complete:
            try:
                tree, end = _parse(rec.tokens, 0)
                if end != len(rec.tokens):
                    tree = None
            except IndexError:
                tree = None
        trees.append(tree)
        if tree is not None:
            shapes_text.append(_render(tree, keys, _shape_text))
            dtypes_text.append(_render(tree, keys, _dtype_text))
        elif not rec.valid:
            shapes_text.append("<not a numguard shape record>")
            dtypes_text.append("<unknown>")
        else:
            shapes_text.append(f"<{rec.n_leaves} leaves: too large to show>")
            dtypes_text.append("<too large to show>")
    operation = records[0].op if records[0].valid else op
    lines = [
        "Cannot apply desired operation due to shape mismatches. "
        "All shapes across devices must be valid.",
        "",
        f"Operation: `{operation}`",
        "Input shapes:",
    ]
    lines += [f"  - Process {r}: {shapes_text[r]}" for r in range(world)]
    lines.append("Input dtypes:")
    lines += [f"  - Process {r}: {dtypes_text[r]}" for r in range(world)]
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
        diffs += _differences(r, rec, rref, trees[ref], trees[r], keys)
    lines.append(f"What differs (compared with process {ref}):")
    lines += diffs or ["  - (descriptions differ but no field-level difference was found)"]
    lines.append("Call sites:")
    lines += [f"  - Process {r}: {rec.site or '<unknown>'}" for r, rec in enumerate(records)]
    return "\n".join(lines)


def _differences(r: int, rec: _Record, rref: _Record, ta, tb, keys: dict) -> list:
    """Lines saying how process ``r``'s record differs from the reference."""
    if not rec.valid:
        return [f"  - Process {r}: sent a record numguard cannot read (a different numguard "
                "version, or a different collective at this point)"]
    if rec.op_hash != rref.op_hash:
        # Another collective: its arguments and inputs differ as a matter of course.
        return [f"  - Process {r}: operation `{rec.op}` instead of `{rref.op}` (the ranks are at "
                "different collectives)"]
    diffs = []
    if rec.details_hash != rref.details_hash:
        diffs.append(f"  - Process {r}: arguments `{rec.details}` instead of `{rref.details}`")
    if ta is None or tb is None:
        if rec.structure_hash != rref.structure_hash:
            if rec.sorted_structure_hash == rref.sorted_structure_hash:
                what = f"the same dict keys in another order ({_ORDER_HINT})"
            else:
                what = "structure: container types, lengths, dict keys or leaf types"
        elif rec.shape_hash != rref.shape_hash:
            what = "shapes"
        elif rec.full != rref.full:
            what = "dtypes"
        else:
            return diffs
        diffs.append(f"  - Process {r}: {what} (too many tensors to compare one by one)")
        return diffs
    structure: list = []
    _structure_diffs(ta, tb, "input", keys, structure)
    la, lb = _leaves(ta, "input", keys, []), _leaves(tb, "input", keys, [])
    if structure:
        leaves = "leaf" if len(lb) == 1 else "leaves"
        head = f"{len(lb)} {leaves} instead of {len(la)}: " if len(la) != len(lb) else ""
        shown = "; ".join(structure[:4]) + ("; ..." if len(structure) > 4 else "")
        diffs.append(f"  - Process {r}: structure ({head}{shown})")
        return diffs
    for (_, a), (path, b) in zip(la, lb):
        if a.kind != "tensor":
            continue
        if a.dims != b.dims:
            if len(a.dims) != len(b.dims):
                how = f"ndim {len(b.dims)} instead of {len(a.dims)}"
            elif _prod(a.dims) == _prod(b.dims):
                how = "same number of elements, different shape"
            else:
                idx = [i for i, (x, y) in enumerate(zip(a.dims, b.dims)) if x != y]
                verb = "differs" if len(idx) == 1 else "differ"
                how = "dim " + ", ".join(map(str, idx)) + " " + verb
            diffs.append(f"  - Process {r}: shape of {path} is {_fmt_shape(b.dims)} "
                         f"instead of {_fmt_shape(a.dims)} ({how})")
        if a.dtype != b.dtype:
            diffs.append(f"  - Process {r}: dtype of {path} is {_dtype_name(b.dtype)} "
                         f"instead of {_dtype_name(a.dtype)}")
    return diffs


def _prod(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def check_shapes(obj, op: str | None = None, group=None, timeout: float | None = None,
                 details: str = "", key_order: bool = True, site: str | None = None) -> None:
    """Check that every rank of ``group`` passes the same structure, shapes and dtypes.

    Args:
        obj: a tensor, or any nesting of lists/tuples/dicts (any Mapping) of tensors (None and
            scalars allowed as leaves; scalar values are not compared, only their types).
        op: name shown in the message (e.g. ``"torch.distributed.all_reduce"``); ranks must agree
            on it too.
        group: process group (default group when None).
        timeout: seconds to wait for every rank (``NUMGUARD_DIST_TIMEOUT``, default 60).
        details: other arguments ranks must agree on, as text (e.g. ``"src=0"``); compared, and
            shown when they differ.
        key_order: dicts must hold their keys in the same order on every rank (default), as
            code that pairs values by position needs (Accelerate's operations, loops over
            ``.items()``); False compares dicts by key whatever their order (NOTE: [dict order]).
        site: where the collective is called, shown in the message (default: the first caller
            outside numguard and torch).

    Structure means container types (list, tuple, dict), lengths, dict keys and their order, and
    leaf types (tensor, None, or the scalar's type). Runs one all_reduce of two int64 (the hash
    of this rank's record, see NOTE: [check record layout]) on numguard's own gloo group over the
    same ranks (NOTE: [own process group] in channel.py); only when the hashes differ, one
    all_gather of the fixed-size records and one of the ranks' dict key names (NOTE: [key
    names]). On a mismatch every rank raises :class:`DistributedOperationException` listing the
    same differences, each rank's dict keys by name; a rank that does not arrive in time makes the
    others raise :class:`DistributedTimeoutError` naming it, after which numguard stops checking
    the group (warned once). Does nothing without an initialized process group, with one rank,
    or on a rank outside ``group``.
    """
    if not _channel.is_initialized():
        return
    if group is not None and _c10d_not_in_group(group):
        return
    st = _channel.group_state(group)
    if st.world == 1:
        return
    op_name = op if op is not None else "numguard.distributed.check_shapes"
    if st.broken is not None:
        st.warn_once("broken", (
            f"numguard.distributed: `{op_name}` and later collectives of process group "
            f"{st.name!r} are not checked: numguard stopped using the group after: {st.broken}"))
        return
    if site is None:
        site = _channel.call_site()
    with _channel.exclusive(st, f"the check of `{op_name}`"):
        _check(st, obj, op_name, site, timeout, details, key_order)


def _check(st, obj, op_name: str, site: str, timeout, details: str, key_order: bool) -> None:
    if FAST_PATH == "all_reduce":
        full = description_hash(obj, op_name, details, key_order)
        # NOTE: [agreement by all_reduce] MAX of (h, -h) gives (max h, -min h): equal hashes on
        # every rank iff max == min. Only when they differ do the ranks (all of them, since they
        # all see the same result) gather the full records to write the message.
        h = (full ^ _MAGIC) & _HASH_MASK
        rb, rh, rd = st.reduce_buffers(2)
        struct.pack_into("<2q", rb, 0, h, -h)
        if rd is not rh:
            rd.copy_(rh)
        _collectives.timed_all_reduce(st, rd, _MAX, f"`{op_name}`", site, timeout)
        if rd is not rh:
            rh.copy_(rd)
        hi, neg_lo = struct.unpack_from("<2q", rb, 0)
        if hi == -neg_lo:
            return
    encode(obj, op_name, site, st.gather_buffers(RECORD_WORDS)[0], details, key_order)
    out = _collectives.timed_all_gather(st, RECORD_WORDS, f"`{op_name}`", site, timeout)
    stride = RECORD_WORDS * 8
    magics, fulls = set(), set()
    for r in range(st.world):
        magic, full = struct.unpack_from("<2q", out, r * stride)
        magics.add(magic)
        fulls.add(full)
    if magics == {_MAGIC} and len(fulls) == 1:
        return
    names = None
    if magics == {_MAGIC}:
        # Every rank reads the same records, so all of them (and only they) come here.
        names = _gather_key_names(st, obj, op_name, site, timeout)
    raise DistributedOperationException(
        mismatch_message(out, st.world, obj, op_name, st.rank, names, key_order))


def _gather_key_names(st, obj, op_name: str, site: str, timeout) -> dict | None:
    """Every rank's dict key names (NOTE: [key names]); None when the exchange failed (the
    message then names only this rank's keys)."""
    try:
        pack_key_names(obj, st.gather_buffers(KEY_WORDS)[0])
        out = _collectives.timed_all_gather(st, KEY_WORDS, f"the key names of `{op_name}`", site, timeout)
        return unpack_key_names(out, st.world)
    except DistributedOperationException:
        return None


def _c10d_not_in_group(group) -> bool:
    from torch.distributed import distributed_c10d

    return distributed_c10d._rank_not_in_group(group)
