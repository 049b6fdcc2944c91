"""Accelerate's own tests of ``find_executable_batch_size`` (``tests/test_memory_utils.py`` in the
Accelerate repository, 1.x), run against numguard's decorator and, to show that the expectations
are Accelerate's and not ours, against Accelerate's own function.

``accelerate_memory_tests`` holds Accelerate's test methods with their bodies unchanged (only
long lists re-wrapped, and indented one level to sit in the factory); the only
difference is where ``find_executable_batch_size`` and ``release_memory`` come from (the factory's
arguments instead of ``from accelerate.utils.memory import ...``). Accelerate's asserts inside
``with self.assertRaises(...)`` follow the raising call and never run (two of them could not
pass on either implementation: they name a function ``f`` the test does not have); the
``ParityChecks`` below check those messages for real, on both implementations.
"""
from __future__ import annotations

import unittest

import torch
from torch import nn

from numguard import memory as numguard_memory

try:
    from accelerate.utils import memory as accelerate_memory
except Exception:  # noqa: BLE001 - Accelerate missing: only numguard's run
    accelerate_memory = None

# accelerate.test_utils' helpers, as Accelerate resolves them on this machine
if torch.cuda.is_available():
    torch_device = "cuda"
elif getattr(torch, "xpu", None) is not None and torch.xpu.is_available():
    torch_device = "xpu"
else:
    torch_device = "cpu"


def memory_allocated_func():
    return getattr(torch, torch_device).memory_allocated() if torch_device != "cpu" else 0


require_non_cpu = unittest.skipUnless(torch_device != "cpu", "test requires a GPU")


def require_non_torch_xla(test):
    return test


def raise_fake_out_of_memory():
    raise RuntimeError(f"{torch_device.upper()} out of memory.")


