"""Ranks whose amax differs from their group's (watch(quant=..., amax_group=...),
numguard.distributed.amax): the rule on tables, and gloo jobs where one rank scales differently.
This file is also the rank worker: ``python tests/test_cross_rank_amax.py <scenario>``."""
from __future__ import annotations

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from dist_workers import finish_rank, kept_messages, run_worker_file  # noqa: E402

TIMEOUT_S = 240
STEPS = 6
ODD_FROM = 3   # the step from which the odd rank's amax differs
NAN = float("nan")


def run(scenario: str, world: int) -> list:
    return run_worker_file(__file__, scenario, world, TIMEOUT_S)


# ---------------------------------------------------------------------------------------------
# The rule, on tables (each row: numerics.FIELDS, then the group key and the digest)

def _row(key, digest):
    return [0.0] * 6 + [key, digest]


def test_the_odd_rank_of_a_group_is_named_and_groups_are_judged_apart():
    from numguard.distributed import amax

    rows = [_row(0, 5.0), _row(0, 5.0), _row(0, 7.0), _row(3, 1.0), _row(3, 2.0), _row(NAN, NAN)]
    found = amax._mismatches(rows, [0, 1, 2, 3, 4, 5], [9] * 6)
    assert found == [{"group": [0, 1, 2], "ranks": [2], "agreed": True, "batch": 9},
                     {"group": [3, 4], "ranks": [3, 4], "agreed": False, "batch": 9}]
    assert "rank 2 of amax group [0, 1, 2] saw a different amax" in amax.describe(found[0])
    assert "no one rank can be named" in amax.describe(found[1]) and "#442" in amax.describe(found[1])
    assert amax._mismatches([_row(0, 5.0)] * 4, [0, 1, 2, 3], [1] * 4) == []
    assert amax._mismatches([_row(NAN, NAN)] * 2, [0, 1], [None] * 2) == []   # no amax checked
    assert amax._mismatches([[0.0] * 6] * 2, [0, 1], [1, 1]) == []             # an older record


def test_the_digest_is_exact_and_does_not_depend_on_the_order_rows_came():
    import torch

    import numguard
    from numguard.inspector.quant_watch import QuantWatch

    def digest(order, values):
        model = torch.nn.Sequential(*[torch.nn.Identity() for _ in range(4)])
        with numguard.watch(model, report_to=None, quant="float8_e4m3fn") as insp:
            q = next(f for f in insp.features if isinstance(f, QuantWatch))
            insp._reader.amax = (0.0, q.amax_digest)
            owners = {o.name: o for o in insp._owners}
            for name in order:
                q._record(owners[name], "output", [torch.tensor([values[name], -values[name] / 2])])
            return q.amax_digest().item(), q.amax_digest().item()

    values = {"0": 3.0, "1": 0.5, "2": 1e-3, "3": 2.0 ** 20}
    first, after_reset = digest(["0", "1", "2", "3"], values)
    assert first == digest(["3", "1", "0", "2"], values)[0] and first == int(first) and first < 2 ** 52
    assert after_reset == 0.0   # each check starts again
    one_step = dict(values, **{"2": 1e-3 * (1 + 2.0 ** -22)})  # one float32 step up
    assert first != digest(["0", "1", "2", "3"], one_step)[0]
    assert first != digest(["0", "1", "2"], values)[0]


def test_amax_group_needs_quant_and_this_rank():
    import torch

    import numguard
    from numguard.env import OptionError

    model = torch.nn.Linear(2, 2)
    with pytest.raises(OptionError, match="amax_group=.*pass quant=FORMAT too"):
        numguard.watch(model, amax_group=[0])
    with pytest.raises(OptionError, match="not one of its ranks"):
        numguard.watch(model, quant="float8_e4m3fn", amax_group=[1, 2])
    with pytest.raises(OptionError, match="amax_group='tp'"):
        numguard.watch(model, quant="float8_e4m3fn", amax_group="tp")
    assert not model._forward_hooks
    with numguard.watch(model, quant="float8_e4m3fn", amax_group=[0], report_to=None) as insp:
        model(torch.ones(1, 2))
        assert insp.options.amax_group == (0,)


# ---------------------------------------------------------------------------------------------
# Jobs

def test_ranks_that_agree_are_silent_and_the_digest_adds_no_host_read():
    for r in run("agree", 2):
        assert r["mismatches"] == [] and r["logged"] == [], r
        numbers = r["sent"]
        assert numbers[6] == 0.0 and numbers[7] > 0 and numbers[7] == int(numbers[7])
        # per check: the state's read (+ the CPU exchange's read of its flag), with or without
        assert r["syncs_in_hooks"] == 0
        assert r["sync_events"] == r["sync_events_without_amax"] and r["sync_events"], r


def test_two_ranks_that_disagree_are_both_named():
    results = run("odd", 2)
    for r in results:
        assert r["mismatches"] == [{"group": [0, 1], "ranks": [0, 1], "agreed": False, "batch": r["batch"]}], r
        assert r["first_named"] == ODD_FROM + 1   # the digest travels one check late
    assert any("amax group [0, 1] disagree" in m for m in results[0]["logged"])
    assert results[1]["logged"] == []  # rank 0 logs for everyone


def test_the_odd_rank_of_three_is_named_as_a_list_of_ranks_too():
    results = run("odd_ranks", 3)
    for r in results:
        assert [(m["group"], m["ranks"], m["agreed"]) for m in r["mismatches"]] == [([0, 1, 2], [2], True)], r
    assert sum("rank 2 of amax group [0, 1, 2] saw a different amax" in m for m in results[0]["logged"]) == 1


# ---------------------------------------------------------------------------------------------
# Rank side

def worker(scenario):
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    import numguard
    import numguard.distributed as ngd
    from numguard.testing import SyncCounter
    rank, world = dist.get_rank(), dist.get_world_size()
    logged = kept_messages("numguard.distributed.amax")

    class Scale(torch.nn.Module):
        k = 1.0

        def forward(self, x):
            return x * self.k

    torch.manual_seed(0)  # one model and one batch stream on every rank: they see the same amax
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), Scale(), torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    group = list(range(world)) if scenario == "odd_ranks" else dist.group.WORLD
    out = {"first_named": None}

    def train(insp, steps, odd=False):
        g = torch.Generator().manual_seed(0)
        for step in range(steps):
            if odd and rank == world - 1 and step >= ODD_FROM:
                model[2].k = 2.0   # this rank's amax is no longer its group's
            model(torch.randn(4, 8, generator=g)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            if out["first_named"] is None and ngd.last_amax_mismatches():
                out["first_named"] = step

    if scenario == "agree":  # the same steps with and without amax_group, counting host reads
        plain = SyncCounter()
        with numguard.watch(model, quant="float8_e4m3fn", backward=True, report_to=None) as insp, plain():
            train(insp, STEPS)
        counter = SyncCounter()
        with numguard.watch(model, quant="float8_e4m3fn", backward=True, amax_group=group,
                            report_to=None) as insp, counter():
            train(insp, STEPS)
            out["sent"] = insp._reader._numbers_to_send()
        out["sync_events"], out["sync_events_without_amax"] = counter.where, plain.where
        out["syncs_in_hooks"] = counter.in_hooks
    else:
        with numguard.watch(model, quant="float8_e4m3fn", amax_group=group, report_to=None) as insp:
            train(insp, STEPS, odd=True)
            out["batch"] = insp.batch_number
    out["mismatches"] = ngd.last_amax_mismatches()
    out["logged"] = logged
    finish_rank(out)


if __name__ == "__main__":
    worker(sys.argv[1])
