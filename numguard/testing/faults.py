"""Fault injection: flip one bit of a chosen class in a module's output, in the output of a matrix
product its forward runs, in a DDP gradient bucket after its all_reduce, or in a weight, once (a
transient fault) or at every call (a device that fails every time), on one rank or all; to check
what numguard finds in your own job.

    from numguard.testing import faults
    with faults.inject_output(model.layers[3].mlp, "exponent", at_call=120):
        train(model)           # numguard should name layers.3.mlp at the batch of call 120

Bit classes (``BIT_CLASSES``), for a float format with E exponent and M mantissa bits:
``"sign"``; ``"exponent"``: one of the exponent bits whose flip scales the value by 2^8 or more
(bit k of the exponent, k >= 3: a factor of 2^(2^k), up or down as the bit was 0 or 1);
``"high_mantissa"``: one of the top 3 mantissa bits (a change of 12.5% to 50%); ``"low_mantissa"``:
one of the low M/2 bits (a change below 2^-(M/2) of the value, what only a bitwise comparison
sees). A persistent fault flips the same element and bit at every call (a failing unit). The element and the bit are drawn from ``random.Random(seed)``; nothing is read back to the
host while injecting (``Fault.records()`` reads what was flipped, afterwards).
"""
from __future__ import annotations

import random

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .. import process as _process

BIT_CLASSES = ("sign", "exponent", "high_mantissa", "low_mantissa")
# dtype -> (exponent bits, mantissa bits, the integer dtype of the same width)
_LAYOUT = {torch.float64: (11, 52, torch.int64), torch.float32: (8, 23, torch.int32),
           torch.float16: (5, 10, torch.int16), torch.bfloat16: (8, 7, torch.int16)}
_aten = torch.ops.aten
MATMUL_OPS = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default}


