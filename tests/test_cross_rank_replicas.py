"""The replica divergence sentinel (numguard.distributed.replicas) on real gloo jobs: 2 and 4 CPU
ranks, one subprocess per rank with a hard timeout. This file is also the rank worker:
``python tests/test_cross_rank_replicas.py <scenario> <out.json>``."""
from __future__ import annotations

import json
import os
import sys
import warnings

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from dist_workers import finish_rank, run_worker_file  # noqa: E402

TIMEOUT_S = 150


def run(scenario: str, world: int) -> list:
    return run_worker_file(__file__, scenario, world, TIMEOUT_S)


# ---------------------------------------------------------------------------------------------
# Tests (parent side)

def test_healthy_ddp_run_reports_nothing():
    for r in run("healthy", 2):
        assert r["findings"] == [] and r["warnings"] == [], r
        assert r["checks"] == 2 * 6  # parameters and gradients at every one of 6 steps
        assert r["error"] is None


def test_one_ulp_nudge_on_one_rank_is_named_at_the_next_check():
    results = run("nudge", 4)
    for rank, r in enumerate(results):
        assert r["error"] == "ReplicaDivergenceError", r
        f = r["finding"]
        assert f["kind"] == "parameters" and f["when"] == "forward #2"  # nudged before forward #2
        assert f["batch_number"] == 2
        (m,) = f["parameters"]
        assert m["name"] == "module.fc2.weight"
        assert m["minority_ranks"] == [2] and m["majority_ranks"] == [0, 1, 3]
        assert m["differing_elements"] == 1 and m["max_ulps"] == 1
        assert "differs on rank 2 from ranks 0, 1, 3" in r["message"]
        assert r["steps_done"] == 2  # raised before forward #2 ran


def test_corrupted_gradient_all_reduce_is_found_before_the_optimizer_step():
    results = run("bad_allreduce", 2)
    for r in results:
        assert r["error"] == "ReplicaDivergenceError", r
        f = r["finding"]
        assert f["kind"] == "gradients" and f["when"] == "optimizer step #2"
        assert f["batch_number"] == 2
        (m,) = f["parameters"]  # the hook nudged the first element of the one gradient bucket
        assert m["minority_ranks"] == [1] and m["majority_ranks"] == [0] and m["tie"]
        assert m["differing_elements"] == 1 and m["max_ulps"] == 1
        assert r["steps_done"] == 2
        assert r["weights_unchanged"], "the optimizer step ran although the gradients diverged"
        assert "the step has not run" in r["message"]


def test_dump_writes_every_ranks_fingerprint_table(tmp_path):
    results = run("dump", 2)
    for r in results:
        assert r["error"] is None and len(r["findings"]) == 1
        data = r["dump_data"]
        assert os.path.basename(r["findings"][0]["dump"]) == f"numguard-replicas-rank{r['rank']}-parameters-2.json"
        assert data["format"] == "numguard-replicas"
        assert set(data["fingerprints"]) == {"0", "1"}
        name = data["parameters"][0]["name"]
        assert data["fingerprints"]["0"][name] != data["fingerprints"]["1"][name]
        assert r["warnings"] and "diverged" in r["warnings"][0]


def test_a_data_parallel_group_other_than_the_world():
    results = run("groups", 4)
    for rank, r in enumerate(results):
        # Each pair {0,1}, {2,3} holds its own weights: only the nudge inside the second pair is news.
        if rank < 2:
            assert r["findings"] == [], r
        else:
            (f,) = r["findings"]
            assert f["ranks"] == [2, 3]
            assert f["parameters"][0]["minority_ranks"] == [3]
            assert f["parameters"][0]["name"] == "module.fc1.bias"


def test_option_is_validated_and_off_by_default(monkeypatch):
    import numguard
    import torch
    model = torch.nn.Linear(2, 2)
    with numguard.watch(model) as insp:
        assert insp.options.replicas == 0
    with pytest.raises(ValueError, match="replicas"):
        numguard.watch(model, replicas=-1)
    monkeypatch.setenv("NUMGUARD_REPLICA_CHECK", "7")
    with numguard.watch(model) as insp:
        assert insp.options.replicas == 7
    monkeypatch.setenv("NUMGUARD_REPLICA_CHECK", "often")
    with pytest.raises(ValueError, match="NUMGUARD_REPLICA_CHECK"):
        numguard.watch(model)


