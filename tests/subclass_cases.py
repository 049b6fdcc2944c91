"""Tensor subclasses through the inspector, one case per process (tests/test_tensor_subclasses.py):
a segfault in the recorder then fails one test instead of killing pytest.

    python tests/subclass_cases.py CASE WHERE BACKWARD OPS

CASE names the subclass, WHERE where it appears (output, input, parameter), BACKWARD and OPS are
0/1. Prints one JSON line: whether the healthy batches were silent, whether the NaN batch was
reported and by which module, and numguard's warnings. The backend is NUMGUARD_BACKEND's."""
import json
import sys
import warnings

import torch
from torch import nn
from torch.testing._internal.two_tensor import TwoTensor

import numguard
from numguard.errors import InspectorWarning, NonFiniteWarning

NAN = float("nan")


class Plain(torch.Tensor):
    """A plain subclass (`class T(torch.Tensor)`): its own storage, no __torch_dispatch__."""


class Opaque(torch.Tensor):
    """A wrapper subclass without __tensor_flatten__: no storage, its values where numguard cannot
    see them."""

    @staticmethod
    def __new__(cls, elem):
        return torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype, device=elem.device,
                                                   requires_grad=elem.requires_grad)

    def __init__(self, elem):
        self.elem = elem

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def unwrap(x):
            return x.elem if isinstance(x, Opaque) else x

        args = torch.utils._pytree.tree_map(unwrap, args)
        kwargs = torch.utils._pytree.tree_map(unwrap, kwargs or {})
        out = func(*args, **kwargs)
        return torch.utils._pytree.tree_map_only(torch.Tensor, Opaque, out)


class Float8Like(torch.Tensor):
    """A float8 training tensor of torchao's shape: float8 `_data`, a float32 `_scale` and the
    original dtype; it stands for `_data / _scale`. Operations run on those values (torchao runs
    its matmuls in float8; what numguard reads is the same)."""

    @staticmethod
    def __new__(cls, data, scale, orig_dtype):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=orig_dtype, device=data.device,
                                                   requires_grad=False)

    def __init__(self, data, scale, orig_dtype):
        self._data, self._scale, self._orig_dtype = data, scale, orig_dtype

    def __tensor_flatten__(self):
        return ["_data", "_scale"], {"orig_dtype": self._orig_dtype}

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return Float8Like(inner["_data"], inner["_scale"], meta["orig_dtype"])

    def __repr__(self):
        return f"Float8Like(data={self._data!r}, scale={self._scale!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):  # nn.Parameter
            x = args[0]
            return Float8Like(func(x._data), func(x._scale), x._orig_dtype)

        def unwrap(x):
            return (x._data.to(x._orig_dtype) / x._scale).to(x._orig_dtype) if isinstance(x, Float8Like) else x

        args = torch.utils._pytree.tree_map(unwrap, args)
        kwargs = torch.utils._pytree.tree_map(unwrap, kwargs or {})
        return func(*args, **kwargs)


def to_float8(x, dtype=torch.float8_e4m3fn, scale=None):
    """x cast as torchao casts it: scale = max / amax (or `scale`), data = cast(clamp(x * scale))."""
    fmax = torch.finfo(dtype).max
    if scale is None:
        scale = fmax / x.detach().abs().amax().clamp(min=1e-12).to(torch.float32)
    scale = torch.as_tensor(scale, dtype=torch.float32)
    data = (x.detach().to(torch.float32) * scale).clamp(-fmax, fmax).to(dtype)
    return Float8Like(data, scale, x.dtype)


def two(x, bad):
    """A TwoTensor whose second part holds the NaN when `bad`."""
    b = x.clone()
    if bad:
        with torch.no_grad():
            b.view(-1)[0] = NAN
    return TwoTensor(x, b)


def plain(x, bad):
    y = x.clone()
    if bad:
        with torch.no_grad():
            y.view(-1)[0] = NAN
    return y.as_subclass(Plain)


def opaque(x, bad):
    y = x.clone()
    if bad:
        with torch.no_grad():
            y.view(-1)[0] = NAN
    return Opaque(y)


def float8(x, bad):
    """A Float8Like whose data holds the NaN when `bad` (the scale stays finite)."""
    y = to_float8(x)
    if bad:
        y._data.view(-1)[0] = NAN
    return y


MAKERS = {"two_tensor": two, "plain": plain, "opaque": opaque, "float8": float8}


class Wrap(nn.Module):
    """Returns its input as the subclass (the NaN inside when `bad`)."""

    def __init__(self, make):
        super().__init__()
        self.make = make
        self.bad = False

    def forward(self, y):
        return self.make(y, self.bad)


class OutputModel(nn.Module):
    def __init__(self, make):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.wrap = Wrap(make)

    def forward(self, x):
        return self.wrap(self.lin(x))


class InputModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x)


class ParameterModel(nn.Module):
    def __init__(self, make):
        super().__init__()
        self.make = make
        self.w = nn.Parameter(make(torch.randn(4, 4), False))

    def forward(self, x):
        return x @ self.w


def main(case, where, backward, ops):
    make = MAKERS[case]
    torch.manual_seed(0)
    model = {"output": lambda: OutputModel(make), "input": InputModel,
             "parameter": lambda: ParameterModel(make)}[where]()
    x = torch.randn(2, 4, requires_grad=backward and where == "input")
    result = {"healthy_silent": True, "reported": None, "warnings": []}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        insp = numguard.watch(model, report_to=None, backward=backward, ops=ops)

        def step(bad):
            if where == "output":
                model.wrap.bad = bad
                inp = x
            elif where == "input":
                inp = make(x, bad)
            else:
                inp = x
                if bad:
                    with torch.no_grad():
                        inner = model.w.b if case == "two_tensor" else (
                            model.w.elem if case == "opaque" else model.w._data if case == "float8" else model.w)
                        inner.view(-1)[0] = NAN
            out = model(inp)
            if backward:
                out.sum().backward()
                insp.check("optimizer step")
            return out

        for _ in range(2):
            step(False)
        result["healthy_silent"] = not any(issubclass(w.category, (NonFiniteWarning,)) for w in caught)
        try:
            step(True)
        except numguard.NonFiniteError as exc:
            result["reported"] = exc.module
        insp.close(check=False)
    result["warnings"] = [str(w.message) for w in caught if issubclass(w.category, InspectorWarning)]
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4] == "1")
