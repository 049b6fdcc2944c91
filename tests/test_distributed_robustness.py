"""numguard.distributed under hostile conditions: process groups destroyed before exit, ranks
that run uneven collectives, dicts in different orders, huge timeouts, call sites inside torch,
threads.

Multi-rank cases run real gloo process groups on loopback (dist_workers.py); each launch batches
many generated cases. The rest run in-process."""
from __future__ import annotations

import itertools
import os
import random
import sys
import threading
import time
import warnings
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dist_workers  # noqa: E402

import numguard.distributed as ngd  # noqa: E402
from numguard.distributed import coordination, shapes  # noqa: E402


def _random_nested(rng, depth=0):
    """A nest of dicts/lists/tuples of tensors, None and scalars, keys of several types."""
    kind = rng.choice(["tensor", "none", "int"] + (["dict", "list", "tuple"] if depth < 3 else []))
    if kind == "tensor":
        dtype = rng.choice([torch.float32, torch.float16, torch.int64])
        return torch.zeros(tuple(rng.randint(1, 4) for _ in range(rng.randint(0, 3))),
                           dtype=dtype)
    if kind == "none":
        return None
    if kind == "int":
        return rng.randint(0, 9)
    if kind == "dict":
        keys = rng.sample(["a", "b", "c", "key", 0, 7, ("t", 1), 2.5, "z"], rng.randint(1, 5))
        return {k: _random_nested(rng, depth + 1) for k in keys}
    items = [_random_nested(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return items if kind == "list" else tuple(items)


def _shuffled(obj, rng):
    """The same value with every dict's insertion order shuffled."""
    if isinstance(obj, dict):
        items = list(obj.items())
        rng.shuffle(items)
        return {k: _shuffled(v, rng) for k, v in items}
    if isinstance(obj, list):
        return [_shuffled(v, rng) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_shuffled(v, rng) for v in obj)
    return obj


@pytest.mark.parametrize("seed", range(40))
def test_dicts_equal_in_any_insertion_order_compare_equal(seed):
    rng = random.Random(seed)
    obj = {"root": _random_nested(rng), "other": _random_nested(rng), 5: _random_nested(rng)}
    for _ in range(3):
        other = _shuffled(obj, rng)
        assert shapes.description_hash(other, "op") == shapes.description_hash(obj, "op")


@pytest.mark.parametrize("seed", range(20))
def test_dict_differences_are_still_caught_in_any_order(seed):
    rng = random.Random(seed)
    obj = {k: torch.zeros(2, 3) for k in rng.sample(["a", "b", "c", "d", 1, 2], 4)}
    key = rng.choice(list(obj))
    changed = _shuffled(obj, rng)
    changed[key] = torch.zeros(2, 4)  # same keys, one shape differs
    extra = _shuffled(obj, rng)
    extra["new"] = torch.zeros(1)  # one key more
    for other, what in ((changed, "shape of input["), (extra, "structure")):
        assert shapes.description_hash(other, "op") != shapes.description_hash(obj, "op")
        out = bytearray()
        for o in (obj, other):
            buf = bytearray(shapes.RECORD_WORDS * 8)
            shapes.encode(o, "op", "train.py:1", buf)
            out += buf
        assert what in shapes.mismatch_message(out, 2, obj, "op", 0)


def test_dicts_are_shown_in_canonical_order():
    a = {"b": torch.zeros(1), "a": torch.zeros(2)}
    b = {"a": torch.zeros(2), "b": torch.zeros(3)}
    out = bytearray()
    for o in (a, b):
        buf = bytearray(shapes.RECORD_WORDS * 8)
        shapes.encode(o, "op", "x.py:1", buf)
        out += buf
    msg = shapes.mismatch_message(out, 2, a, "op", 0)
    assert "  - Process 0: {'a': [2], 'b': [1]}\n  - Process 1: {'a': [2], 'b': [3]}" in msg


@pytest.mark.parametrize("seconds", [1e-9, 0.0005, 1.0, 60.0, 1.5e6, 2.2e6, 1e9, 1e10, 1e12,
                                     1e300, sys.float_info.max])
def test_timeouts_passed_to_torch_are_capped(seconds):
    td = coordination.torch_timeout(seconds)
    assert 0.001 <= td.total_seconds() <= coordination.MAX_TORCH_TIMEOUT_S
    assert td.total_seconds() * 1000 < 2 ** 31  # fits the narrowest timeout field on the way
    if 0.001 <= seconds <= coordination.MAX_TORCH_TIMEOUT_S:
        assert td.total_seconds() == pytest.approx(seconds)


def _run_as(filename: str, source: str, scope: dict):
    exec(compile(source, filename, "exec"), scope)


def test_call_site_skips_numguard_and_torch_frames(tmp_path):
    """A call site seen through frames of torch (module __call__, dynamo's wrappers) and of
    numguard names the user's line, whatever the order and number of those frames."""
    torch_dir = os.path.dirname(os.path.abspath(torch.__file__))
    numguard_dir = os.path.dirname(os.path.dirname(os.path.abspath(coordination.__file__)))
    internal = {
        "torch_nn": os.path.join(torch_dir, "nn", "modules", "module.py"),
        "dynamo": os.path.join(torch_dir, "_dynamo", "eval_frame.py"),
        "numguard": os.path.join(numguard_dir, "numguard", "inspector.py"),
    }
    for chain in itertools.chain.from_iterable(
            itertools.permutations(internal, n) for n in range(0, 4)):
        scope = {"call_site": coordination.call_site}
        inner = "call_site"
        for i, name in enumerate(chain):
            fn = f"layer{i}"
            _run_as(internal[name], f"def {fn}():\n    return {inner}()\n", scope)
            inner = fn
        user_file = str(tmp_path / "train.py")
        _run_as(user_file, f"\n\ndef step():\n    return {inner}()\n", scope)
        assert scope["step"]() == f"{user_file}:4", chain


def test_call_site_does_not_skip_a_file_beside_the_numguard_package(tmp_path):
    numguard_pkg = os.path.dirname(os.path.dirname(os.path.abspath(coordination.__file__)))
    lookalike = numguard_pkg + "_examples.py"  # shares the prefix, not the directory
    scope = {"call_site": coordination.call_site}
    _run_as(lookalike, "def step():\n    return call_site()\n", scope)
    assert scope["step"]() == f"{lookalike}:2"


def test_polling_wait_keeps_working_with_a_huge_timeout():
    class DoneLater:
        def __init__(self):
            self.polls = 0

        def is_completed(self):
            self.polls += 1
            return self.polls > 3

        def wait(self, *a):
            return True

    st = SimpleNamespace(device=torch.device("cpu"), store=None, seq=1, global_ranks=[0, 1],
                         rank=0, name="0")
    coordination._wait(DoneLater(), st, "`op`", "here.py:1", 1e10)  # CPU path: Work.wait(cap)


class _FakeGroup:
    """What coordination.exclusive needs of a group state."""

    def __init__(self):
        self.lock = threading.RLock()
        self.holder = None
        self.warned = set()
        self.name = "0"

    def warn_once(self, kind, message):
        coordination._GroupState.warn_once(self, kind, message)


def test_threads_sharing_a_group_run_one_at_a_time_and_are_warned_about_once():
    st = _FakeGroup()
    inside = []
    overlaps = []
    entered = threading.Event()

    def op(name, hold_s):
        with coordination.exclusive(st, f"check {name}"):
            if inside:
                overlaps.append((name, list(inside)))
            inside.append(name)
            entered.set()
            time.sleep(hold_s)
            with coordination.exclusive(st, "nested"):  # the same thread may re-enter
                pass
            inside.remove(name)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = threading.Thread(target=op, args=("A", 0.3), name="A")
        first.start()
        entered.wait(10)
        others = [threading.Thread(target=op, args=(f"B{i}", 0.01), name=f"B{i}")
                  for i in range(4)]
        for th in others:
            th.start()
        for th in [first] + others:
            th.join(30)
    assert overlaps == []
    thread_warnings = [w for w in caught if issubclass(w.category, ngd.DistributedWarning)]
    assert len(thread_warnings) == 1
    text = str(thread_warnings[0].message)
    assert "'A'" in text and "process group '0'" in text and "one after the other" in text



# ---------------------------------------------------------------------------------------------
# multi-rank (gloo, loopback)

EXIT_RUNS = 10


def test_exit_after_destroy_process_group_is_clean():
    """10 two-rank runs that use numguard's per-group state (own group, subgroup, pending
    trigger check, trip exchange), destroy the process group in every way a script does (or
    not at all), and exit normally: every rank must exit 0 every time."""
    launches = []
    outcomes = []
    for i in range(EXIT_RUNS):
        variant = dist_workers.EXIT_VARIANTS[i % len(dist_workers.EXIT_VARIANTS)]
        env = {"NG_EXIT_VARIANT": variant}
        if i % 2:
            env["NUMGUARD_DIST_CHECK"] = "1"
        launches.append(dist_workers.start_scenario("exit_after_destroy", 2, timeout=150, env=env))
        if len(launches) == 2 or i == EXIT_RUNS - 1:
            for launch in launches:
                outcomes.append(launch.finish(allow_failure=True))
            launches = []
    bad = []
    for i, ranks in enumerate(outcomes):
        for r, res in enumerate(ranks):
            if res["returncode"] != 0 or res.get("sum") != [16.0, 16.0, 16.0]:
                bad.append((i, r, res.get("variant"), res["returncode"], res["log"][-600:]))
    assert bad == []
    assert {res["variant"] for ranks in outcomes for res in ranks} == set(
        dist_workers.EXIT_VARIANTS)


@pytest.fixture(scope="module")
def uneven():
    return dist_workers.run_scenario("uneven", 2, timeout=240, env={
        "NUMGUARD_DIST_CHECK": "1", "NUMGUARD_DIST_TIMEOUT": "2"})


MISMATCH_KINDS = {
    "all_reduce": "torch.distributed.all_reduce",
    "broadcast": "torch.distributed.broadcast",
    "all_gather_into_tensor": "torch.distributed.all_gather_into_tensor",
    "broadcast_object_list": "torch.distributed.broadcast_object_list",
}


@pytest.mark.parametrize("kind", sorted(MISMATCH_KINDS))
@pytest.mark.parametrize("extra", [0, 1])
def test_extra_checked_collective_against_a_barrier_is_named_on_both_ranks(uneven, kind, extra):
    assert all(r["guard_installed"] for r in uneven)
    msgs = [r[f"{kind}/extra{extra}"] for r in uneven]
    assert all(m.get("exc") == "DistributedOperationException" for m in msgs), msgs
    # Identical verdicts (dict keys only one rank has are shown by name on that rank only).
    verdicts = [m["msg"].split("What differs")[1] for m in msgs]
    assert verdicts[0] == verdicts[1]
    barrier_rank = 1 - extra
    assert (f"operation `torch.distributed.barrier` instead of `{MISMATCH_KINDS[kind]}`" in
            msgs[0]["msg"] or f"operation `{MISMATCH_KINDS[kind]}` instead of "
            "`torch.distributed.barrier`" in msgs[0]["msg"])
    assert f"  - Process {barrier_rank}: None" in msgs[0]["msg"]


@pytest.mark.parametrize("kind", ["ddp_step", "unchecked_all_reduce"])
@pytest.mark.parametrize("extra", [0, 1])
def test_rank_in_an_unchecked_collective_is_named_by_the_waiting_rank(uneven, kind, extra):
    waiting = uneven[1 - extra][f"{kind}/extra{extra}"]
    assert waiting.get("exc") == "DistributedTimeoutError", waiting
    assert f"Ranks that never arrived: [{extra}]." in waiting["msg"]
    assert "`torch.distributed.barrier`" in waiting["msg"]
    assert "within 2 s" in waiting["msg"]
    assert "dist_workers.py:" in waiting["msg"]  # the user's line, not torch's
    assert waiting["elapsed"] < 60  # bounded by the check's timeout, not the group's
    # The rank that was elsewhere is not killed by numguard: its own collective ends by the
    # group's timeout (a torch error, not numguard's).
    elsewhere = uneven[extra][f"{kind}/extra{extra}"]
    assert elsewhere.get("exc") != "DistributedTimeoutError", elsewhere

