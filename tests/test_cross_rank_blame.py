"""Which rank and which fault a multi-rank job is told about, on real gloo DDP jobs.
This file is also the rank worker: ``python tests/test_cross_rank_blame.py <scenario>``."""
from __future__ import annotations

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from dist_workers import finish_rank, run_worker_file  # noqa: E402

TIMEOUT_S = 150
FAULT_STEP = 2


def run(scenario: str, world: int = 2) -> list:
    return run_worker_file(__file__, scenario, world, TIMEOUT_S)


# ---------------------------------------------------------------------------------------------
# The rule, on details

def test_earliest_fault_orders_batch_then_kind_then_frame_then_rank():
    from numguard.distributed.trip_exchange import TripDetail, earliest_fault
    grads = TripDetail(0, "", 2, "parameter gradient", 0, ["proj.weight.grad"])
    forward = TripDetail(1, "proj", 2, "forward", 0, ["input[0]"])
    tapped = TripDetail(2, "head", 2, "gradient", 3, ["grad_input[0]"])
    assert earliest_fault([grads, forward, tapped]) is forward
    assert earliest_fault([grads, tapped]) is tapped
    # an earlier batch wins whatever its kind; unknown kinds come last
    older = TripDetail(3, "", 1, "parameter gradient")
    assert earliest_fault([forward, older]) is older
    assert earliest_fault([TripDetail(0, "x", 2, None), grads]) is grads
    # a collective in the forward (SyncBatchNorm) carries a NaN to a later frame of the others
    later = TripDetail(0, "bn2", 2, "forward", 5)
    sooner = TripDetail(1, "bn1", 2, "forward", 2)
    assert earliest_fault([later, sooner]) is sooner
    # the same fault on every rank (a gradient all_reduce makes them equal): the lowest rank
    same = [TripDetail(1, "", 2, "parameter gradient"), TripDetail(0, "", 2, "parameter gradient")]
    assert earliest_fault(same)[0] == 0
    assert earliest_fault([]) is None


def test_single_process_error_names_its_own_fault():
    import torch

    import numguard
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with numguard.watch(model, report_to=None):
        try:
            model(torch.full((2, 4), float("nan")))
        except numguard.NonFiniteError as exc:
            err = exc
    assert err.module == "0" and err.own_module == "0" and err.fault_rank is None
    assert err.fault_kind == "forward" and err.labels == ["input[0]", "output"]


# ---------------------------------------------------------------------------------------------
# Jobs

def test_forward_fault_on_rank_1_is_named_by_every_rank_with_backward_watching():
    """DDP, backward=True: rank 1's NaN input reaches rank 0's parameter gradients through the
    gradient all_reduce before the step's check. Both ranks name rank 1, its module, forward;
    rank 0 says its gradients were poisoned by the all_reduce."""
    r0, r1 = run("forward_fault")
    for r in (r0, r1):
        assert r["steps_done"] == [0, 1] and r["raised_in_step"] == FAULT_STEP, r
        assert r["module"] == "module.proj" and r["fault_rank"] == 1, r
        assert r["fault_kind"] == "forward" and r["batch_number"] == FAULT_STEP
        assert r["labels"] == ["input[0]", "output"]
        assert r["ranks"] == [0, 1]
        assert r["report_fault"]["rank"] == 1 and r["report_fault"]["kind"] == "forward"
    assert r0["message"].startswith("numguard: inf/nan detected on rank 1 (module.proj [input[0], output], "
                                    "forward, batch_number=2)"), r0["message"]
    assert "poisoned by the gradient all_reduce" in r0["message"]
    assert "detected on rank 0" not in r0["message"]
    assert r0["own_module"] == "" and r0["report_fault"]["this_rank"] is False
    assert "earliest non-finite value across ranks: rank 1 in module.proj" in r0["report"]
    # rank 1 blames itself, and says the others' NaN came from it
    assert r1["own_module"] == "module.proj" and r1["report_fault"]["this_rank"] is True
    assert r1["message"].startswith("numguard: inf/nan detected on rank 1 during batch_number=2 in module.proj")
    assert "later also on rank 0" in r1["message"]
    assert "earliest non-finite value across ranks" not in r1["report"]


