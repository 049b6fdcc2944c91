"""Outlier ranks (numguard.distributed.numerics) on real gloo DDP jobs, and the rule itself.
This file is also the rank worker: ``python tests/test_cross_rank_outliers.py <scenario>``."""
from __future__ import annotations

import json
import logging
import math
import os
import socket
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from dist_workers import finish_rank, kept_messages, run_worker_file  # noqa: E402

TIMEOUT_S = 150
STEPS = 8


def run(scenario: str, world: int) -> list:
    return run_worker_file(__file__, scenario, world, TIMEOUT_S)


# ---------------------------------------------------------------------------------------------
# The rule, on tables

def test_rule_names_the_high_rank_only_and_needs_persistence():
    from numguard.distributed import numerics
    assert [f for f, _ in numerics._flags([1.0, 1.1, 0.9, 1.05], 8.0, 0.0)] == [False] * 4
    flags = numerics._flags([1e-3, 1.0, 1.2e-3, 0.9e-3], 8.0, 0.0)
    assert [f for f, _ in flags] == [False, True, False, False]
    assert flags[1][1] == pytest.approx(1e-3)
    # 2 ranks: only the larger one, and only beyond the factor
    assert [f for f, _ in numerics._flags([1.0, 1000.0], 8.0, 0.0)] == [False, True]
    assert [f for f, _ in numerics._flags([1.0, 7.0], 8.0, 0.0)] == [False, False]
    # unknown values (NaN, 0, None) never flag and are not compared with
    assert [f for f, _ in numerics._flags([float("nan"), 0.0, None, 5.0], 8.0, 0.0)] == [False] * 4
    # step time: the absolute floor
    field, factor, floor = numerics.RULES["step_time"]
    assert [f for f, _ in numerics._flags([0.001, 0.040], factor, floor)] == [False, False]
    assert [f for f, _ in numerics._flags([0.010, 0.100], factor, floor)] == [False, True]
    # noisy others widen the threshold (MAD)
    noisy = [1.0, 30.0, 0.05, 2.0, 40.0]
    assert not numerics._flags(noisy, 8.0, 0.0)[4][0]


def test_tracker_window_and_onset_warning(caplog):
    from numguard.distributed import numerics

    class St:
        name = "test-tracker"
        global_ranks = [0, 1, 2]
        rank = 0
        store = None

    numerics.forget()
    row = lambda act: [0.0, act, 1e-3, 1e-6, 0.0, 0.01]  # noqa: E731
    caplog.set_level(logging.WARNING, logger="numguard.distributed.numerics")
    for i in range(numerics.PERSIST - 1):
        numerics.observe(St, [row(1e-3), row(1e-3), row(5.0)], [i] * 3)
    assert not numerics._trackers["test-tracker"].named
    numerics.observe(St, [row(1e-3), row(1e-3), row(5.0)], [9] * 3)
    (entry,) = numerics._trackers["test-tracker"].named.values()
    assert entry["rank"] == 2 and entry["metric"] == "activations" and entry["host"] == "unknown host"
    warned = [r.getMessage() for r in caplog.records if "outlier" in r.getMessage()]
    assert len(warned) == 1 and "rank 2" in warned[0]
    # healthy checks push it out of the window
    for i in range(numerics.WINDOW):
        numerics.observe(St, [row(1e-3)] * 3, [10 + i] * 3)
    assert not numerics._trackers["test-tracker"].named
    numerics.forget()


# ---------------------------------------------------------------------------------------------
# Jobs

def test_healthy_job_names_no_outlier_and_reads_the_state_once_per_check():
    for r in run("healthy", 2):
        assert r["outliers"] == [] and r["warnings"] == [], r
        table = r["numbers"]
        assert [row["rank"] for row in table] == [0, 1]
        for row in table:
            assert row["nonfinite"] == 0 and 0 < row["activation_headroom"] < 1e-30  # fp32
            assert row["gradient_headroom"] > 0 and 0 < row["gradient_min_nonzero"] < math.inf
            assert row["step_time_s"] > 0
        # numguard's host reads: per check one read of the state (+ the CPU exchange's read of
        # its flag), nothing in the hooks; the same steps without the numbers read exactly as much.
        assert r["syncs_in_hooks"] == 0
        one_check = ["item", "_local_scalar_dense", "tolist"]
        for events in (r["sync_events"], r["sync_events_without_numbers"]):
            checks = len(events) // 3
            assert checks >= STEPS and events == one_check * checks, events


