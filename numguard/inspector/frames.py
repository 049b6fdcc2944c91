"""What a frame is: the owner it belongs to, the record of one module call (or one frame given to
``record_frame``), and how a call's arguments and outputs become report lines.

A frame's lines come in Transformers' order (inputs, keyword inputs, outputs); lines Transformers
does not print (keyword inputs, the contents of containers it shows as "not a tensor") are marked
``EXTRA``. Their tensors are recorded whatever the report shows, so a NaN is never missed.
"""
from __future__ import annotations

import dataclasses
import sys
from typing import NamedTuple

import torch

from ..float8 import float8_parts, float8_values
from ..schema import LINE_EXTRA, LINE_KIND_MASK, LineKind

# Line codes: a numguard.schema.LineKind, or-ed with LINE_EXTRA for a line Transformers does not
# print. Plain ints, so the codes the recorders keep (and graph.py's slot keys) stay what they were.
TENSOR, NONE, NOT_A_TENSOR = LineKind.TENSOR.value, LineKind.NONE.value, LineKind.NOT_A_TENSOR.value
EXTRA = LINE_EXTRA

_INPUT_LABELS = tuple(f"input[{i}]" for i in range(64))
_OUTPUT_LABELS = tuple(f"output[{i}]" for i in range(64))
ONE_IN_ONE_OUT_LABELS = ("input[0]", "output")
ONE_IN_ONE_OUT_KINDS = (TENSOR, TENSOR)


class Owner:
    """What frames belong to: a watched module, or a name given to record_frame."""
    __slots__ = ("index", "name", "cls", "ref", "wnames", "widx", "flag", "flag_batch", "headroom", "off",
                 "is_root", "is_top", "returned", "quant_row", "__weakref__")

    def __init__(self, index, name, cls, ref=None, headroom=0.0):
        self.index = index
        self.name = name
        self.cls = cls
        self.ref = ref            # weak reference to the module (None for record_frame owners)
        self.wnames = ()          # its own parameters' names and their rows in the weight table
        self.widx = ()
        self.flag = None          # 0-dim device flag: NaN when one of its weights is non-finite
        self.flag_batch = -1      # the batch whose first frame carried the flag
        self.headroom = headroom  # 0 once it has warned (a module warns once)
        self.off = False          # stopped watching after an internal error
        self.is_root = False
        self.is_top = False       # its return ends a check: the root, or a module called outside it
        self.returned = False     # its forward returned normally (NOTE: [forward raised])
        self.quant_row = -1       # watch(quant=)'s row of its outputs, measured by the recorder (-1: not)


class Frame(NamedTuple):
    """One frame. `start`/`n_records`: the records it wrote (contiguous). `positions`: the ring
    position of each tensor line (a tensor recorded earlier in the batch and unchanged since is
    not recorded again: its line points at the earlier record). `lowest`: the oldest position
    it refers to."""
    owner: Owner
    batch: int
    start: int
    labels: tuple
    kinds: tuple
    dtypes: list
    shapes: list
    section: str
    batch_start: int | None   # "Starting batch number" lines go before this frame
    n_records: int
    with_weights: bool
    hf: bool                  # a module frame Transformers would print
    positions: list
    lowest: int


def named_owner(owners, module_name, class_name, headroom):
    """The Owner of record_frame's frames named (module_name, class_name), made at first use
    (`owners`: the inspector's table of them)."""
    owner = owners.get((module_name, class_name))
    if owner is None:
        owner = owners[(module_name, class_name)] = Owner(-1, module_name, class_name, headroom=headroom)
    return owner


def unchecked_warning(owner, label, tensor):
    """(key, message) of the warning for a tensor whose values numguard cannot read (NOTE: [tensor
    subclasses]), said once per key at the first frame that has one."""
    name = "(unknown module)" if owner is None else (owner.name or "(root module)")
    cls = "" if owner is None else f" ({owner.cls})"
    label = label or "a tensor"
    kind = type(tensor).__name__
    return (("unchecked", name, label, kind),
            f"numguard: {label} of module {name!r}{cls} is a tensor subclass ({kind}) without "
            "__tensor_flatten__ and without storage of its own: numguard cannot read its values, "
            "so it is NOT checked for NaN/Inf (its report line shows no values). Give the subclass "
            "__tensor_flatten__ (as torch.compile needs anyway) to have its inner tensors checked.")


