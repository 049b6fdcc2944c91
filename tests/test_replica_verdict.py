"""The verdict of a replica check's finding (NOTE: [replica verdict] in numguard.distributed.
replica_blame): which rank's copy of the weights or gradients is corrupted, learned by every rank,
on 2 gloo ranks (by how far the differing values lie in their tensor) and on 3 (the majority), and
no verdict, saying so, when a flip keeps the magnitude. One subprocess per rank under a hard
timeout; this file is also the rank worker: ``python tests/test_replica_verdict.py <scenario>``."""
from __future__ import annotations

import math
import os
import sys
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from dist_workers import finish_rank, run_worker_file  # noqa: E402


def run(scenario: str, world: int = 2) -> list:
    return run_worker_file(__file__, scenario, world, timeout=240)   # a hard limit per job


# ---------------------------------------------------------------------------------------------
# Tests (parent side)

def test_oddness_measures_binades_from_the_median_magnitude_and_calls_non_finite_out_of_range():
    import torch

    from numguard.distributed.replica_blame import oddness
    x = torch.tensor([1.0, 2.0, 0.5, 1.0, 2.0 ** -20, 0.0, float("inf")])
    where = torch.zeros(7, dtype=torch.bool)
    where[4] = True
    assert oddness(x[:5], where[:5]) == 20.0   # the median of 1, 2, 0.5, 1 is 2^0
    where[4], where[5] = False, True
    assert oddness(x[:6], where[:6]) == 0.0    # a zero is an ordinary value
    where[5], where[6] = False, True
    assert oddness(x, where) == math.inf
    assert math.isnan(oddness(torch.arange(4), torch.tensor([True, False, False, False])))
    assert math.isnan(oddness(x, torch.zeros(7, dtype=torch.bool)))


def test_a_tie_is_decided_only_by_a_side_that_stands_out_by_the_gap():
    from numguard.distributed.replica_blame import GAP, suspects
    m = {"tie": True, "groups": [[0], [1]], "majority_ranks": [0], "minority_ranks": [1]}
    assert suspects({**m, "oddness": {"0": 0.5, "1": 0.5 + GAP}})[0] == [1]
    assert suspects({**m, "oddness": {"0": math.inf, "1": 3.0}})[0] == [0]
    ranks, how = suspects({**m, "oddness": {"0": 1.0, "1": 1.0 + GAP / 2}})
    assert ranks is None and "no side stands out" in how
    ranks, how = suspects({**m, "oddness": {"0": None, "1": 9.0}})
    assert ranks is None and "could not be compared" in how
    # no tie: the ranks outside the majority, whatever the values
    assert suspects({"tie": False, "groups": [[0, 1], [2]], "majority_ranks": [0, 1], "minority_ranks": [2],
                     "oddness": {}})[0] == [2]


def _check_device(a, rank, batch=None):
    assert a["verdict"] == "device" and a["rank"] == rank and a["host"] and a["device"] == "cpu", a
    assert f"the corrupted copy is on rank {rank}" in a["detail"], a
    assert "The data cannot make replicas differ" in a["detail"], a
    if batch is not None:
        assert a["batch_number"] == batch, a


def test_exponent_flips_in_a_bucket_and_a_weight_on_2_ranks_name_the_rank_on_both():
    for r in run("exponent"):
        bucket, weight = r["bucket"], r["weight"]
        assert bucket["kind"] == "gradients" and weight["kind"] == "parameters", r
        for finding, warned in ((bucket, r["bucket_warned"]), (weight, r["weight_warned"])):
            (m,) = finding["parameters"]
            assert m["tie"] and m["differing_elements"] == 1, m
            _check_device(finding["attribution"], 1, finding["batch_number"])
            assert warned == finding["attribution"], (warned, finding["attribution"])
            assert "Verdict: device" in r["messages"][0 if finding is bucket else 2]
        # the step took the corrupted gradients (on_trip="warn"): the weights diverge the next forward
        follow = r["follow_on"]
        assert follow["kind"] == "parameters" and follow["batch_number"] == bucket["batch_number"] + 1, follow
        _check_device(follow["attribution"], 1)
        assert "the optimizer step took the gradients corrupted on rank 1" in follow["attribution"]["detail"]
        assert r["attributions"] == [bucket["attribution"], follow["attribution"], weight["attribution"]]


