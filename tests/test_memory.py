"""numguard.find_executable_batch_size and numguard.is_out_of_memory.

Out-of-memory is simulated: the function raises torch.OutOfMemoryError (or the CPU allocator's
message) above a size limit. The two-rank cases run in ONE launch of tests/memory_workers.py
(gloo on loopback, under a hard timeout), which returns every scenario's result per rank."""
from __future__ import annotations

import logging
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import memory_workers  # noqa: E402

import numguard  # noqa: E402
from numguard import memory  # noqa: E402
from numguard.env import OptionError  # noqa: E402

CPU_OOM = "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: " \
          "you tried to allocate 68719476736 bytes. Error code 12 (Cannot allocate memory)"


def limited(limit, tried, error=lambda size: torch.OutOfMemoryError(f"CUDA out of memory. "
                                                                     f"Tried {size}")):
    """A function that records each size and runs out of memory above ``limit``."""
    def train(batch_size, *args, **kwargs):
        tried.append(batch_size)
        if batch_size > limit:
            raise error(batch_size)
        return ("done", batch_size, args, kwargs)
    return train


# ---------------------------------------------------------------------------------------------
# what counts as out of memory

@pytest.mark.parametrize("exc", [
    torch.OutOfMemoryError("anything"),
    MemoryError(),
    RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    RuntimeError("HIP out of memory. Tried to allocate 2.00 GiB"),
    RuntimeError("XPU out of memory. Tried to allocate 2.00 GiB"),
    RuntimeError("MPS backend out of memory (MPS allocated: 1.2 GB, other allocations: 0)"),
    RuntimeError(CPU_OOM),
    RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed"),
    RuntimeError("FATAL ERROR :: MODULE:PT_DEVMEM Allocation failed"),
])
def test_out_of_memory_is_recognised(exc):
    assert numguard.is_out_of_memory(exc)


@pytest.mark.parametrize("exc", [
    RuntimeError("shape mismatch"), ValueError("out of memory."), KeyError("x"),
    RuntimeError("the word memory alone"), TypeError("can't allocate memory"),
])
def test_other_errors_are_not_out_of_memory(exc):
    assert not numguard.is_out_of_memory(exc)


# ---------------------------------------------------------------------------------------------
# Accelerate-compatible calling

def test_decorator_with_arguments_halves_until_it_fits():
    tried = []
    f = numguard.find_executable_batch_size(starting_batch_size=128, reduction=0.5)(
        limited(40, tried))
    assert f("a", k=1) == ("done", 32, ("a",), {"k": 1})
    assert tried == [128, 64, 32]


def test_function_keyword_style_and_reduce_fn_honoured():
    tried, sizes = [], iter([100, 90, 10])
    f = numguard.find_executable_batch_size(function=limited(50, tried), starting_batch_size=128,
                                            reduce_batch_size_fn=lambda: next(sizes))
    assert f()[1] == 10
    assert tried == [128, 100, 90, 10]


def test_passing_the_batch_size_is_a_type_error_like_accelerate():
    @numguard.find_executable_batch_size(starting_batch_size=8)
    def train(batch_size, model):
        return batch_size

    with pytest.raises(TypeError, match=r"Batch size was passed into `train` as the first argument"):
        train(8, "model")


def test_non_oom_error_propagates_untouched_on_the_first_try():
    calls = []
    err = ValueError("bad label")

    @numguard.find_executable_batch_size(starting_batch_size=64)
    def train(batch_size):
        calls.append(batch_size)
        raise err

    with pytest.raises(ValueError) as info:
        train()
    assert info.value is err and calls == [64]