def is_parameter_gradients(frame) -> bool:
    """The parameter gradients numguard.backward records before the optimizer step (labels
    ``<parameter>.grad``): after DDP's all_reduce (FSDP's reduce-scatter) they hold every rank's
    contribution, not this rank's own."""
    return frame.section == "backward" and bool(frame.labels) and frame.labels[-1].endswith(".grad")


def local_shard(tensor):
    """A DTensor's local shard (FSDP2 / tensor-parallel parameters and gradients): numguard records
    what this rank holds, never gathering the rest; any other tensor as it is."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is not None and isinstance(tensor, dtensor.DTensor):
        return tensor.to_local()
    return tensor


_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)
_PYTHON_KEY = torch._C.DispatchKey.Python


def _has_own_storage(tensor):
    """Whether `tensor` holds its data itself (a wrapper subclass has no storage: its data lives
    in inner tensors, and reading it as a plain tensor would read no memory at all)."""
    try:
        with torch._C.DisableTorchFunctionSubclass():
            return tensor.numel() == 0 or tensor.untyped_storage().data_ptr() != 0
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def _joined(parts):
    """The elements of several plain tensors as one flat tensor (their common dtype, the first's
    device): one record whose counts and extremes cover every part."""
    if len(parts) == 1:
        return parts[0]
    dtypes = {p.dtype for p in parts}
    dtype = parts[0].dtype
    if len(dtypes) > 1:
        try:
            for p in parts[1:]:
                dtype = torch.promote_types(dtype, p.dtype)
        except RuntimeError:  # float8 takes part in no promotion; float64 holds every value exactly
            dtype = torch.float64
    if dtype.is_complex:  # complex parts are recorded through their real and imaginary values
        dtype = torch.float64
    device = parts[0].device
    flat = []
    for p in parts:
        p = p.detach()
        if p.is_complex():
            p = torch.view_as_real(p)
        flat.append(p.reshape(-1).to(device=device, dtype=dtype))
    return torch.cat(flat)


def plain_values(tensor):
    """What numguard records of `tensor`: a plain torch.Tensor holding its values, or None when
    they cannot be reached (NOTE: [tensor subclasses]).

    A plain tensor: itself. A DTensor: its local shard. A subclass with storage of its own
    (``class T(torch.Tensor)``, with or without ``__torch_dispatch__``): the same memory seen as a
    plain tensor (no copy, none of the subclass's overrides run). A wrapper subclass (TwoTensor,
    torchao's float8 and NF4 tensors: no storage, the data in inner tensors): the elements of its
    inner tensors (``__tensor_flatten__``, followed down), all in one flat tensor, so a NaN/Inf in
    any part is seen. A real float8 wrapper (float8 data and a scale: torchao's float8 training
    tensor): the values it stands for, ``data / scale`` (numguard.float8.float8_values). A wrapper
    without ``__tensor_flatten__``: None."""
    if type(tensor) in _PLAIN_TYPES:
        return tensor
    tensor = local_shard(tensor)
    if type(tensor) in _PLAIN_TYPES:
        return tensor
    if not torch._C._dispatch_keys(tensor).has(_PYTHON_KEY):
        with torch._C.DisableTorchFunctionSubclass():
            return tensor.as_subclass(torch.Tensor)
    flatten = getattr(type(tensor), "__tensor_flatten__", None)
    if flatten is not None:
        parts = float8_parts(tensor)
        if parts is not None:
            return float8_values(parts)
        try:
            names, _ = flatten(tensor)
            inner = [getattr(tensor, name) for name in names]
        except Exception:  # noqa: BLE001 - a subclass's own failure: its values are unreachable
            return None
        parts = []
        for part in inner:
            if not isinstance(part, torch.Tensor):
                continue
            part = plain_values(part)
            if part is None:
                return None
            parts.append(part)
        if not parts:
            return None
        return _joined(parts)
    if _has_own_storage(tensor):
        with torch._C._DisableTorchDispatch():
            return torch.Tensor._make_subclass(torch.Tensor, tensor)
    return None


def tensor_label(labels, kinds, n):
    """The label of the `n`-th tensor line of a frame (None when there is none)."""
    if labels is None or kinds is None:
        return None
    seen = 0
    for label, kind in zip(labels, kinds):
        if kind & LINE_KIND_MASK == TENSOR:
            if seen == n:
                return label
            seen += 1
    return None


def key_label(prefix, key):
    """The label of item `key` of a dict labelled `prefix` (``output.logits``, ``output['a b']``): the
    one way every frame, forward or gradient, names a dict's items."""
    if isinstance(key, str) and key.isidentifier():
        return f"{prefix}.{key}"
    return f"{prefix}[{key!r}]"


def container_items(value, label):
    """(label, item) pairs of a list, tuple, dict or dataclass instance; None for anything else."""
    if isinstance(value, (tuple, list)):
        return iter([(f"{label}[{i}]", v) for i, v in enumerate(value)])
    if isinstance(value, dict):
        return iter([(key_label(label, k), v) for k, v in list(value.items())])
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return iter([(f"{label}.{f.name}", getattr(value, f.name, None)) for f in dataclasses.fields(value)])
    return None


def _flatten_extra(value, label, xs, labels, kinds):
    """numguard-only lines for the contents of a container (list, tuple, dict, dataclass), depth
    first. Every tensor inside is recorded, however many and however deep (an explicit stack, not
    recursion); only a container that holds itself is not followed again, on a line saying so."""
    items = container_items(value, label)
    if items is None:
        return
    # The containers on the path are the stack's (compared by identity: no id(), which a
    # torch.compile trace of the hook would guard on, recompiling per call).
    stack = [(value, items)]
    while stack:
        items = stack[-1][1]
        item = next(items, None)
        if item is None:
            stack.pop()
            continue
        lab, v = item
        if isinstance(v, torch.Tensor):
            xs.append(v)
            labels.append(lab)
            kinds.append(TENSOR | EXTRA)
        elif v is None:
            labels.append(lab)
            kinds.append(NONE | EXTRA)
        else:
            kinds.append(NOT_A_TENSOR | EXTRA)
            inner = container_items(v, lab)
            if inner is not None and any(v is container for container, _ in stack):
                labels.append(f"{lab} (holds itself: not followed again)")
                continue
            labels.append(lab)
            if inner is not None:
                stack.append((v, inner))


def _add(value, label, xs, labels, kinds):
    """One Transformers line for `value` (tensor / None / not a tensor), then numguard's lines for
    the contents of a container that Transformers shows as 'not a tensor'."""
    if isinstance(value, torch.Tensor):
        xs.append(value)
        labels.append(label)
        kinds.append(TENSOR)
    elif value is None:
        labels.append(label)
        kinds.append(NONE)
    else:
        labels.append(label)
        kinds.append(NOT_A_TENSOR)
        _flatten_extra(value, label, xs, labels, kinds)


def flatten_call(args, kwargs, output):
    """Tensors of a module call, the labels and kinds of every line, in Transformers' order, and
    how many of the tensors are inputs (they come first: NOTE: [context records])."""
    xs = []
    labels = []
    kinds = []
    for i, a in enumerate(args):
        _add(a, _INPUT_LABELS[i] if i < 64 else f"input[{i}]", xs, labels, kinds)
    if kwargs:
        for k, v in kwargs.items():
            lab = "kwargs." + k
            if isinstance(v, torch.Tensor):
                xs.append(v)
                labels.append(lab)
                kinds.append(TENSOR | EXTRA)
            elif v is not None:  # keyword arguments left at None carry nothing to show
                labels.append(lab)
                kinds.append(NOT_A_TENSOR | EXTRA)
                _flatten_extra(v, lab, xs, labels, kinds)
    n_inputs = len(xs)
    if isinstance(output, torch.Tensor):
        xs.append(output)
        labels.append("output")
        kinds.append(TENSOR)
    elif isinstance(output, tuple):
        for i, x in enumerate(output):
            lab = _OUTPUT_LABELS[i] if i < 64 else f"output[{i}]"
            if isinstance(x, tuple):
                for j, y in enumerate(x):
                    _add(y, f"{lab}[{j}]", xs, labels, kinds)
            else:
                _add(x, lab, xs, labels, kinds)
    else:
        _add(output, "output", xs, labels, kinds)
    return xs, labels, kinds, n_inputs


def flatten_values(values):
    """Tensors and line kinds of record_frame's values (one line each, no containers followed)."""
    xs = []
    kinds = []
    for v in values:
        if isinstance(v, torch.Tensor):
            xs.append(v)
            kinds.append(TENSOR)
        elif v is None:
            kinds.append(NONE)
        else:
            kinds.append(NOT_A_TENSOR)
    return xs, kinds