class ModelForTest(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear1 = nn.Linear(3, 4)
        self.batchnorm = nn.BatchNorm1d(4)
        self.linear2 = nn.Linear(4, 5)

    def forward(self, x):
        return self.linear2(self.batchnorm(self.linear1(x)))


class BigModelForTest(ModelForTest):
    def __init__(self):
        super().__init__()
        self.linear3 = nn.Linear(5, 1000)

    def forward(self, x):
        return self.linear3(super().forward(x))


def accelerate_memory_tests(find_executable_batch_size, release_memory):
    """Accelerate's ``MemoryTest``, bound to one implementation."""

    class MemoryTest(unittest.TestCase):
        def test_memory_implicit(self):
            batch_sizes = []

            @find_executable_batch_size(starting_batch_size=128)
            def mock_training_loop_function(batch_size):
                nonlocal batch_sizes
                batch_sizes.append(batch_size)
                if batch_size != 8:
                    raise_fake_out_of_memory()

            mock_training_loop_function()
            assert batch_sizes == [128, 115, 103, 92, 82, 73, 65, 58, 52, 46, 41, 36, 32, 28, 25,
                                   22, 19, 17, 15, 13, 11, 9, 8]

        def test_memory_explicit(self):
            batch_sizes = []

            @find_executable_batch_size(starting_batch_size=128)
            def mock_training_loop_function(batch_size, arg1):
                nonlocal batch_sizes
                batch_sizes.append(batch_size)
                if batch_size != 8:
                    raise_fake_out_of_memory()
                return batch_size, arg1

            bs, arg1 = mock_training_loop_function("hello")
            assert batch_sizes == [128, 115, 103, 92, 82, 73, 65, 58, 52, 46, 41, 36, 32, 28, 25,
                                   22, 19, 17, 15, 13, 11, 9, 8]
            assert [bs, arg1] == [8, "hello"]

        def test_start_zero(self):
            @find_executable_batch_size(starting_batch_size=0)
            def mock_training_loop_function(batch_size):
                pass

            with self.assertRaises(RuntimeError) as cm:
                mock_training_loop_function()
                assert "No executable batch size found, reached zero." in cm.exception.args[0]

        def test_approach_zero(self):
            @find_executable_batch_size(starting_batch_size=16)
            def mock_training_loop_function(batch_size):
                if batch_size > 0:
                    raise_fake_out_of_memory()
                pass

            with self.assertRaises(RuntimeError) as cm:
                mock_training_loop_function()
                assert "No executable batch size found, reached zero." in cm.exception.args[0]

        def test_reduce_batch_size_fn_is_used_by_the_decorator(self):
            """The decorator-with-arguments form is what the docstring's example uses,
            so the custom back-off has to survive being bound there."""
            batch_sizes = []

            def halve():
                nonlocal current
                current //= 2
                return current

            current = 256

            @find_executable_batch_size(starting_batch_size=256, reduce_batch_size_fn=halve)
            def mock_training_loop_function(batch_size):
                nonlocal batch_sizes
                batch_sizes.append(batch_size)
                if batch_size > 16:
                    raise_fake_out_of_memory()
                return batch_size

            mock_training_loop_function()
            assert batch_sizes == [256, 128, 64, 32, 16]

        def test_reduce_batch_size_fn_matches_the_direct_call(self):
            """Passing the function directly already worked; the two forms must agree."""

            def run(decorator_form):
                batch_sizes = []
                current = 256

                def halve():
                    nonlocal current
                    current //= 2
                    return current

                def loop(batch_size):
                    batch_sizes.append(batch_size)
                    if batch_size > 16:
                        raise_fake_out_of_memory()
                    return batch_size

                if decorator_form:
                    find_executable_batch_size(starting_batch_size=256,
                                               reduce_batch_size_fn=halve)(loop)()
                else:
                    find_executable_batch_size(loop, starting_batch_size=256,
                                               reduce_batch_size_fn=halve)()
                return batch_sizes

            assert run(decorator_form=True) == run(decorator_form=False)

        def test_default_back_off_is_unchanged(self):
            """Without a custom function the 0.9 multiplier must still apply."""
            batch_sizes = []

            @find_executable_batch_size(starting_batch_size=128)
            def mock_training_loop_function(batch_size):
                nonlocal batch_sizes
                batch_sizes.append(batch_size)
                if batch_size != 8:
                    raise_fake_out_of_memory()
                return batch_size

            mock_training_loop_function()
            assert batch_sizes == [128, 115, 103, 92, 82, 73, 65, 58, 52, 46, 41, 36, 32, 28, 25,
                                   22, 19, 17, 15, 13, 11, 9, 8]

        def test_verbose_guard(self):
            @find_executable_batch_size(starting_batch_size=128)
            def mock_training_loop_function(batch_size, arg1, arg2):
                if batch_size != 8:
                    raise raise_fake_out_of_memory()

            with self.assertRaises(TypeError) as cm:
                mock_training_loop_function(128, "hello", "world")
                assert "Batch size was passed into `f`" in cm.exception.args[0]
                assert "`f(arg1='hello', arg2='world')" in cm.exception.args[0]

        def test_any_other_error(self):
            @find_executable_batch_size(starting_batch_size=16)
            def mock_training_loop_function(batch_size):
                raise ValueError("Oops, we had an error!")

            with self.assertRaises(ValueError) as cm:
                mock_training_loop_function()
                assert "Oops, we had an error!" in cm.exception.args[0]

        @require_non_cpu
        @require_non_torch_xla
        def test_release_memory(self):
            starting_memory = memory_allocated_func()

            if torch_device.startswith("hpu"):
                # hpu has a minimum memory allocation that cannot be released,
                # we need to surpass it by using a bigger model (>5767296 bytes)
                model = BigModelForTest()
            else:
                model = ModelForTest()

            model.to(torch_device)
            assert memory_allocated_func() > starting_memory
            model = release_memory(model)
            assert memory_allocated_func() == starting_memory

    return MemoryTest


def parity_checks(find_executable_batch_size, release_memory):
    """What Accelerate's dead asserts meant, checked after the raise, plus the other behaviour a
    drop-in keeps: messages, the other out-of-memory messages, arguments passed through, state
    kept between calls, nothing logged on a first-try success."""

    class ParityChecks(unittest.TestCase):
        def test_zero_messages(self):
            for start, fail in ((0, False), (16, True), (1, True)):
                def loop(batch_size):
                    if fail:
                        raise_fake_out_of_memory()

                decorated = find_executable_batch_size(starting_batch_size=start)(loop)
                with self.assertRaises(RuntimeError) as cm:
                    decorated()
                assert "No executable batch size found, reached zero." in cm.exception.args[0]

        def test_verbose_guard_message(self):
            @find_executable_batch_size(starting_batch_size=128)
            def mock_training_loop_function(batch_size, arg1, arg2):
                return batch_size

            with self.assertRaises(TypeError) as cm:
                mock_training_loop_function(128, "hello", "world")
            msg = cm.exception.args[0]
            assert msg.startswith("Batch size was passed into `mock_training_loop_function` as "
                                  "the first argument when called.")
            assert msg.endswith("`mock_training_loop_function(arg1=hello, arg2=world)`")

        def test_other_error_is_the_same_object(self):
            err = ValueError("Oops, we had an error!")
            calls = []

            @find_executable_batch_size(starting_batch_size=16)
            def loop(batch_size):
                calls.append(batch_size)
                raise err

            with self.assertRaises(ValueError) as cm:
                loop()
            assert cm.exception is err and calls == [16]

        def test_each_out_of_memory_message_is_retried(self):
            messages = ["CUDA out of memory. Tried to allocate 2.00 GiB",
                        "XPU out of memory. Tried to allocate 2.00 GiB",
                        "MPS backend out of memory (MPS allocated: 1 GB)",
                        "DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes",
                        "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you "
                        "passed in a non-contiguous input.",
                        "FATAL ERROR :: MODULE:PT_DEVMEM Allocation failed"]
            for message in messages:
                sizes = []

                @find_executable_batch_size(starting_batch_size=10)
                def loop(batch_size):
                    sizes.append(batch_size)
                    if batch_size == 10:
                        raise RuntimeError(message)
                    return batch_size

                assert loop() == 9 and sizes == [10, 9], message

        def test_arguments_pass_through_and_the_size_is_kept(self):
            sizes = []

            @find_executable_batch_size(starting_batch_size=20)
            def loop(batch_size, a, b=None, *rest, **named):
                sizes.append(batch_size)
                if batch_size > 15:
                    raise_fake_out_of_memory()
                return batch_size, a, b, rest, named

            assert loop(1, 2, 3, k=4) == (14, 1, 2, (3,), {"k": 4})
            assert loop("x") == (14, "x", None, (), {})   # the next call starts where it ended
            assert sizes == [20, 18, 16, 14, 14]

        def test_nothing_logged_when_the_first_size_runs(self):
            import logging

            @find_executable_batch_size(starting_batch_size=4)
            def loop(batch_size):
                return batch_size

            with self.assertNoLogs(level=logging.WARNING):
                assert loop() == 4

    return ParityChecks


class TestAccelerateSuiteOnNumguard(accelerate_memory_tests(
        numguard_memory.find_executable_batch_size, numguard_memory.release_memory)):
    pass


class TestParityOnNumguard(parity_checks(numguard_memory.find_executable_batch_size,
                                         numguard_memory.release_memory)):
    pass


_needs_accelerate = unittest.skipIf(accelerate_memory is None, "accelerate is not installed")


@_needs_accelerate
class TestAccelerateSuiteOnAccelerate(accelerate_memory_tests(
        getattr(accelerate_memory, "find_executable_batch_size", None),
        getattr(accelerate_memory, "release_memory", None))):
    pass


@_needs_accelerate
class TestParityOnAccelerate(parity_checks(
        getattr(accelerate_memory, "find_executable_batch_size", None),
        getattr(accelerate_memory, "release_memory", None))):
    pass