def test_minimum_reached_lists_every_size_and_the_message():
    tried = []
    f = numguard.find_executable_batch_size(limited(0, tried, lambda s: RuntimeError(CPU_OOM)),
                                            starting_batch_size=40, minimum_batch_size=8,
                                            reduction=0.5)
    with pytest.raises(memory.BatchSizeNotFoundError) as info:
        f()
    assert tried == [40, 20, 10]
    assert [s for s, _ in info.value.tried] == [40, 20, 10]
    msg = str(info.value)
    assert "minimum_batch_size=8" in msg and "40 (out of memory)" in msg and "10 (out of memory)" in msg
    assert "can't allocate memory" in msg
    assert msg.endswith("Lower minimum_batch_size, free memory or shrink the model.")


def test_reduction_factor():
    tried = []
    f = numguard.find_executable_batch_size(limited(50, tried), starting_batch_size=100,
                                            reduction=0.9)
    assert f()[1] == 45
    assert tried == [100, 90, 81, 72, 64, 57, 51, 45]   # int(size * 0.9) each time


def test_default_back_off_is_accelerates_0_9():
    tried = []
    f = numguard.find_executable_batch_size(limited(50, tried), starting_batch_size=100)
    assert f()[1] == 45
    assert tried == [100, 90, 81, 72, 64, 57, 51, 45]


def test_starting_size_zero_decorates_and_raises_at_the_call():
    calls = []
    f = numguard.find_executable_batch_size(starting_batch_size=0)(lambda b: calls.append(b))
    with pytest.raises(memory.BatchSizeNotFoundError) as info:
        f()
    assert isinstance(info.value, RuntimeError) and calls == []
    assert info.value.args[0].startswith("No executable batch size found, reached zero.")
    assert "starting_batch_size=0" in str(info.value)


def test_reaching_zero_says_so_like_accelerate():
    tried = []
    f = numguard.find_executable_batch_size(limited(0, tried), starting_batch_size=3)
    with pytest.raises(RuntimeError, match=r"^No executable batch size found, reached zero\.") \
            as info:
        f()
    assert tried == [3, 2, 1] and "3 (out of memory), 2 (out of memory), 1 (out of memory)" in \
        str(info.value)
    # size 1 is the least there is: no advice to lower minimum_batch_size
    assert "minimum_batch_size" not in str(info.value)
    assert str(info.value).endswith("Free memory or shrink the model.")


@pytest.mark.parametrize("kind", ["generator", "coroutine", "async generator"])
def test_generator_and_coroutine_functions_are_refused_at_decoration(kind):
    if kind == "generator":
        def train(batch_size):
            yield batch_size
    elif kind == "coroutine":
        async def train(batch_size):
            return batch_size
    else:
        async def train(batch_size):
            yield batch_size
    with pytest.raises(TypeError) as info:
        numguard.find_executable_batch_size(starting_batch_size=8)(train)
    msg = str(info.value)
    assert "`test_generator_and_coroutine_functions_are_refused_at_decoration.<locals>.train`" in msg
    assert f"it is a{'n' if kind.startswith('a') else ''} {kind}" in msg and "plain function" in msg
    with pytest.raises(TypeError, match="cannot retry"):   # the function= style too
        numguard.find_executable_batch_size(function=train, starting_batch_size=8)


def test_release_memory_takes_accelerates_arguments():
    a, b = torch.ones(3), torch.ones(4)
    assert memory.release_memory(a, b) == [None, None]
    assert memory.release_memory() == []


def test_binary_search_finds_the_largest_size_that_fits():
    tried = []
    f = numguard.find_executable_batch_size(limited(70, tried), starting_batch_size=128,
                                            search="binary", reduction=0.5)
    assert f()[1] == 70
    # down to the first size that runs, then midpoints between it and the smallest failure
    assert tried == [128, 64, 96, 80, 72, 68, 70, 71]


def test_binary_search_never_goes_above_a_starting_size_that_fits():
    tried = []
    f = numguard.find_executable_batch_size(limited(1000, tried), starting_batch_size=16,
                                            search="binary")
    assert f()[1] == 16 and tried == [16]