def test_finite_rank_error_names_the_module_of_the_rank_that_tripped():
    """No DDP, forward watching only: rank 0's values stay finite. Its NonFiniteError.module is
    rank 1's module (as its docstring says), own_module None."""
    r0, r1 = run("finite_rank")
    for r in (r0, r1):
        assert r["module"] == "proj" and r["fault_rank"] == 1 and r["fault_kind"] == "forward", r
        assert r["labels"] == ["input[0]", "output"] and r["ranks"] == [1]
    assert r0["own_module"] is None and r0["report"] == ""
    assert "(this rank's values were finite)" in r0["message"]
    assert r1["own_module"] == "proj"


# ---------------------------------------------------------------------------------------------
# Cross-rank numbers (numguard.distributed.last_outliers / last_numbers)

def _named(r):
    return {(o["rank"], o["metric"]) for o in r["outliers"]}


@pytest.mark.parametrize("collective", ["batchnorm", "replicas"])
def test_slow_rank_is_named_when_the_forward_has_a_collective(collective):
    """Rank 1 is slow before each forward; DDP broadcasts BatchNorm's buffers (or numguard's
    replica check meets) at the forward's start, where rank 0 waits for it. The wait is rank 1's
    time, not rank 0's: rank 1 is named, rank 0 is not."""
    for r in run(f"slow_{collective}"):
        assert _named(r) == {(1, "step_time")}, r["outliers"]
        assert r["warnings"] == [], r["warnings"]
        times = {row["rank"]: row["step_time_s"] for row in r["numbers"]}
        assert times[1] > 2 * times[0], times


def test_healthy_job_with_collectives_in_the_forward_names_nobody():
    for r in run("healthy_collectives"):
        assert r["outliers"] == [] and r["warnings"] == [], r


def test_rank_whose_loss_is_scaled_is_named_as_gradient_outlier():
    """Rank 1's loss is x1000: its own gradients are 1000x rank 0's (the parameter gradients
    after the all_reduce are the same on both ranks and must not hide that)."""
    for r in run("scaled_loss"):
        named = _named(r)
        assert (1, "gradients") in named and all(rank == 1 for rank, _ in named), r["outliers"]
        entry = next(o for o in r["outliers"] if o["metric"] == "gradients")
        assert entry["ratio"] > 100
        assert r["warnings"] == []


def test_evaluation_on_rank_0_alone_takes_no_part_and_warns_nothing():
    """Between training steps rank 0 evaluates alone under no_grad, through DDP and through its
    inner module, while rank 1 waits in a barrier: no warning on either rank ("did not come",
    "paired batch"), rank 0 is not a step-time outlier, and training checks still pair up."""
    results = run("eval_rank0")
    for r in results:
        assert r["warnings"] == [], r["warnings"]
        assert r["outliers"] == [], r["outliers"]
        assert r["last_exchange"]["complete"]
    # the evaluation's batches are counted on rank 0 only: rank 0 is further along
    b0, b1 = results[0]["last_exchange"]["batches"]
    assert b0 - b1 == results[0]["eval_batches"] > 0


def test_replica_finding_prints_no_buffer_warning():
    """numguard's replica check names a nudged parameter without PyTorch's 'buffer is not
    writable' UserWarning (or any other warning but its own finding)."""
    for r in run("replica_nudge"):
        assert len(r["divergence"]) == 1 and "fc2.weight" in r["divergence"][0], r
        assert r["other_warnings"] == [], r["other_warnings"]


# ---------------------------------------------------------------------------------------------
# Rank side

def _model(torch):
    from collections import OrderedDict
    torch.manual_seed(0)
    return torch.nn.Sequential(OrderedDict(
        proj=torch.nn.Linear(8, 16), act=torch.nn.Tanh(), head=torch.nn.Linear(16, 4)))


def _forward_fault(rank, world):
    """DDP with backward=True; rank 1 feeds a NaN input at FAULT_STEP (rank 0's data is finite)."""
    import torch

    import numguard
    ddp = torch.nn.parallel.DistributedDataParallel(_model(torch))
    insp = numguard.watch(ddp, backward=True, report_to=None)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    res = {"steps_done": []}
    try:
        for step in range(FAULT_STEP + 2):
            x = torch.randn(4, 8, generator=g)
            if rank == 1 and step == FAULT_STEP:
                x[0, 0] = float("nan")
            try:
                ddp(x).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
            except numguard.NonFiniteError as exc:
                res.update(_error_fields(exc), raised_in_step=step)
                break
            res["steps_done"].append(step)
        res["report_fault"] = (insp.last_report or {}).get("first_fault")
    finally:
        insp.close(check=False)
    return res


