"""numguard.distributed: shape checks, the collective guard, missing ranks, logging, triggers,
coordinated-trip helpers. Multi-rank cases run real gloo process groups on loopback (one launch per
scenario group, each bounded by a hard timeout: see dist_workers.py); the rest run in-process."""
from __future__ import annotations

import logging
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dist_workers  # noqa: E402

import numguard.distributed as ngd  # noqa: E402
from numguard.distributed import _env, shapes  # noqa: E402

HEADER = ("Cannot apply desired operation due to shape mismatches. "
          "All shapes across devices must be valid.")


# ---------------------------------------------------------------------------------------------
# in-process: encoding and messages from synthetic gathered records

def _gathered(*objs, op="torch.distributed.all_reduce", sites=None):
    out = bytearray()
    for i, obj in enumerate(objs):
        buf = bytearray(shapes.RECORD_WORDS * 8)
        full = shapes.encode(obj, op, (sites or {}).get(i, "train.py:10"), buf)
        assert full == shapes.description_hash(obj, op)  # the fast path hashes the same
        out += buf
    return out


def _full_hash(buf, r=0):
    import struct
    return struct.unpack_from("<2q", buf, r * shapes.RECORD_WORDS * 8)


def test_equal_descriptions_have_equal_records():
    a = _gathered({"x": torch.zeros(2, 3), "y": [None, 1]}, {"x": torch.ones(2, 3), "y": [None, 7]})
    assert _full_hash(a, 0) == _full_hash(a, 1)


@pytest.mark.parametrize("other", [
    torch.zeros(1, 2, 5), torch.zeros(5, 1), torch.zeros(1, 5, dtype=torch.bfloat16),
    [torch.zeros(1, 5)], (torch.zeros(1, 5),), {"a": torch.zeros(1, 5)}, None, 3,
])
def test_any_difference_changes_the_hash(other):
    a = _gathered(torch.zeros(1, 5), other)
    assert _full_hash(a, 0)[1] != _full_hash(a, 1)[1]


def test_message_keeps_accelerate_wording_and_layout():
    msg = shapes.mismatch_message(_gathered(torch.zeros(1, 5), torch.zeros(1, 2, 5)), 2,
                                  torch.zeros(1, 5), "torch.distributed.all_reduce")
    expected_head = (
        HEADER + "\n\nOperation: `torch.distributed.all_reduce`\nInput shapes:\n"
        "  - Process 0: [1, 5]\n  - Process 1: [1, 2, 5]\n"
    )
    assert msg.startswith(expected_head)
    assert "  - Process 1: shape of input is [1, 2, 5] instead of [1, 5] (ndim 3 instead of 2)" in msg
    assert "Call sites:\n  - Process 0: train.py:10\n  - Process 1: train.py:10" in msg


def test_message_reference_is_the_majority():
    objs = [torch.zeros(4)] * 3 + [torch.zeros(4, dtype=torch.float16)]
    objs = [objs[0], objs[1], objs[3], objs[2]]
    msg = shapes.mismatch_message(_gathered(*objs), 4, objs[0], "op")
    assert "What differs (compared with process 0):" in msg
    assert "  - Process 2: dtype of input is torch.float16 instead of torch.float32" in msg
    assert "Process 1: dtype" not in msg and "Process 3: dtype" not in msg


def test_all_to_all_spec_ignores_first_dim():
    a = _gathered(shapes.TensorSpec((-1, 4), torch.float32), shapes.TensorSpec((-1, 4), torch.float32))
    assert _full_hash(a, 0) == _full_hash(a, 1)
    b = _gathered(shapes.TensorSpec((-1, 4), torch.float32), shapes.TensorSpec((-1, 5), torch.float32))
    msg = shapes.mismatch_message(b, 2, None, "op")
    assert "Process 0: [*, 4]" in msg and "Process 1: [*, 5]" in msg


def test_without_process_group_everything_is_local():
    assert not torch.distributed.is_initialized()
    ngd.check_shapes(torch.zeros(3), op="x")  # no-op
    assert ngd.rank() == 0 and ngd.world_size() == 1
    assert ngd.check_trigger() is False
    ngd.set_trigger()
    assert ngd.check_trigger() is True
    assert ngd.check_trigger() is False
    assert ngd.exchange_trip(torch.tensor(1)).tolist() == [1]
    assert ngd.gather_trip_details("a.b", 3) == [(0, "a.b")]
    assert ngd.gather_trip_details(None, 3) == []


