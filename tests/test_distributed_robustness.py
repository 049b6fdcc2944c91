"""numguard.distributed under hostile conditions: process groups destroyed before exit, ranks
that run uneven collectives, trip exchanges that only some ranks reach, dicts in different
orders, ranks checking different batches, huge timeouts, call sites inside torch, threads.

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
from numguard.distributed import channel, collectives, rendezvous, shapes, trip_exchange  # noqa: E402


# ---------------------------------------------------------------------------------------------
# in-process

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


def _key_orders(obj, out):
    """Every dict's keys in insertion order, depth first."""
    if isinstance(obj, dict):
        out.append(list(obj))
        for v in obj.values():
            _key_orders(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _key_orders(v, out)
    return out


@pytest.mark.parametrize("seed", range(40))
def test_dicts_equal_in_any_insertion_order_compare_equal_by_key(seed):
    rng = random.Random(seed)
    obj = {"root": _random_nested(rng), "other": _random_nested(rng), 5: _random_nested(rng)}
    for _ in range(3):
        other = _shuffled(obj, rng)
        assert (shapes.description_hash(other, "op", key_order=False)
                == shapes.description_hash(obj, "op", key_order=False))
        # by default the order is compared too: equal exactly when every dict's order is
        same_order = _key_orders(other, []) == _key_orders(obj, [])
        assert (shapes.description_hash(other, "op") == shapes.description_hash(obj, "op")) \
            == same_order


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
        assert (shapes.description_hash(other, "op", key_order=False)
                != shapes.description_hash(obj, "op", key_order=False))
        out = bytearray()
        for o in (obj, other):
            buf = bytearray(shapes.RECORD_WORDS * 8)
            shapes.encode(o, "op", "train.py:1", buf, key_order=False)
            out += buf
        assert what in shapes.mismatch_message(out, 2, obj, "op", 0, key_order=False)


def _records(*objs, key_order=True):
    out = bytearray()
    for o in objs:
        buf = bytearray(shapes.RECORD_WORDS * 8)
        shapes.encode(o, "op", "x.py:1", buf, key_order=key_order)
        out += buf
    return out


def test_dicts_are_shown_in_insertion_order_or_by_key():
    a = {"b": torch.zeros(1), "a": torch.zeros(2)}
    b = {"a": torch.zeros(2), "b": torch.zeros(3)}
    msg = shapes.mismatch_message(_records(a, b), 2, a, "op", 0)
    assert "  - Process 0: {'b': [1], 'a': [2]}\n  - Process 1: {'a': [2], 'b': [3]}" in msg
    assert "keys of input are in another order: ['a', 'b'] instead of ['b', 'a']" in msg
    msg = shapes.mismatch_message(_records(a, b, key_order=False), 2, a, "op", 0, key_order=False)
    assert "  - Process 0: {'a': [2], 'b': [1]}\n  - Process 1: {'a': [2], 'b': [3]}" in msg
    assert "shape of input['b'] is [3] instead of [1]" in msg


def test_one_leaf_is_said_in_the_singular():
    empty, one = {}, {"a": torch.zeros(2)}
    msg = shapes.mismatch_message(_records(empty, one), 2, one, "op", 1)
    assert "  - Process 1: structure (1 leaf instead of 0: keys of input are ['a'] instead of []" in msg


def test_key_names_travel_between_ranks():
    """Each rank's key names (NOTE: [key names]) let every rank name keys it does not have."""
    mine, theirs = {"a": torch.zeros(2), "b": torch.zeros(2)}, {"a": torch.zeros(2), ("c", 1): [{"deep": None}]}
    gathered = bytearray()
    for o in (mine, theirs):
        buf = bytearray(shapes.KEY_WORDS * 8)
        shapes.pack_key_names(o, buf)
        gathered += buf
    names = shapes.unpack_key_names(gathered, 2)
    assert sorted(names.values()) == sorted(["'a'", "'b'", "('c', 1)", "'deep'"])
    out = _records(mine, theirs)
    without = shapes.mismatch_message(out, 2, mine, "op", 0)
    assert "('c', 1)" not in without and "<key #" in without
    msg = shapes.mismatch_message(out, 2, mine, "op", 0, key_names=names)
    assert "  - Process 1: {'a': [2], ('c', 1): [{'deep': None}]}" in msg
    assert "(missing 'b'; extra ('c', 1))" in msg
    # the same message whichever rank writes it
    assert msg == shapes.mismatch_message(out, 2, theirs, "op", 1, key_names=names)
    # a buffer too small for every key keeps those that fit, whole
    many = {f"key{i:04d}" * 4: torch.zeros(1) for i in range(200)}
    buf = bytearray(shapes.KEY_WORDS * 8)
    shapes.pack_key_names(many, buf)
    names = shapes.unpack_key_names(buf, 1)
    assert 0 < len(names) < 200 and all(repr(k) in names.values() for k in list(many)[:len(names)])


def test_structure_hashes_tell_key_order_from_other_differences_when_too_large():
    keys = [f"k{i}" for i in range(80)]  # more tokens than the record holds
    a = {k: torch.zeros(2) for k in keys}
    reordered = {k: a[k] for k in reversed(keys)}
    msg = shapes.mismatch_message(_records(a, reordered), 2, None, "op")
    assert "  - Process 1: the same dict keys in another order" in msg
    renamed = dict(a)
    renamed["other"] = renamed.pop("k5")
    msg = shapes.mismatch_message(_records(a, renamed), 2, None, "op")
    assert "  - Process 1: structure: container types, lengths, dict keys or leaf types" in msg
    wider = dict(a, k7=torch.zeros(3))
    msg = shapes.mismatch_message(_records(a, wider), 2, None, "op")
    assert "  - Process 1: shapes (too many tensors to compare one by one)" in msg


@pytest.mark.parametrize("seconds", [1e-9, 0.0005, 1.0, 60.0, 1.5e6, 2.2e6, 1e9, 1e10, 1e12,
                                     1e300, sys.float_info.max])
def test_timeouts_passed_to_torch_are_capped(seconds):
    td = channel.torch_timeout(seconds)
    assert 0.001 <= td.total_seconds() <= channel.MAX_TORCH_TIMEOUT_S
    assert td.total_seconds() * 1000 < 2 ** 31  # fits the narrowest timeout field on the way
    if 0.001 <= seconds <= channel.MAX_TORCH_TIMEOUT_S:
        assert td.total_seconds() == pytest.approx(seconds)


def _run_as(filename: str, source: str, scope: dict):
    exec(compile(source, filename, "exec"), scope)


def test_call_site_skips_numguard_and_torch_frames(tmp_path):
    """A call site seen through frames of torch (module __call__, dynamo's wrappers) and of
    numguard names the user's line, whatever the order and number of those frames."""
    torch_dir = os.path.dirname(os.path.abspath(torch.__file__))
    numguard_dir = os.path.dirname(os.path.dirname(os.path.abspath(channel.__file__)))
    internal = {
        "torch_nn": os.path.join(torch_dir, "nn", "modules", "module.py"),
        "dynamo": os.path.join(torch_dir, "_dynamo", "eval_frame.py"),
        "numguard": os.path.join(numguard_dir, "numguard", "inspector.py"),
    }
    for chain in itertools.chain.from_iterable(
            itertools.permutations(internal, n) for n in range(0, 4)):
        scope = {"call_site": channel.call_site}
        inner = "call_site"
        for i, name in enumerate(chain):
            fn = f"layer{i}"
            _run_as(internal[name], f"def {fn}():\n    return {inner}()\n", scope)
            inner = fn
        user_file = str(tmp_path / "train.py")
        _run_as(user_file, f"\n\ndef step():\n    return {inner}()\n", scope)
        assert scope["step"]() == f"{user_file}:4", chain


def test_call_site_does_not_skip_a_file_beside_the_numguard_package(tmp_path):
    numguard_pkg = os.path.dirname(os.path.dirname(os.path.abspath(channel.__file__)))
    lookalike = numguard_pkg + "_examples.py"  # shares the prefix, not the directory
    scope = {"call_site": channel.call_site}
    _run_as(lookalike, "def step():\n    return call_site()\n", scope)
    assert scope["step"]() == f"{lookalike}:2"


class _FakeGroup:
    """What channel.exclusive needs of a group state."""

    def __init__(self):
        self.lock = threading.RLock()
        self.holder = None
        self.warned = set()
        self.name = "0"

    def warn_once(self, kind, message):
        channel._GroupState.warn_once(self, kind, message)


def test_threads_sharing_a_group_run_one_at_a_time_and_are_warned_about_once():
    st = _FakeGroup()
    inside = []
    overlaps = []
    entered = threading.Event()

    def op(name, hold_s):
        with channel.exclusive(st, f"check {name}"):
            if inside:
                overlaps.append((name, list(inside)))
            inside.append(name)
            entered.set()
            time.sleep(hold_s)
            with channel.exclusive(st, "nested"):  # the same thread may re-enter
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


# The store protocol of the trip exchange, with ranks as threads over one in-memory store.

def _meetings(schedules, grace_s=0.15):
    """Run ``schedules[r]`` (a list of ("meet", None) / ("pause", seconds) / ("sync", None), the
    last standing for a collective like DDP's all_reduce) on a thread per rank over one
    HashStore; return per rank the list of (slot, joined)."""
    store = torch.distributed.HashStore()
    world = len(schedules)
    results = [[] for _ in range(world)]
    errors = []
    sync = threading.Barrier(world)

    def rank_main(r):
        try:
            rv = rendezvous.Rendezvous(store, "t/", list(range(world)), r)
            for what, arg in schedules[r]:
                if what == "pause":
                    time.sleep(arg)
                elif what == "sync":
                    sync.wait(30)
                else:
                    m = rv.meet(grace_s)
                    results[r].append((m.slot, m.joined))
        except Exception as exc:  # noqa: BLE001 - the test reports it
            errors.append((r, repr(exc)))

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not any(th.is_alive() for th in threads), "a rank hung in the rendezvous"
    assert errors == []
    for r, schedule in enumerate(schedules):  # every meeting returned
        assert len(results[r]) == sum(what == "meet" for what, _ in schedule), (r, results)
    return results


def _random_schedule(rng, n):
    out = []
    for _ in range(n):
        if rng.random() < 0.3:
            out.append(("pause", rng.choice([0.0, 0.01, 0.05, 0.3])))
        out.append(("meet", None))
    return out


@pytest.mark.parametrize("seed", range(12))
def test_rendezvous_outcomes_agree_across_ranks(seed):
    """Ranks with different numbers of exchanges and random delays: a slot is joined by every
    rank or by none, no rank hangs, and nothing raises."""
    rng = random.Random(seed)
    world = rng.choice([2, 3, 4])
    schedules = [_random_schedule(rng, rng.randint(2, 7)) for _ in range(world)]
    results = _meetings(schedules)
    joined = {}
    for r, res in enumerate(results):
        for slot, ok in res:
            if ok:
                joined.setdefault(slot, set()).add(r)
    for slot, ranks in joined.items():
        assert ranks == set(range(world)), (slot, ranks, results)


@pytest.mark.parametrize("extra", [1, 2, 4])
@pytest.mark.parametrize("late_start", [0.0, 0.6])
@pytest.mark.parametrize("evaluating", [0, 1])
def test_rendezvous_lines_up_again_after_a_rank_ran_extra_exchanges(extra, late_start,
                                                                    evaluating):
    """One rank runs extra exchanges alone (an evaluation with gradients), the other starts
    training now or later; then both train in lockstep (an exchange, then a collective, as with
    DDP). Within three steps the ranks meet at every step again."""
    steps = 7
    train = [item for _ in range(steps) for item in (("meet", None), ("sync", None))]
    schedules = [None, None]
    schedules[evaluating] = [("meet", None)] * extra + train
    schedules[1 - evaluating] = [("pause", late_start)] + train
    results = _meetings(schedules, grace_s=0.3)
    trained = [results[evaluating][extra:], results[1 - evaluating]]
    for res in trained:
        assert len(res) == steps
        assert [ok for _, ok in res[3:]] == [True] * (steps - 3), results


def test_rendezvous_alone_stops_waiting():
    """One rank meeting alone waits the grace once, then briefly once, then not at all (the
    run finishes far sooner than a grace per exchange would allow)."""
    store = torch.distributed.HashStore()
    rv = rendezvous.Rendezvous(store, "alone/", [0, 1], 0)
    waited = [rv.meet(1.0).waited_s for _ in range(50)]
    assert waited[0] == 1.0 and 0 < waited[1] < 1.0 and set(waited[2:]) == {0.0}
    assert not store.check(["alone/3/n"])  # a passive rank writes nothing


def test_exchange_grace_is_validated():
    with pytest.raises(ValueError, match="grace"):
        trip_exchange._exchange_grace(-1)
    with pytest.raises(ValueError, match="grace"):
        trip_exchange._exchange_grace("soon")
    assert trip_exchange._exchange_grace(0.25) == 0.25


def test_trip_details_keep_the_tuple_shape():
    d = trip_exchange.TripDetail(1, "mlp", 4)
    assert d == (1, "mlp") and list(d) == [1, "mlp"] and d.batch == 4
    rank, module = d
    assert (rank, module) == (1, "mlp")


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
    collectives._wait(DoneLater(), st, "`op`", "here.py:1", 1e10)  # CPU path: Work.wait(cap)


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


@pytest.fixture(scope="module")
def partial():
    return dist_workers.run_scenario("partial_exchange", 2, timeout=240,
                                     env={"NUMGUARD_DIST_TIMEOUT": "2"})


@pytest.mark.parametrize("case", ["eval/0/1", "eval/0/3", "eval/1/2"])
def test_evaluation_with_gradients_on_one_rank_neither_crashes_nor_loses_the_trip(partial, case):
    for r in partial:
        out = r[case]
        assert "ok" in out, out
        steps_done, raised = out["ok"]
        assert steps_done == [0, 1] and raised == [2, [1]], (r["log"][-2000:], out)


def test_missing_rank_is_warned_about_once_by_name(partial):
    # (Rank 0's extra evaluation batch also shifts its batch numbers against rank 1's: the
    # exchange says so in a warning of its own, which is not counted here.)
    first = [w for w in partial[0]["eval/0/1"]["warnings"] if "did not come" in w]
    assert len(first) == 1, partial[0]["eval/0/1"]["warnings"]
    assert "ranks [1] did not come to numguard's trip exchange" in first[0]
    assert "this process is rank 0" in first[0] and "dist_workers.py:" in first[0]
    for r in partial:
        every = [w for case, out in r.items() if isinstance(out, dict) and "warnings" in out
                 for w in out["warnings"] if "did not come" in w]
        assert len(every) <= 1, every


@pytest.mark.parametrize("who", [0, 1])
def test_watch_on_one_rank_only_trains_to_the_end(partial, who):
    for r in partial:
        out = r[f"watch_one/{who}/0"]
        assert out.get("ok") == [[0, 1, 2], None], out
    assert all(r["returncode"] == 0 for r in partial)


@pytest.fixture(scope="module")
def details():
    return dist_workers.run_scenario("exchange_details", 2, timeout=180)


def test_different_batches_in_the_exchange_are_named(details):
    for rank, r in enumerate(details):
        pairs = r["batches"]
        for k, out in enumerate(pairs):
            assert out["ok"] == [0, 0]
            assert out["last"]["complete"] and out["last"]["batches"] == [k, 2 * k + 1]
        w = pairs[0]["warnings"]
        assert len(w) == 1 and all(p["warnings"] == [] for p in pairs[1:])  # once
        mine, theirs = (0, 1) if rank == 0 else (1, 0)
        assert f"paired batch {mine} on this rank (rank {rank})" in w[0]
        assert f"with batch {theirs} on rank {1 - rank}" in w[0]
        assert "check_every" in w[0]


def test_inspector_checks_of_different_batches_name_both(details):
    # (The once-only "paired batch" warning was given earlier in this launch: see the test above.)
    for r in details:
        assert r["check_every"].get("exc") == "NonFiniteError", r["check_every"]
    # Rank 0's own values were finite: it names rank 1 and the batch rank 1 tripped in.
    assert "rank 1 (" in details[0]["check_every"]["msg"] and "its batch 1" in details[0]["check_every"]["msg"]
    assert "on rank 1 during batch_number=1" in details[1]["check_every"]["msg"]


def test_same_batch_exchange_and_details_carry_batch_numbers(details):
    for r in details:
        out = r["same_batch"]
        assert out["ok"] == [1, 0] and out["warnings"] == []
        assert out["last"]["batches"] == [7, 7]
        assert r["details"] == [[0, "mlp", 7]]


@pytest.mark.parametrize("how", ["arg", "env", "trigger env"])
@pytest.mark.parametrize("value", ["1000", "86400", "1e+07", "1e+10", "1e+300"])
def test_long_timeouts_work_and_longer_ones_are_refused_up_front(details, how, value):
    """Up to a day (numguard.env.MAX_DIST_TIMEOUT_S) a healthy check stays healthy (the timeout
    handed to torch is capped); past it the value is refused with the bound and its reason."""
    for r in details:
        out = r["huge"][f"{how} {value}"]
        if float(value) <= 86400:
            assert "ok" in out, out
        else:
            assert out["exc"] in ("OptionError", "EnvironmentSettingError"), out
            assert "86400" in out["msg"], out


def test_guard_with_a_day_long_timeout(details):
    for r in details:
        assert r["huge"]["guard 86400"] == {"ok": [2.0, 2.0]}
        assert r["huge"]["guard 1e10"]["exc"] == "OptionError" and "86400" in r["huge"]["guard 1e10"]["msg"]


def test_equal_dicts_in_different_orders_pass_and_real_differences_do_not(details):
    for r in details:
        assert r["dict_order"] == {"ok": None}
        assert r["dict_order_default"]["exc"] == "DistributedOperationException"
        assert "keys of input are in another order" in r["dict_order_default"]["msg"]
        out = r["dict_value_differs"]
        assert out["exc"] == "DistributedOperationException"
        assert "shape of input['a'] is [6] instead of [5]" in out["msg"]
    assert details[0]["dict_value_differs"]["msg"] == details[1]["dict_value_differs"]["msg"]


def test_threads_sharing_a_group_never_corrupt_checks(details):
    for r in details:
        out = r["threads"]
        outcomes = out["ok"]
        for name in ("A", "B"):
            assert len(outcomes[name]) == 20
            # Ranks may pair the threads' checks differently (a mismatch, named as such), but
            # no check times out, reads a foreign record, or breaks the store.
            assert set(outcomes[name]) <= {"ok", "DistributedOperationException"}, outcomes
        assert len(out["warnings"]) <= 1
        assert all("one after the other" in w for w in out["warnings"])
        assert r["after_threads"] == {"ok": None}