def test_a_low_mantissa_flip_on_2_ranks_has_no_verdict_and_says_which_ranks_disagree():
    for r in run("low"):
        assert r["weight"]["attribution"] is None and r["attributions"] == [], r
        a = r["weight"]["verdict"]
        assert a["verdict"] is None and a["rank"] is None, a
        assert "No verdict: the data-parallel replicas" in r["messages"][0], r["messages"]
        assert "diverged between ranks 0, 1" in a["detail"] and "cannot be told" in a["detail"], a
        assert "no side stands out" in a["detail"] and "3 or more data-parallel ranks" in a["detail"], a


def test_on_3_ranks_the_majority_names_a_low_mantissa_flip_and_the_error_carries_it():
    for r in run("majority", world=3):
        assert r["error"] == "ReplicaDivergenceError", r
        _check_device(r["attribution"], 2)
        assert "differ from the majority of ranks" in r["attribution"]["detail"]


def test_a_healthy_run_pays_no_verdict_work_one_all_reduce_per_check():
    for r in run("healthy"):
        assert r["checks"] == 10 and r["all_reduces"] == 10, r   # 5 forwards and 5 steps, replicas=1
        assert r["all_gathers"] == 0 and r["judged"] == 0 and r["findings"] == 0, r


# ---------------------------------------------------------------------------------------------
# Rank side

def _ddp(torch):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    return torch.nn.parallel.DistributedDataParallel(net)


def _steps(torch, ddp, steps, rank, plant=None):
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(100 + rank)
    for step in range(steps):
        if plant is not None:
            plant(step)
        ddp(torch.randn(4, 4, generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def worker(scenario):
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    import numguard
    from numguard.distributed import CrossRankWarning, ReplicaDivergenceError
    from numguard.testing import faults
    out = {"rank": rank, "error": None}
    if scenario == "healthy":
        from numguard.distributed import replica_blame, replicas
        calls = {"all_reduces": 0, "all_gathers": 0, "judged": 0}

        def counted(key, fn):
            def wrapper(*args, **kwargs):
                calls[key] += 1
                return fn(*args, **kwargs)
            return wrapper
        col = replicas._collectives
        col.timed_all_reduce = counted("all_reduces", col.timed_all_reduce)
        col.timed_all_gather = counted("all_gathers", col.timed_all_gather)
        replica_blame.judge = counted("judged", replica_blame.judge)
        ddp = _ddp(torch)
        insp = numguard.watch(ddp, replicas=1, report_to=None)
        _steps(torch, ddp, 5, rank)
        out.update(calls, checks=insp._handles[-1].checks, findings=len(insp._handles[-1].findings))
        insp.close(check=False)
        return out
    # float32 values in [2^-15, 1) have exponent bit 4 set: flipping bit 27 divides by 2^16
    flip = {"exponent": dict(kind="exponent", bit=27), "low": dict(kind="low_mantissa"),
            "majority": dict(kind="low_mantissa")}[scenario]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if scenario == "exponent":
            ddp = _ddp(torch)
            faults.inject_bucket(ddp, at_call=3, rank=1, **flip)   # one bucket per step here
            insp = numguard.watch(ddp, replicas=1, on_trip="warn", report_to=None)
            _steps(torch, ddp, 5, rank)
            out["bucket"], out["follow_on"] = insp._handles[-1].findings
            out["attributions"] = [a.to_dict() for a in insp.attributions()]
            insp.close(check=False)
        ddp = _ddp(torch)
        insp = numguard.watch(ddp, replicas=1, on_trip="raise" if scenario == "majority" else "warn",
                              report_to=None)
        victim = dist.get_world_size() - 1

        def plant(step):
            if step == 3:
                faults.inject_weight(ddp.module[2], "weight", rank=victim, seed=5, **flip)
        try:
            _steps(torch, ddp, 5, rank, plant)
        except ReplicaDivergenceError as exc:
            out.update(error="ReplicaDivergenceError", attribution=exc.attribution.to_dict())
        findings = insp._handles[-1].findings
        out["weight"] = findings[0] if findings else None
        out["attributions"] = out.get("attributions", []) + [a.to_dict() for a in insp.attributions()]
        insp.close(check=False)
    warned = [w.message for w in caught if isinstance(w.message, CrossRankWarning)]
    out["messages"] = [str(w) for w in warned]
    if scenario == "exponent":
        out["bucket_warned"], _, out["weight_warned"] = [w.attribution.to_dict() for w in warned]
    return out


if __name__ == "__main__":
    finish_rank(worker(sys.argv[1]))
