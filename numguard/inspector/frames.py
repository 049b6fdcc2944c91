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

# Line kinds, indexes into numguard.schema.LINE_KINDS; bit 4 marks a line Transformers does not print.
TENSOR, NONE, NOT_A_TENSOR = 0, 1, 2
EXTRA = 4

_INPUT_LABELS = tuple(f"input[{i}]" for i in range(64))
_OUTPUT_LABELS = tuple(f"output[{i}]" for i in range(64))
ONE_IN_ONE_OUT_LABELS = ("input[0]", "output")
ONE_IN_ONE_OUT_KINDS = (TENSOR, TENSOR)


class Owner:
    """What frames belong to: a watched module, or a name given to record_frame."""
    __slots__ = ("index", "name", "cls", "ref", "wnames", "widx", "flag", "flag_batch", "headroom", "off",
                 "is_root", "is_top", "returned", "__weakref__")

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


def _key_label(prefix, key):
    if isinstance(key, str) and key.isidentifier():
        return f"{prefix}.{key}"
    return f"{prefix}[{key!r}]"


def _container_items(value, label):
    """(label, item) pairs of a list, tuple, dict or dataclass instance; None for anything else."""
    if isinstance(value, (tuple, list)):
        return iter([(f"{label}[{i}]", v) for i, v in enumerate(value)])
    if isinstance(value, dict):
        return iter([(_key_label(label, k), v) for k, v in list(value.items())])
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return iter([(f"{label}.{f.name}", getattr(value, f.name, None)) for f in dataclasses.fields(value)])
    return None


def _flatten_extra(value, label, xs, labels, kinds):
    """numguard-only lines for the contents of a container (list, tuple, dict, dataclass), depth
    first. Every tensor inside is recorded, however many and however deep (an explicit stack, not
    recursion); only a container that holds itself is not followed again, on a line saying so."""
    items = _container_items(value, label)
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
            inner = _container_items(v, lab)
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
    """Tensors of a module call and the labels and kinds of every line, in Transformers' order."""
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
    return xs, labels, kinds


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