def test_logger_without_process_group(caplog):
    log = ngd.get_logger("numguard.test.local", log_level="info")
    assert isinstance(log, logging.LoggerAdapter)
    with caplog.at_level(logging.INFO, logger="numguard.test.local"):
        log.info("hello %s", "there", in_order=True)
        log.debug("hidden")
    assert [r.getMessage() for r in caplog.records] == ["[RANK 0] hello there"]


@pytest.mark.parametrize("name,value,fn", [
    ("NUMGUARD_DIST_TIMEOUT", "soon", lambda: _env.dist_timeout()),
    ("NUMGUARD_DIST_TIMEOUT", "-3", lambda: _env.dist_timeout()),
    ("NUMGUARD_DIST_CHECK", "yes", lambda: _env.dist_check_enabled()),
    ("NUMGUARD_LOG_LEVEL", "LOUD", lambda: ngd.get_logger("numguard.test.bad")),
])
def test_invalid_env_values_name_the_variable(monkeypatch, name, value, fn):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError) as info:
        fn()
    assert name in str(info.value) and repr(value) in str(info.value)


def test_env_values(monkeypatch):
    monkeypatch.setenv("NUMGUARD_DIST_TIMEOUT", "2.5")
    assert _env.dist_timeout() == 2.5
    assert _env.dist_timeout(7) == 7.0
    monkeypatch.setenv("NUMGUARD_DIST_CHECK", "1")
    assert _env.dist_check_enabled()
    with pytest.raises(ValueError, match="log_level"):
        ngd.get_logger("numguard.test.bad2", log_level="chatty")
    with pytest.raises(ValueError, match="timeout"):
        ngd.guard_collectives(timeout=0)