def test_sharded_parameters_are_skipped_and_hooks_go_with_close():
    import numguard
    import torch
    from numguard.distributed import ReplicaSentinel
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    model[1].weight._is_flat_param = True  # how FSDP marks its flat (sharded) parameters
    sentinel = ReplicaSentinel(model, every=5)
    assert sentinel.names == ["0.weight", "0.bias", "1.bias"] and sentinel.skipped == ["1.weight"]
    assert sentinel.check("parameters", sentinel.params) is None  # no process group: nothing to compare
    sentinel.remove()
    assert not model._forward_pre_hooks
    with numguard.watch(model, replicas=3, report_to=None) as insp:
        (sentinel,) = [h for h in insp._handles if isinstance(h, ReplicaSentinel)]
        assert sentinel.every == 3 and sentinel.on_trip == "raise"
        assert len(model._forward_pre_hooks) >= 1
    assert not model._forward_pre_hooks


# ---------------------------------------------------------------------------------------------
# Rank side

def _setup():
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    return torch, dist


def _model(torch, seed=0):
    torch.manual_seed(seed)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.act, self.fc2 = torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)

        def forward(self, x):
            return self.fc2(self.act(self.fc1(x)))
    return Net()


def _train(torch, ddp, steps, rank, before_step=None, after_step=None, done=None):
    """`steps` SGD steps on rank-specific data; `done[0]` counts the steps that completed."""
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(100 + rank)
    done = [0] if done is None else done
    for step in range(steps):
        if before_step:
            before_step(step)
        x = torch.randn(4, 8, generator=g)
        loss = ddp(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        done[0] += 1
        if after_step:
            after_step(step)


def _capture(fn):
    caught = []
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        result = fn()
    for item in w:
        if "diverged" in str(item.message):
            caught.append(str(item.message))
    return result, caught


def worker(scenario):
    torch, dist = _setup()
    import numguard
    from numguard.distributed import ReplicaDivergenceError
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {"findings": [], "warnings": [], "error": None, "checks": 0}
    if scenario in ("healthy", "nudge", "bad_allreduce", "dump"):
        ddp = torch.nn.parallel.DistributedDataParallel(_model(torch))
        on_trip = "dump" if scenario == "dump" else "raise"
        insp = numguard.watch(ddp, replicas=1, on_trip=on_trip, dump_dir=os.environ["NG_TMP"],
                              report_to=None)
        sentinel = next(h for h in insp._handles if hasattr(h, "findings"))
        done = [0]

        def nudge(step):
            if step == 2 and rank == 2:
                with torch.no_grad():
                    w = ddp.module.fc2.weight
                    w[1, 3] = torch.nextafter(w[1, 3], torch.tensor(float("inf")))
            if step == 2 and scenario == "dump" and rank == 1:  # found at forward #2, once
                with torch.no_grad():
                    ddp.module.fc1.weight[0, 0] += 1.0

        if scenario == "bad_allreduce":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
            calls = [0]

            def hook(state, bucket):
                fut = default_hooks.allreduce_hook(None, bucket)
                calls[0] += 1
                corrupt = rank == 1 and calls[0] == 3

                def then(f):
                    v = f.value()
                    t = v[0] if isinstance(v, list) else v
                    if corrupt:
                        t[0] = torch.nextafter(t[0], torch.tensor(float("inf")))
                    return t
                return fut.then(then)
            ddp.register_comm_hook(None, hook)

        before = [p.detach().clone() for p in ddp.parameters()]

        def after(step):
            before[:] = [p.detach().clone() for p in ddp.parameters()]

        def body():
            return _train(torch, ddp, 6, rank, before_step=nudge, after_step=after, done=done)
        try:
            _, out["warnings"] = _capture(body)
        except ReplicaDivergenceError as exc:
            out["error"] = type(exc).__name__
            out["finding"] = exc.finding
            out["message"] = str(exc)
        out["steps_done"] = done[0]
        out["weights_unchanged"] = all(torch.equal(a, b) for a, b in zip(before, ddp.parameters()))
        out["findings"] = sentinel.findings
        out["checks"] = sentinel.checks
        out["rank"] = rank
        if scenario == "dump" and sentinel.findings:
            with open(sentinel.findings[0]["dump"]) as f:
                out["dump_data"] = json.load(f)
        insp.close(check=False)
    elif scenario == "groups":
        pair = dist.new_group([0, 1]), dist.new_group([2, 3])
        mine = pair[rank // 2]
        ddp = torch.nn.parallel.DistributedDataParallel(_model(torch, seed=rank // 2), process_group=mine)
        sentinel = numguard.distributed.watch_replicas(ddp, every=1, group=mine, on_trip="warn")

        def nudge(step):
            if step == 1 and rank == 3:
                with torch.no_grad():
                    ddp.module.fc1.bias[2] = torch.nextafter(ddp.module.fc1.bias[2], torch.tensor(0.0))
        _, out["warnings"] = _capture(lambda: _train(torch, ddp, 3, rank, before_step=nudge))
        out["findings"] = sentinel.findings
        sentinel.remove()
    return out


if __name__ == "__main__":
    finish_rank(worker(sys.argv[1]))
