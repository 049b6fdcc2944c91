"""Which rank and which fault a multi-rank job is told about, on real gloo DDP jobs.
This file is also the rank worker: ``python tests/test_cross_rank_blame.py <scenario>``."""
from __future__ import annotations

import os
import sys

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
    from numguard.distributed.coordination import TripDetail, earliest_fault
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


SCENARIOS = {"forward_fault": _forward_fault, "finite_rank": _finite_rank}


def worker(scenario):
    import torch.distributed as dist
    dist.init_process_group("gloo")
    return SCENARIOS[scenario](dist.get_rank(), dist.get_world_size())


if __name__ == "__main__":
    finish_rank(worker(sys.argv[1]))