def test_numguard_import_does_not_import_torch_distributed_eagerly():
    import subprocess
    code = ("import sys, numguard; "
            "print('numguard.distributed' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=dist_workers.ROOT, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


# ---------------------------------------------------------------------------------------------
# multi-rank (gloo, loopback)

@pytest.fixture(scope="module")
def two_ranks():
    return dist_workers.run_scenario("shapes_and_guard", 2, timeout=120)


@pytest.fixture(scope="module")
def shapes2(two_ranks):
    return [r["shapes"] for r in two_ranks]


@pytest.fixture(scope="module")
def guard2(two_ranks):
    return [r["guard"] for r in two_ranks]


@pytest.fixture(scope="module")
def world4():
    return dist_workers.run_scenario("world4", 4, timeout=120,
                                     env={"NUMGUARD_LOG_LEVEL": "WARNING"})


def _same_exception_everywhere(results, key):
    msgs = [r[key].get("msg") for r in results]
    assert all(r[key].get("exc") == "DistributedOperationException" for r in results), results[0][key]
    assert all(m == msgs[0] for m in msgs), msgs
    return msgs[0]


def test_shape_mismatch(shapes2):
    msg = _same_exception_everywhere(shapes2, "shape")
    assert msg.startswith(HEADER + "\n\nOperation: `torch.distributed.all_reduce`\nInput shapes:\n"
                          "  - Process 0: [1, 5]\n  - Process 1: [1, 2, 5]\n")


def test_same_numel_different_shape(shapes2):
    msg = _same_exception_everywhere(shapes2, "numel")
    assert "  - Process 0: [2, 5]\n  - Process 1: [1, 10]" in msg
    assert "same number of elements, different shape" in msg


def test_dtype_only_mismatch(shapes2):
    msg = _same_exception_everywhere(shapes2, "dtype")
    assert "Input dtypes:\n  - Process 0: torch.float32\n  - Process 1: torch.bfloat16" in msg
    assert "dtype of input is torch.bfloat16 instead of torch.float32" in msg


def test_nested_structures(shapes2):
    assert all(r["nested_match"] == {"ok": None} for r in shapes2)
    msg = _same_exception_everywhere(shapes2, "nested_leaf")
    assert "shape of input['pair'][1][0] is [2, 3] instead of [2, 2]" in msg
    assert "'step': int" in msg
    # an extra key on one rank: every rank names both ranks' keys (exchanged on the error path)
    msg = _same_exception_everywhere(shapes2, "nested_structure")
    assert ("  - Process 1: structure (7 leaves instead of 6: keys of input are ['ids', 'extra', "
            "'pair', 'step', 'mask'] instead of ['ids', 'extra', 'pair', 'step'] (extra 'mask'))"
            in msg)
    assert "'step': int, 'mask': [4, 7]}" in msg
    msg = _same_exception_everywhere(shapes2, "tuple_vs_list")
    assert "Process 0: ([2],)" in msg and "Process 1: [[2]]" in msg
    assert "  - Process 1: structure (input is a list of 1 instead of a tuple of 1)" in msg
    msg = _same_exception_everywhere(shapes2, "op_differs")
    assert "operation `torch.distributed.broadcast` instead of `torch.distributed.all_reduce`" in msg


def test_dict_keys_are_named_for_every_rank(shapes2):
    msg = _same_exception_everywhere(shapes2, "keys_differ")
    assert "Input shapes:\n  - Process 0: {'a': [2], 'b': [2]}\n  - Process 1: {'a': [2], 'c': [2]}\n" in msg
    assert ("  - Process 1: structure (keys of input are ['a', 'c'] instead of ['a', 'b'] "
            "(missing 'b'; extra 'c'))") in msg
    msg = _same_exception_everywhere(shapes2, "nested_keys")
    assert ("keys of input['out'] are ['logits', 'aux'] instead of ['logits', 'loss'] "
            "(missing 'loss'; extra 'aux')") in msg


def test_dict_key_order_is_compared_unless_told_not_to(shapes2):
    # values are paired by position (Accelerate's operations, loops over .items())
    msg = _same_exception_everywhere(shapes2, "key_order")
    assert ("  - Process 1: structure (keys of input are in another order: ['b', 'a'] instead "
            "of ['a', 'b'] (Accelerate's operations and loops over .items() pair values by "
            "position") in msg
    assert all(r["key_order_off"] == {"ok": None} for r in shapes2)


def test_list_lengths_and_leaf_types(shapes2):
    msg = _same_exception_everywhere(shapes2, "list_length")
    assert ("  - Process 1: structure (3 leaves instead of 2: input['xs'] is a list of 3 "
            "instead of 2)") in msg
    msg = _same_exception_everywhere(shapes2, "tensor_vs_scalar")
    assert "  - Process 0: {'x': [2]}\n  - Process 1: {'x': float}" in msg
    assert "  - Process 1: structure (input['x'] is float instead of a tensor)" in msg


def test_structures_larger_than_the_record(shapes2):
    assert all(r["large_match"] == {"ok": None} for r in shapes2)
    for me, r in enumerate(shapes2):
        exc = r["large_late_mismatch"]
        assert exc["exc"] == "DistributedOperationException"
        other = 1 - me
        assert f"  - Process {other}: <200 leaves: too large to show>" in exc["msg"]
        # each rank shows its own description in full
        assert f"  - Process {me}: [[3, 4], [3, 4]," in exc["msg"]
        assert "  - Process 1: shapes (too many tensors to compare one by one)" in exc["msg"]
    assert all(r["after_mismatches"] == {"ok": None} for r in shapes2)


GUARDED = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
           "reduce_scatter_tensor", "gather", "scatter", "all_to_all_single")


def test_guard_passes_matching_collectives_through(guard2):
    r0, r1 = guard2
    for r in guard2:
        assert r["same_handle"] and r["wrapped"]
        assert set(GUARDED) <= set(r["names"])
        assert r["matching"] == {"ok": True}
    res0, res1 = r0["results"], r1["results"]
    for res in (res0, res1):
        assert res["all_reduce"] == [3.0, 3.0, 3.0]
        assert res["broadcast"] == [1.0, 1.0]
        assert res["all_gather"] == [[0.0, 0.0], [1.0, 1.0]]
        assert res["all_gather_into_tensor"] == [0.0, 0.0, 1.0, 1.0]
    assert res0["reduce"] == [3.0, 3.0]
    assert res0["reduce_scatter_tensor"] == [0.0, 2.0] and res1["reduce_scatter_tensor"] == [4.0, 6.0]
    assert res0["gather"] == [[0.0, 0.0], [1.0, 1.0]]
    assert res0["scatter"] == [0.0, 0.0] and res1["scatter"] == [1.0, 1.0]
    # uneven all_to_all_single: rank 0 gets 1 row from itself and 3 from rank 1
    assert res0["all_to_all_single"] == [0.0, 1.0, 1.0, 1.0]
    assert res1["all_to_all_single"] == [0.0, 0.0, 1.0]


