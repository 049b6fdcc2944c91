"""Tensor subclasses as module outputs, inputs and parameters: numguard never crashes on them,
reports a NaN held inside a subclass it can read (its own storage, or inner tensors through
``__tensor_flatten__``: TwoTensor, torchao's float8 / NF4 tensors), and says once, naming the
module and the line, what it cannot read. Each case runs in its own process
(tests/subclass_cases.py): a segfault fails the case instead of killing pytest."""
import json
import os
import subprocess
import sys

import pytest
import torch

import numguard

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def run_case(backend, case, where, backward=False, ops=False):
    env = dict(os.environ, NUMGUARD_BACKEND=backend)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    if backend == "torch":
        env.pop("NUMGUARD_REQUIRE_NATIVE", None)
    proc = subprocess.run([sys.executable, os.path.join(HERE, "subclass_cases.py"), case, where,
                           str(int(backward)), str(int(ops))], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, (f"{case} as {where} (backend={backend}, backward={backward}, ops={ops}) "
                                  f"ended with {proc.returncode}:\n{proc.stdout}\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


REPORTED_BY = {"output": "wrap", "input": "lin", "parameter": ""}


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
@pytest.mark.parametrize("where", ["output", "input", "parameter"])
@pytest.mark.parametrize("case", ["two_tensor", "plain"])
def test_a_nan_inside_a_readable_subclass_is_reported(backend, case, where, backward):
    got = run_case(backend, case, where, backward)
    assert got["healthy_silent"], got
    assert got["warnings"] == [], got  # everything was read: nothing to warn about
    assert got["reported"] == REPORTED_BY[where], got


@pytest.mark.parametrize("ops", [False, True], ids=["modules", "ops"])
@pytest.mark.parametrize("where", ["output", "input", "parameter"])
def test_a_nan_in_the_data_of_a_float8_training_tensor_is_reported(backend, where, ops):
    """tests/subclass_cases.Float8Like (torchao's float8 training tensor's shape: float8 _data and a
    _scale), read through data / scale (numguard.float8)."""
    got = run_case(backend, "float8", where, ops=ops)
    assert got["healthy_silent"], got
    assert got["warnings"] == [], got
    assert got["reported"] == REPORTED_BY[where], got


@pytest.mark.parametrize("where", ["output", "parameter"])
def test_operation_mode_reads_subclasses_too(backend, where):
    got = run_case(backend, "two_tensor", where, ops=True)
    assert got["healthy_silent"], got
    assert got["reported"] == REPORTED_BY[where], got


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
@pytest.mark.parametrize("where", ["output", "input", "parameter"])
def test_an_unreadable_subclass_is_skipped_with_one_warning_naming_module_and_line(backend, where, backward):
    got = run_case(backend, "opaque", where, backward)
    assert got["healthy_silent"], got
    assert got["reported"] is None  # its values are out of reach: said, not guessed
    label = {"output": "output of module 'wrap'", "input": "input[0] of module 'lin'",
             "parameter": "w of module '(root module)'"}[where]
    named = [w for w in got["warnings"] if label in w]
    assert len(named) == 1, got["warnings"]  # once, over three batches
    assert "Opaque" in named[0] and "NOT checked" in named[0]


def test_inner_tensors_are_one_record_covering_every_part():
    from torch.testing._internal.two_tensor import TwoTensor
    from numguard.inspector.frames import plain_values

    a = torch.tensor([1.0, -2.0])
    b = torch.tensor([float("inf"), 0.5])
    values = plain_values(TwoTensor(a, b))
    assert type(values) is torch.Tensor
    assert sorted(values.tolist()) == sorted([1.0, -2.0, float("inf"), 0.5])
    stats = numguard.tensor_stats(values)
    assert stats[numguard.STAT_FIELDS.index("pos_inf")] == 1


def test_a_plain_subclass_is_read_in_place_without_its_overrides():
    from numguard.inspector.frames import plain_values

    class Loud(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            raise AssertionError("numguard ran the subclass's own override")

    x = torch.arange(4.0)
    loud = x.as_subclass(Loud)
    values = plain_values(loud)
    assert type(values) is torch.Tensor
    assert values.data_ptr() == x.data_ptr()  # the same memory, no copy