def test_found_size_is_remembered_and_a_later_oom_is_raised():
    tried, limit = [], [40]

    @numguard.find_executable_batch_size(starting_batch_size=128, reduction=0.5)
    def train(batch_size):
        tried.append(batch_size)
        if batch_size > limit[0]:
            raise torch.OutOfMemoryError("CUDA out of memory.")
        return batch_size

    assert train() == 32
    tried.clear()
    assert train() == 32 and tried == [32]      # starts from the found size
    assert train.finder.tried == [(32, "ok")]
    limit[0] = 10
    with pytest.raises(torch.OutOfMemoryError):
        train()                                  # not silently retried after a success
    train.retry_after_success = True
    assert train() == 8
    train.reset(starting_batch_size=64)
    train.retry_after_success = False
    tried.clear()
    assert train() == 8 and tried == [64, 32, 16, 8]


def test_global_batch_keeps_the_product_and_tries_only_divisors():
    seen = []

    @numguard.find_executable_batch_size(starting_batch_size=128, global_batch_size=96,
                                         reduction=0.5)
    def train(batch_size, accumulation_steps, tag):
        seen.append((batch_size, accumulation_steps))
        if batch_size > 20:
            raise torch.OutOfMemoryError("CUDA out of memory.")
        return batch_size * accumulation_steps, tag

    assert train("x") == (96, "x")
    assert seen == [(96, 1), (48, 2), (24, 4), (12, 8)]
    assert all(96 % b == 0 and b * a == 96 for b, a in seen)


def test_global_batch_with_a_non_divisor_start_and_reduction_snaps_down():
    seen = []

    @numguard.find_executable_batch_size(starting_batch_size=50, global_batch_size=60,
                                         reduction=0.6)
    def train(batch_size, accumulation_steps):
        seen.append(batch_size)
        if batch_size > 5:
            raise torch.OutOfMemoryError("CUDA out of memory.")
        return batch_size * accumulation_steps

    assert train() == 60
    assert seen == [30, 15, 6, 3]      # 50 -> 30 (divisor of 60), int(30*.6)=18 -> 15, 9 -> 6, 3


def test_a_prime_global_batch_warns_that_only_itself_and_one_divide_it():
    seen = []

    @numguard.find_executable_batch_size(starting_batch_size=128, global_batch_size=97)
    def train(batch_size, accumulation_steps):
        seen.append((batch_size, accumulation_steps))
        if batch_size > 20:
            raise torch.OutOfMemoryError("CUDA out of memory.")
        return batch_size * accumulation_steps

    with pytest.warns(UserWarning, match=r"global_batch_size=97 leaves 97, a prime.*97 and 1.*e\.g\. 96 or 104"):
        assert train() == 97
    assert seen == [(97, 1), (1, 97)]
    from numguard.memory.search import few_sizes_warning
    assert few_sizes_warning(96, 1, 96) is None and few_sizes_warning(6, 2, 3) is None
    assert "over 2 ranks (13 per rank)" in few_sizes_warning(26, 2, 13)


def test_global_batch_passing_the_size_is_a_type_error():
    f = numguard.find_executable_batch_size(lambda b, a, x: b, global_batch_size=8)
    with pytest.raises(TypeError, match="Batch size was passed"):
        f(1, 2, 3)


def test_margin_retries_one_step_smaller(monkeypatch):
    total = 1000
    peaks = {128: 960, 64: 800, 32: 400}
    current = {}
    monkeypatch.setattr(memory.oom, "device_memory", lambda: (0, peaks[current["s"]], total))
    tried = []

    @numguard.find_executable_batch_size(starting_batch_size=128, margin=0.1, reduction=0.5)
    def train(batch_size):
        current["s"] = batch_size
        tried.append(batch_size)
        return batch_size

    assert train() == 64 and tried == [128, 64]