def choose_bit(dtype, kind, rng) -> int:
    """The bit position (0 = lowest) to flip in an element of `dtype` for bit class `kind`."""
    if kind not in BIT_CLASSES:
        raise ValueError(f"numguard.testing.faults: kind={kind!r} is not a bit class; use one of {BIT_CLASSES}")
    if dtype not in _LAYOUT:
        raise TypeError(f"numguard.testing.faults: cannot flip bits of a {dtype} tensor; use one of "
                        f"{', '.join(str(d) for d in _LAYOUT)}")
    exp, mant, _ = _LAYOUT[dtype]
    if kind == "sign":
        return exp + mant
    if kind == "exponent":
        return mant + rng.randrange(3, exp)
    if kind == "high_mantissa":
        return rng.randrange(mant - 3, mant)
    return rng.randrange(0, max(1, mant // 2))


def flipped(x, index, bit):
    """A copy of tensor `x` with bit `bit` of its flat element `index` flipped (autograd flows
    through the other elements). Device ops only."""
    _, _, int_dtype = _LAYOUT[x.dtype]
    width = torch.iinfo(int_dtype).bits
    mask = -(1 << (width - 1)) if bit == width - 1 else 1 << bit
    with torch.no_grad():
        value = x.detach().reshape(-1)[index].clone()
        new = torch.bitwise_xor(value.view(int_dtype), mask).view(x.dtype)
        where = torch.zeros(x.numel(), dtype=torch.bool, device=x.device)
        where[index] = True
        where = where.view(x.shape)
    return torch.where(where, new, x), value, new


class Fault:
    """One injected fault: `fired` counts the flips; remove() (or leaving the `with`) takes it out."""

    def __init__(self, kind, persistent, at_call, rank, seed, bit=None):
        if kind not in BIT_CLASSES:
            raise ValueError(f"numguard.testing.faults: kind={kind!r} is not a bit class; use one of {BIT_CLASSES}")
        if type(at_call) is not int or at_call < 0:
            raise ValueError(f"numguard.testing.faults: at_call={at_call!r} must be a whole number >= 0 "
                             "(the 0-indexed call at which the fault fires)")
        self.kind, self.persistent, self.at_call, self.rank = kind, bool(persistent), at_call, rank
        self.rng = random.Random(seed)
        self.bit = bit         # None: drawn from the class at each flip
        self.calls = 0
        self.fired = 0
        self.log = []          # (where, index, bit, value before, value after, finite abs max before): device tensors
        self.handles = []

    def due(self) -> bool:
        """Whether this call flips (counts the call)."""
        call, self.calls = self.calls, self.calls + 1
        if self.rank is not None and _process.rank(default=0) != self.rank:
            return False
        return call >= self.at_call if self.persistent else call == self.at_call

    def flip(self, x, where):
        if self.persistent and self.log and self.log[0][1] < x.numel():
            index, bit = self.log[0][1], self.log[0][2]   # a failing device: the same place every time
        else:
            index = self.rng.randrange(x.numel())
            bit = choose_bit(x.dtype, self.kind, self.rng) if self.bit is None else self.bit
        width = torch.iinfo(_LAYOUT[x.dtype][2]).bits
        if not 0 <= bit < width:
            raise ValueError(f"numguard.testing.faults: bit={bit} is outside a {x.dtype} element (0..{width - 1})")
        # whether the flipped value stands out of its tensor (an abs-max baseline sees only that)
        amax = x.detach().abs().nan_to_num(0.0, 0.0, 0.0).amax()
        out, before, after = flipped(x, index, bit)
        self.fired += 1
        self.log.append((where, index, bit, before, after, amax))
        return out

    def records(self) -> list:
        """What was flipped, read to the host: dicts of where, index, bit, before, after, factor
        (|after| / |before|) and over_amax (|after| / the tensor's largest finite magnitude before
        the flip: above 1, the flip made the tensor's abs max)."""
        out = []
        for where, index, bit, before, after, amax in self.log:
            b, a, m = float(before), float(after), float(amax)
            factor = abs(a) / abs(b) if b not in (0.0,) and a == a else float("inf")
            over = abs(a) / m if m != 0.0 and a == a else float("inf")
            out.append({"where": where, "index": index, "bit": bit, "before": b, "after": a, "factor": factor,
                        "over_amax": over})
        return out

    def remove(self):
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()
        return False


def _first_float(value):
    if isinstance(value, torch.Tensor):
        return value if value.dtype in _LAYOUT and value.numel() else None
    if isinstance(value, (list, tuple)):
        for v in value:
            found = _first_float(v)
            if found is not None:
                return found
    return None


def _replace_first(value, old, new):
    if value is old:
        return new
    if isinstance(value, (list, tuple)):
        items = [_replace_first(v, old, new) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return value


def inject_output(module, kind="exponent", *, persistent=False, at_call=0, rank=None, seed=0,
                  bit=None) -> Fault:
    """Flip one bit of one element of `module`'s output (its first floating tensor) at its
    `at_call`-th call (0-indexed), or at every call from then on with `persistent=True`; on rank
    `rank` only (None: every process). The hook runs before every other forward hook of the module
    (numguard's included), as if the module itself had computed the wrong value. `bit`: flip this
    bit position instead of one drawn from `kind`."""
    fault = Fault(kind, persistent, at_call, rank, seed, bit)

    def hook(mod, args, output):
        if not fault.due():
            return None
        x = _first_float(output)
        if x is None:
            return None
        return _replace_first(output, x, fault.flip(x, "output"))

    fault.handles.append(module.register_forward_hook(hook, prepend=True))
    return fault


class _MatmulFlips(TorchDispatchMode):
    def __init__(self, fault):
        super().__init__()
        self.fault = fault

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in MATMUL_OPS and isinstance(out, torch.Tensor) and out.dtype in _LAYOUT and out.numel() \
                and self.fault.due():
            out = self.fault.flip(out, str(func.overloadpacket.__name__))
        return out


def inject_matmul(module, kind="exponent", *, persistent=False, at_call=0, rank=None, seed=0,
                  bit=None) -> Fault:
    """Flip one bit of one element of the output of a matrix product (aten mm, addmm, bmm,
    baddbmm) that `module`'s forward runs: the `at_call`-th such product (0-indexed) counted over
    every call of the module, or every one from then on with `persistent=True`."""
    fault = Fault(kind, persistent, at_call, rank, seed, bit)
    modes = []

    def enter(mod, args):
        mode = _MatmulFlips(fault)
        mode.__enter__()
        modes.append(mode)

    def leave(mod, args, output):
        if modes:
            modes.pop().__exit__(None, None, None)

    fault.handles.append(module.register_forward_pre_hook(enter))
    fault.handles.append(module.register_forward_hook(leave, always_call=True))
    return fault


def inject_weight(module, name="weight", kind="exponent", *, rank=None, seed=0, bit=None) -> Fault:
    """Flip one bit of one element of `module`'s parameter `name` now, in place (a corrupted copy
    of the weights on one rank: what the replica check finds). remove() puts the value back."""
    param = getattr(module, name, None)
    if not isinstance(param, torch.Tensor):
        raise ValueError(f"numguard.testing.faults: {type(module).__name__} has no tensor {name!r}")
    fault = Fault(kind, False, 0, rank, seed, bit)
    if fault.due():
        with torch.no_grad():
            out = fault.flip(param.detach(), f"parameter {name}")
            old = param.detach().clone()
            param.copy_(out)

        class _Restore:
            def remove(self):
                with torch.no_grad():
                    param.copy_(old)

        fault.handles.append(_Restore())
    return fault


class _Disarm:
    """remove() of a fault whose hook cannot be taken off (a DDP comm hook): it stops firing."""

    def __init__(self, fault):
        self.fault = fault

    def remove(self):
        self.fault.rank = -1   # no process has rank -1: never due again


def inject_bucket(ddp, kind="exponent", *, persistent=False, at_call=0, rank=None, seed=0, bit=None,
                  hook=None, state=None) -> Fault:
    """Flip one bit of one element of a DDP gradient bucket after its all_reduce, on rank `rank`
    (None: every process): the `at_call`-th bucket reduced (0-indexed, counted over every bucket
    of every step), or every one from then on with `persistent=True`. The bucket's values are the
    reduced gradients DDP writes into the parameters' .grad, so the rank's gradients differ from
    the other ranks' (what the replica check's gradient comparison finds). Installed as DDP's comm
    hook, wrapping `hook` (with `state`; default: DDP's own all_reduce, on its process group); DDP
    takes one comm hook, set before the first backward, and keeps it: remove() disarms it."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    inner = hook or default_hooks.allreduce_hook
    fault = Fault(kind, persistent, at_call, rank, seed, bit)

    def after_reduce(fut):
        value = fut.value()
        tensor = value[0] if isinstance(value, (list, tuple)) else value
        if tensor.dtype in _LAYOUT and tensor.numel() and fault.due():
            with torch.no_grad():
                tensor.copy_(fault.flip(tensor, "bucket"))
        return tensor

    def faulty_hook(hook_state, bucket):
        return inner(hook_state, bucket).then(after_reduce)

    ddp.register_comm_hook(state if hook is not None else getattr(ddp, "process_group", None), faulty_hook)
    fault.handles.append(_Disarm(fault))
    return fault


__all__ = ["BIT_CLASSES", "Fault", "choose_bit", "flipped", "inject_bucket", "inject_matmul", "inject_output",
           "inject_weight"]