@pytest.mark.parametrize("name", GUARDED)
def test_guard_catches_each_collective(guard2, name):
    msgs = [r["bad"][name] for r in guard2]
    assert all(m.get("exc") == "DistributedOperationException" for m in msgs), msgs
    assert msgs[0]["msg"] == msgs[1]["msg"]
    assert msgs[0]["msg"].startswith(HEADER)
    assert f"Operation: `torch.distributed.{name}`" in msgs[0]["msg"]


def test_guard_compares_root_and_reduce_op(guard2):
    msgs = [r["bad"]["broadcast_src"] for r in guard2]
    assert all(m.get("exc") == "DistributedOperationException" for m in msgs), msgs
    assert "  - Process 1: arguments `src=1` instead of `src=0`" in msgs[0]["msg"]
    assert "Arguments:\n  - Process 0: src=0\n  - Process 1: src=1" in msgs[0]["msg"]
    msgs = [r["bad"]["all_reduce_op"] for r in guard2]
    assert all(m.get("exc") == "DistributedOperationException" for m in msgs), msgs
    assert "arguments `op=MAX` instead of `op=SUM`" in msgs[0]["msg"]


def test_guard_all_gather_uneven_list(guard2):
    msgs = [r["bad"]["all_gather_own_entry"] for r in guard2]
    assert all(m.get("exc") == "DistributedOperationException" for m in msgs), msgs
    assert ("Process 1: arguments `tensor_list of 2, own tensor does NOT match its entry` instead "
            "of `tensor_list of 2, own tensor matches its entry`") in msgs[0]["msg"]


def test_guard_undo(guard2):
    for r in guard2:
        assert r["restored"] and r["context_wrapped"] and r["new_handle"]
        assert r["context_restored"]
        assert r["unguarded_after"] == [2.0, 2.0]


def test_missing_rank_is_named_within_the_timeout():
    res = dist_workers.run_scenario("missing", 3, timeout=120, env={"NUMGUARD_DIST_TIMEOUT": "1.5"})
    assert res[2]["skipped"] is True
    # The ranks that raised leave (through normal interpreter exit) while the missing rank is
    # still alive: the abandoned check does not hold the process until that rank dies.
    assert res[2]["others_left_first"] is True
    for r in res[:2]:
        check = r["check"]
        assert check["exc"] == "DistributedTimeoutError", check
        assert "Ranks that never arrived: [2]." in check["msg"]
        assert "within 1.5 s" in check["msg"]
        assert "`torch.distributed.all_reduce`" in check["msg"]
        assert check["elapsed"] < 30  # bounded by the check's timeout, not the group's 30 min


def test_one_rank_of_four_differs(world4):
    msg = _same_exception_everywhere(world4, "one_dtype_differs")
    assert "  - Process 2: dtype of input['x'] is torch.bfloat16 instead of torch.float32" in msg
    for other in (0, 1, 3):
        assert f"Process {other}: dtype" not in msg


def test_logging_order_and_levels(world4):
    # levels: rank 0 INFO, rank 1 WARNING, rank 2 DEBUG, rank 3 ERROR; in_order collects on rank 0
    assert world4[0]["records"] == [
        "[RANK 0] info from rank 0",
        "[RANK 2] info from rank 2",
        "[RANK 0] warning from rank 0",
        "[RANK 1] warning from rank 1",
        "[RANK 2] warning from rank 2",
        "[RANK 2] debug from rank 2",
        "[RANK 0] main only from rank 0",
        "[RANK 0] every rank 0",
    ]
    for r in (1, 2, 3):
        assert world4[r]["records"] == [f"[RANK {r}] every rank {r}"]
    assert all(r["env_level"] == logging.WARNING for r in world4)


def test_triggers(world4):
    for r in world4:
        assert r["trigger_none"] is False
        assert r["trigger_seen"] is True
        assert r["trigger_reset"] is False
        assert (r["nb_first"], r["nb_second"], r["nb_third"], r["nb_drain"]) == (
            False, True, False, False)