@pytest.mark.parametrize("kwargs, name", [
    ({"starting_batch_size": -1}, "starting_batch_size"),
    ({"starting_batch_size": 8.0}, "starting_batch_size"),
    ({"minimum_batch_size": 0}, "minimum_batch_size"),
    ({"starting_batch_size": 4, "minimum_batch_size": 8}, "minimum_batch_size"),
    ({"reduction": 1.0}, "reduction"),
    ({"reduction": 0}, "reduction"),
    ({"search": "up"}, "search"),
    ({"margin": 1.5}, "margin"),
    ({"margin": True}, "margin"),
    ({"global_batch_size": -4}, "global_batch_size"),
    ({"reduce_batch_size_fn": 3}, "reduce_batch_size_fn"),
])
def test_bad_arguments_name_the_value_and_what_is_accepted(kwargs, name):
    with pytest.raises(OptionError) as info:
        numguard.find_executable_batch_size(**kwargs)
    assert info.value.option == name and f"{name}=" in str(info.value)


# ---------------------------------------------------------------------------------------------
# memory really freed between tries

def test_retry_does_not_see_the_previous_tries_tensors():
    decorate = numguard.find_executable_batch_size(starting_batch_size=64, reduction=0.5)
    assert memory_workers.tensors_alive_at_each_try(decorate, limit=16) == [0, 0, 0]


def test_retry_line_and_summary_are_logged(caplog):
    tried = []
    f = numguard.find_executable_batch_size(limited(40, tried), starting_batch_size=128,
                                            reduction=0.5)
    with caplog.at_level(logging.INFO, logger="numguard.memory"):
        f()
    lines = [r.getMessage() for r in caplog.records if r.name == "numguard.memory"]
    assert any("batch size 128 failed" in m and "retrying with 64" in m for m in lines)
    assert any("batch size 64 failed" in m and "retrying with 32" in m for m in lines)
    assert any("batch size 32 fits; tried 128 (out of memory), 64 (out of memory), 32 (ok)" in m
               for m in lines)


# ---------------------------------------------------------------------------------------------
# two ranks (one launch, every scenario)

@pytest.fixture(scope="module")
def two_ranks():
    return memory_workers.run("all", 2, timeout=240)


def test_ddp_backward_oom_on_one_rank_both_ranks_agree(two_ranks):
    r0, r1 = (r["ddp_backward"] for r in two_ranks)
    # rank 1 runs out in a custom Function's backward while rank 0 waits at a gradient bucket
    assert r0["tried"] == [128, 64, 32] and r1["tried"] == [128, 64, 32]
    assert r0["size"] == r1["size"] == 32
    assert r0["result"] == r1["result"]          # same all-reduced gradients
    assert r1["ooms"] == 2 and r0["ooms"] == 0
    assert r0["hook_alone_matches"] and r1["hook_alone_matches"]


def test_oom_after_success_is_raised_on_every_rank(two_ranks):
    r0, r1 = (r["after_success"] for r in two_ranks)
    assert r0["first"] == r1["first"] == 32
    assert r1["second"]["exc"] == "OutOfMemoryError"
    assert r0["second"]["exc"] == "PeerFailedError" and r0["second"]["rank"] == 1
    assert r0["second"]["oom"]
    assert r0["calls"] == r1["calls"] == [32, 32]     # the second call was not retried smaller


def test_global_batch_on_two_ranks(two_ranks):
    for r in two_ranks:
        res = r["global_batch"]
        assert res["calls"] == [[48, 1], [24, 2], [12, 4]]
        assert res["size"] == 12 and res["accum"] == 4 and res["size"] * res["accum"] * 2 == 96


def test_non_oom_error_on_one_rank_is_not_retried(two_ranks):
    r0, r1 = (r["non_oom"] for r in two_ranks)
    assert r1["exc"] == "ValueError" and r1["msg"] == "bad batch on rank 1"
    assert r0["exc"] == "PeerFailedError" and r0["rank"] == 1 and not r0["oom"]
    assert r0["calls"] == r1["calls"] == 1


def test_binary_search_with_cpu_allocator_message_on_two_ranks(two_ranks):
    r0, r1 = (r["binary"] for r in two_ranks)
    assert r0["size"] == r1["size"] == 70
    assert r0["tried"] == r1["tried"] and r0["tried"][:2] == [128, 64]