def _error_fields(exc):
    return {"message": str(exc), "module": exc.module, "own_module": exc.own_module,
            "fault_rank": exc.fault_rank, "fault_kind": exc.fault_kind, "labels": exc.labels,
            "ranks": list(exc.ranks), "rank": exc.rank, "batch_number": exc.batch_number,
            "report": exc.report}


def _finite_rank(rank, world):
    """Forward watching, no DDP: rank 1 feeds a NaN at FAULT_STEP; rank 0 stays finite."""
    import torch

    import numguard
    from collections import OrderedDict
    torch.manual_seed(0)
    model = torch.nn.Sequential(OrderedDict(proj=torch.nn.Linear(4, 8), head=torch.nn.Linear(8, 2)))
    res = {}
    with numguard.watch(model, report_to=None):
        for step in range(FAULT_STEP + 2):
            x = torch.randn(3, 4)
            if rank == 1 and step == FAULT_STEP:
                x[0, 0] = float("nan")
            try:
                model(x).sum().backward()
            except numguard.NonFiniteError as exc:
                res.update(_error_fields(exc))
                break
    return res


def _numbers_job(rank, world, scenario):
    """DDP training with backward=True; what the cross-rank numbers named, and numguard's warnings."""
    import time
    import warnings

    import torch
    import torch.distributed as dist

    import numguard
    import numguard.distributed as ngd
    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 32)]
    if scenario in ("slow_batchnorm", "healthy_collectives"):
        layers.append(torch.nn.BatchNorm1d(32))
    layers += [torch.nn.Tanh(), torch.nn.Linear(32, 4)]
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(*layers))
    replicas = 1 if scenario in ("slow_replicas", "healthy_collectives") else 0
    insp = numguard.watch(ddp, backward=True, replicas=replicas, report_to=None)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    res = {"eval_batches": 0}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(8):
            if scenario.startswith("slow_") and rank == 1:
                time.sleep(0.15)  # a slow data loader
            if scenario == "eval_rank0" and step in (2, 3, 4, 5):
                if rank == 0:
                    ddp.eval()
                    with torch.no_grad():
                        for _ in range(2):
                            ddp(torch.randn(16, 8, generator=g))
                            ddp.module(torch.randn(16, 8, generator=g))
                            res["eval_batches"] += 1
                            time.sleep(0.1)
                    ddp.train()
                dist.barrier()
            loss = ddp(torch.randn(16, 8, generator=g)).pow(2).mean()
            if scenario == "scaled_loss" and rank == 1:
                loss = loss * 1000
            loss.backward()
            opt.step()
            opt.zero_grad()
    res["warnings"] = [str(w.message) for w in caught]
    res["outliers"] = ngd.last_outliers()
    res["numbers"] = ngd.last_numbers()
    res["last_exchange"] = ngd.last_exchange()
    insp.close(check=False)
    return res


def _replica_nudge(rank, world):
    import warnings

    import torch

    import numguard
    torch.manual_seed(0)
    from collections import OrderedDict
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(OrderedDict(
        fc1=torch.nn.Linear(8, 16), act=torch.nn.Tanh(), fc2=torch.nn.Linear(16, 4))))
    insp = numguard.watch(ddp, replicas=1, on_trip="warn", report_to=None)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(4):
            if step == 2 and rank == 1:
                with torch.no_grad():
                    w = ddp.module.fc2.weight
                    w[1, 3] = torch.nextafter(w[1, 3], torch.tensor(float("inf")))
            ddp(torch.randn(4, 8, generator=g)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    insp.close(check=False)
    messages = [str(w.message) for w in caught]
    divergence = [m for m in messages if "diverged" in m]
    return {"divergence": divergence, "other_warnings": [m for m in messages if m not in divergence]}


SCENARIOS = {"forward_fault": _forward_fault, "finite_rank": _finite_rank,
             "replica_nudge": _replica_nudge}
for _name in ("slow_batchnorm", "slow_replicas", "healthy_collectives", "scaled_loss", "eval_rank0"):
    SCENARIOS[_name] = (lambda name: lambda rank, world: _numbers_job(rank, world, name))(_name)



def worker(scenario):
    import torch.distributed as dist
    dist.init_process_group("gloo")
    return SCENARIOS[scenario](dist.get_rank(), dist.get_world_size())


if __name__ == "__main__":
    finish_rank(worker(sys.argv[1]))