def test_async_checks_carry_the_numbers_too():
    for r in run("async", 2):
        assert r["outliers"] == []
        assert [row["rank"] for row in r["numbers"]] == [0, 1]
        assert all(0 < row["activation_headroom"] < 1e-30 for row in r["numbers"])


def test_rank_fed_scaled_data_is_named_as_activation_outlier():
    results = run("scaled", 2)
    for r in results:
        named = [(o["rank"], o["metric"]) for o in r["outliers"]]
        assert (1, "activations") in named, r
        assert all(rank == 1 for rank, _ in named)
        entry = next(o for o in r["outliers"] if o["metric"] == "activations")
        assert entry["host"] == socket.gethostname()
        assert entry["ratio"] > 100
    assert any("rank 1 on host" in m and "activations" in m for m in results[0]["logged"])
    assert results[1]["logged"] == []  # rank 0 logs for everyone


def test_rank_that_sleeps_is_named_as_straggler():
    results = run("straggler", 4)
    for r in results:
        named = {(o["rank"], o["metric"]) for o in r["outliers"]}
        assert named == {(3, "step_time")}, r["outliers"]
    assert any("rank 3" in m and "step time" in m for m in results[0]["logged"])


def test_outliers_go_into_the_dump():
    results = run("dump", 2)
    r = results[0]  # the rank whose batch held the NaN dumps its report
    assert r["validated"], r
    assert [(o["rank"], o["metric"]) for o in r["report"]["outliers"]] == [(1, "activations")]


# ---------------------------------------------------------------------------------------------
# Rank side

def _model(torch):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def worker(scenario):
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    import numguard
    import numguard.distributed as ngd
    from numguard.testing import SyncCounter
    rank, world = dist.get_rank(), dist.get_world_size()
    logged = kept_messages("numguard.distributed.numerics")
    ddp = torch.nn.parallel.DistributedDataParallel(_model(torch))
    on_trip = "dump" if scenario == "dump" else "raise"
    insp = numguard.watch(ddp, backward=scenario != "async", on_trip=on_trip,
                          check="async" if scenario == "async" else "sync",
                          dump_dir=os.environ["NG_TMP"], report_to=None)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    counter = SyncCounter()
    scale = 1e3 if scenario in ("scaled", "dump") and rank == 1 else 1.0
    out = {"warnings": [], "report": None, "validated": False}
    import warnings

    def train():
        for step in range(STEPS):
            if scenario == "straggler" and rank == 3:
                time.sleep(0.15)  # a slow data loader
            x = torch.randn(16, 8, generator=g) * scale
            if scenario == "dump" and step == STEPS - 1 and rank == 0:
                x[0, 0] = float("nan")
            loss = ddp(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
    with warnings.catch_warnings(record=True) as caught, counter():
        warnings.simplefilter("always")
        train()
    out["warnings"] = [str(w.message) for w in caught if "outlier" in str(w.message)]
    out["outliers"] = ngd.last_outliers()
    out["numbers"] = ngd.last_numbers()
    out["logged"] = logged
    out["sync_events"] = counter.where
    out["syncs_in_hooks"] = counter.in_hooks
    if scenario == "healthy":  # the same steps again without the numbers, for comparison
        from numguard.inspector import checks
        checks.FlagReader._device_numbers = lambda self: None
        plain = SyncCounter()
        with plain():
            train()
        out["sync_events_without_numbers"] = plain.where
    if scenario == "dump" and insp.last_report is not None:
        from numguard import dump
        out["report"] = json.loads(json.dumps(insp.last_report))
        path = [p for p in os.listdir(os.environ["NG_TMP"]) if p.startswith(f"numguard-trip-rank{rank}")]
        if path:
            data = dump.load(os.path.join(os.environ["NG_TMP"], path[0]))
            out["report"] = {"outliers": data.get("outliers")}
            out["validated"] = True
    insp.close(check=False)
    return out


if __name__ == "__main__":
    finish_rank(worker(sys.argv[1]))