def test_minimum_reached_on_one_rank_fails_every_rank(two_ranks):
    for r in two_ranks:
        res = r["minimum"]
        assert res["exc"] == "BatchSizeNotFoundError" and res["tried"] == [16, 8, 4]


def test_stuck_rank_fails_with_the_oom_rank_named(two_ranks):
    # rank 0 waits in a plain all_reduce that rank 1 (out of memory) never joins: no hook can
    # tell it, so the watchdog aborts the stuck collective within NUMGUARD_DIST_TIMEOUT
    r0, r1 = (r["stuck"] for r in two_ranks)
    assert r0["exc"] == "PeerFailedError" and r0["rank"] == 1 and r0["oom"]
    assert r1["exc"] in ("BatchSizeTimeoutError", "PeerFailedError")
    assert "rank 1" in r1["msg"] and "out of memory" in r1["msg"]


def test_ddp_optimizer_step_oom_with_guard_ddp_both_ranks_retry(two_ranks):
    # rank 1 runs out in step 0's optimizer step while rank 0 goes into step 1's forward, where
    # DDP rebuilds its buckets and broadcasts the BatchNorm buffers
    r0, r1 = (r["ddp_optimizer"] for r in two_ranks)
    assert r0["tried"] == r1["tried"] == [128, 64, 32]
    assert r0["ok"] == r1["ok"]                 # the same parameters after two DDP steps


@pytest.mark.parametrize("where", ["backward", "optimizer"])
def test_plain_ddp_model_built_inside_is_guarded_without_asking(two_ranks, where):
    r0, r1 = (r[f"plain_ddp_{where}"] for r in two_ranks)
    assert r0["tried"] == r1["tried"] == [128, 64, 32]
    assert "ok" in r0 and r0["ok"] == r1["ok"]


def test_forward_that_communicates_nothing_gets_no_round(two_ranks):
    # rank 0 alone evaluates the DDP model under no_grad after the buckets are rebuilt
    r0, r1 = (r["eval_on_rank0"] for r in two_ranks)
    assert r0["ok"] == r1["ok"] == 32 and r0["tried"] == r1["tried"] == [128, 64, 32]


def test_accelerate_prepare_inside_the_function_just_works():
    pytest.importorskip("accelerate")
    r0, r1 = memory_workers.run("accelerate_prepare", 2, timeout=240)
    assert r0["distributed_type"].endswith("MULTI_CPU")
    assert r0["tried"] == r1["tried"] == [128, 64, 32]
    assert "ok" in r0 and r0["ok"] == r1["ok"]


def test_timeout_advice_names_guard_ddp_only_when_it_is_not_in_place():
    from types import SimpleNamespace

    def advice(guarded, unwatched=()):
        return memory.ranks._Exchange.advice(SimpleNamespace(ddp_guarded=guarded,
                                                       ddp_unwatched=list(unwatched)))

    assert "guard_ddp(model)" in advice(0) and "inside the decorated function" in advice(0)
    watched = advice(3)
    assert "guard_ddp" not in watched and "collective of the function's own" in watched
    own_hook = advice(1, ["the model has a communication hook of its own (x); pass it to "
                          "numguard.memory.guard_ddp(model, comm_hook=hook, state=state)"])
    assert "not its gradient buckets" in own_hook and "comm_hook=hook" in own_hook


def test_guard_ddp_runs_the_users_hook_after_numguards_round():
    calls = []
    hook = memory.ranks._WrappedCommHook(lambda state, bucket: calls.append((state, bucket)) or "fut",
                                   "my state")
    assert hook(None, "bucket") == "fut" and calls == [("my state", "bucket")]


def test_the_search_creates_no_torch_group(two_ranks):
    # torch.distributed.new_group renumbers the user's later groups: the finder builds its own
    for r in two_ranks:
        assert r["ddp_optimizer"]["groups_before"] == r["ddp_optimizer"]["groups_after"]