def test_trip_exchange_helpers(world4):
    for r in world4:
        assert r["trip_flags"] == [0, 1, 0, 1]
        assert r["trip_flags_nb"] == [1, 0, 0, 0]
        assert r["trip_details"] == [[1, "model.layers.1.mlp"], [3, "model.layers.3.mlp"]]
        (rank, name), = r["long_name"]
        assert rank == 0 and name.endswith("...") and set(name[:-3]) == {"m"}
        assert len(name.encode()) <= 61 * 8


def test_coordinated_trip_through_watch():
    """Rank 1 plants a NaN in batch 2: every rank raises NonFiniteError in batch 2, naming rank 1
    and the module; only rank 1 carries (and prints) the report."""
    import numguard

    if not hasattr(numguard, "watch"):
        pytest.fail("numguard.watch is missing: the inspector must call "
                    "numguard.distributed.trip_exchange.exchange_trip at the end of each batch")
    r0, r1 = dist_workers.run_scenario("trip", 2, timeout=120)
    for r in (r0, r1):
        assert r["batches_done"] == [0, 1]
        assert r["raised_in_batch"] == 2 and r["batch_number"] == 2
        assert r["ranks"] == [1]
        assert r["module"] == "proj"
    assert r0["rank"] == 0 and r1["rank"] == 1
    assert "rank 1" in r0["message"] and "proj" in r0["message"]
    assert r0["report"] == "" and r0["printed"] == ""
    assert "Detected inf/nan during batch_number=2" in r1["report"]
    assert "     nan      nan input[0]" in r1["report"]
    assert r1["report"] in r1["printed"]


def test_evaluation_on_one_rank_does_not_join_the_trip_exchange():
    r0, r1 = dist_workers.run_scenario("eval_on_rank0", 2, timeout=120)
    for r in (r0, r1):
        assert "error" not in r, r.get("error")
        assert r["train_steps_done"] == [0]
        assert r["raised_in_step"] == 1 and r["ranks"] == [1]


def test_subgroups(world4):
    assert world4[0]["subgroup"] == {"ok": None} and world4[1]["subgroup"] == {"ok": None}
    m2, m3 = world4[2]["subgroup"], world4[3]["subgroup"]
    assert m2["exc"] == m3["exc"] == "DistributedOperationException"
    assert m2["msg"] == m3["msg"]
    # processes are numbered by their rank in the group
    assert "  - Process 0: [5]\n  - Process 1: [6]" in m2["msg"]


def test_dist_check_env_installs_the_guard_on_import():
    import subprocess
    code = ("import torch.distributed as d; f = d.all_reduce; import numguard.distributed as n; "
            "print(d.all_reduce is not f, n.guard_collectives() is n.guard.installed_guard())")
    env = dict(os.environ, NUMGUARD_DIST_CHECK="1", PYTHONPATH=dist_workers.ROOT)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=dist_workers.ROOT, timeout=60, env=env)
    assert out.stdout.split() == ["True", "True"], out.stderr


def test_polling_wait_used_for_cuda_collectives_times_out():
    """The CUDA branch of the timed wait (polling Work.is_completed, no host-blocking wait) gives
    up after the timeout with a DistributedTimeoutError; tested with a work that never ends."""
    from types import SimpleNamespace

    from numguard.distributed import collectives

    class NeverDone:
        def is_completed(self):
            return False

        def wait(self, *a):
            raise AssertionError("must not block on a CUDA work")

    class DoneLater:
        def __init__(self):
            self.polls = 0
            self.waited = False

        def is_completed(self):
            self.polls += 1
            return self.polls > 3

        def wait(self, *a):
            self.waited = True

    st = SimpleNamespace(device=torch.device("cuda", 0), store=None, seq=7, global_ranks=[0, 1],
                         rank=0, name="0")
    with pytest.raises(ngd.DistributedTimeoutError, match="did not complete within 0.2 s"):
        collectives._wait(NeverDone(), st, "`op`", "here.py:1", 0.2)
    later = DoneLater()
    collectives._wait(later, st, "`op`", "here.py:1", 5.0)
    assert later.waited  # stream-orders the result after completion
