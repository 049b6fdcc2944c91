"""The cross-rank rerun verdict (watch(rerun=True) in a multi-rank job; numguard.distributed.
peer_rerun, numguard.inspector.peer_verdict) on real 2-rank gloo DDP jobs, one subprocess per
rank under a hard timeout: a fault that repeats on one rank's device is "device" naming that rank
on every rank, a one-time fault is "transient" and recovered on every rank together, a data fault
is "reproducible", a peer that dies is named, and a healthy run says nothing. This file is also
the rank worker: ``python tests/test_peer_rerun.py <scenario>``."""
from __future__ import annotations

import json
import os
import sys
import tempfile
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from dist_workers import RankProcesses, finish_rank, job_environs, run_worker_file  # noqa: E402

TIMEOUT_S = 240


def run(scenario: str, world: int = 2) -> list:
    return run_worker_file(__file__, scenario, world, TIMEOUT_S)


# ---------------------------------------------------------------------------------------------
# Tests (parent side)

def test_persistent_fault_on_rank_1_is_judged_device_on_both_ranks():
    for rank, r in enumerate(run("device")):
        assert r["error"] == "NonFiniteError" and r["batch"] == 3, r
        a = r["attribution"]
        assert a["verdict"] == "device" and a["rank"] == 1 and a["batch_number"] == 3, a
        assert a["device"] == "cpu" and a["host"], a
        assert "data-parallel peer rank 0" in a["detail"] and "suspect the device of rank 1" in a["detail"], a
        assert r["report_rerun"] is None or r["report_rerun"]["peer"] == 0
        assert r["attributions"] == [a]


def test_transient_fault_is_recovered_on_every_rank_and_training_matches_a_clean_run():
    for rank, r in enumerate(run("transient")):
        assert r["error"] is None, r
        (w,) = r["warned"]
        a = w["attribution"]
        assert a["verdict"] == "transient" and a["rank"] == 1 and a["batch_number"] == 3, a
        assert "recovered" in a["detail"] and "every rank goes on" in a["detail"], a
        assert r["steps_done"] == 6
        assert r["weights_equal_clean_run"], "a recovered run must train as a clean one"


def test_data_fault_is_reproducible_on_both_ranks():
    for r in run("data"):
        assert r["error"] == "NonFiniteError" and r["batch"] == 2, r
        a = r["attribution"]
        assert a["verdict"] == "reproducible" and a["rank"] == 1, a
        assert "so did its data-parallel peer rank 0" in a["detail"], a


def test_a_model_without_ddp_finds_its_peer_by_its_parameters_and_its_rerun_runs_no_replica_check():
    for r in run("plain"):
        assert r["error"] == "NonFiniteError" and r["batch"] == 2, r
        a = r["attribution"]
        assert a["verdict"] == "reproducible" and a["rank"] == 1 and "peer rank 0" in a["detail"], a
        assert r["replica_forwards"] == 3   # the rerun on rank 1 and the peer's ran no replica check


def test_spike_on_one_device_gets_a_device_verdict_on_every_rank():
    results = run("spike")
    for rank, r in enumerate(results):
        assert r["error"] is None, r
        verdicts = [w for w in r["spikes"] if w["attribution"] is not None]
        assert verdicts, r
        a = verdicts[0]["attribution"]
        assert a["verdict"] == "device" and a["rank"] == 1 and a["batch_number"] == r["fault_batch"], a
        assert verdicts[0]["spike"]["module"] == "module.act" and verdicts[0]["spike"]["rank"] == 1
        assert verdicts[0]["at_batch"] <= r["fault_batch"] + 2   # attributed within 2 steps
    # the spiked rank warned at once (its own device reproduced it; the peer's answer came later)
    assert any(w["attribution"] is None and "a data-parallel peer reruns" in w["message"]
               for w in results[1]["spikes"])


def test_healthy_ddp_run_with_spikes_and_rerun_is_silent():
    for r in run("healthy"):
        assert r["error"] is None and r["warnings"] == [] and r["steps_done"] == 40, r
        assert r["attributions"] == [] and r["spikes"] == []


def test_replica_check_catches_low_mantissa_flips_in_a_bucket_and_a_weight_on_one_rank():
    for r in run("replicas"):
        # the gradients of step 3 after the all_reduce: one low mantissa bit on rank 1
        bucket = r["bucket"]
        assert r["bucket_fired"] == [0, 1][r["rank"]] and bucket["kind"] == "gradients", r
        assert bucket["when"] == "optimizer step #3", bucket
        (m,) = bucket["parameters"]
        assert m["minority_ranks"] == [1] and m["differing_elements"] == 1, m
        assert 0 < m["max_ulps"] < 2 ** 12, m   # a low mantissa bit: below 2**-11 of the value
        # a weight on rank 1, between steps 2 and 3: found before forward #3 used it
        weight = r["weight"]
        assert weight["kind"] == "parameters" and weight["when"] == "forward #3", weight
        (m,) = weight["parameters"]
        assert m["minority_ranks"] == [1] and m["differing_elements"] == 1 and m["max_ulps"] < 2 ** 12, m
        assert r["other_alarms"] == 0, r   # neither is non-finite or a spike


def test_a_peer_that_dies_is_named_within_the_timeout():
    with tempfile.TemporaryDirectory() as tmp:
        environs = job_environs(2, env={"NG_TMP": tmp, "NUMGUARD_DIST_TIMEOUT": "8"},
                                rank_env={r: {"NG_OUT": os.path.join(tmp, f"r{r}.json")} for r in range(2)})
        job = RankProcesses([sys.executable, os.path.abspath(__file__), "dead_peer"], environs)
        codes = job.wait(TIMEOUT_S)
        assert not job.timed_out, codes
        assert codes[1][0] == 7, codes[1]   # the peer left in its rerun
        with open(os.path.join(tmp, "r0.json")) as f:
            r = json.load(f)
    assert r["error"] == "NonFiniteError", r
    a = r["attribution"]
    assert a["verdict"] == "reproducible" and a["rank"] == 0, a
    assert "the peer, rank 1, never answered" in a["detail"], a
    assert r["seconds"] < 8 + 30, r


# ---------------------------------------------------------------------------------------------
# Rank side

def _setup():
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    return torch, dist


def _ddp(torch, seed=0, low=1.0, high=1.5, tripwire=False):
    """Linear -> Hardtanh(low, high) -> Linear under DDP: the middle output lies in [low, high],
    so a flip of a chosen exponent bit there is exactly an Inf or a known growth."""
    torch.manual_seed(seed)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inp, self.act, self.out = torch.nn.Linear(4, 8), torch.nn.Hardtanh(low, high), torch.nn.Linear(8, 2)

        def forward(self, x):
            if tripwire and not torch.is_grad_enabled():
                os._exit(7)   # a peer that dies in its rerun
            return self.out(self.act(self.inp(x)))
    return torch.nn.parallel.DistributedDataParallel(Net())


def _attr(a):
    return None if a is None else a.to_dict()


def _train(torch, ddp, steps, rank, out, plant=None, data_fault=None, lr=0.05, after=None):
    import numguard
    opt = torch.optim.SGD(ddp.parameters(), lr=lr)
    g = torch.Generator().manual_seed(100 + rank)
    out.setdefault("steps_done", 0)
    for step in range(steps):
        if plant is not None:
            plant(step)
        x = torch.randn(4, 4, generator=g)
        if data_fault is not None and data_fault == (rank, step):
            x[0, 0] = float("nan")
        try:
            loss = ddp(x).pow(2).mean()
        except numguard.NonFiniteError as exc:
            out.update(error="NonFiniteError", batch=exc.batch_number, attribution=_attr(exc.attribution),
                       message=str(exc))
            return
        loss.backward()
        opt.step()
        opt.zero_grad()
        out["steps_done"] += 1
        if after is not None:
            after(step)


def _non_finite_case(torch, rank, out, kind):
    import numguard
    from numguard.errors import NonFiniteWarning
    from numguard.testing import faults
    ddp = _ddp(torch)
    insp = numguard.watch(ddp, rerun=True, report_to=None)
    fault = None
    if kind in ("device", "transient"):   # bit 30 of a value in [1, 1.5] makes it Inf or NaN
        fault = faults.inject_output(ddp.module.act, bit=30, persistent=kind == "device", at_call=3, rank=1)
    out["error"] = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(torch, ddp, 6, rank, out, data_fault=(1, 2) if kind == "data" else None)
    out["warned"] = [{"message": str(w.message), "attribution": _attr(getattr(w.message, "attribution", None))}
                     for w in caught if isinstance(w.message, NonFiniteWarning)]
    out["report_rerun"] = (insp.last_report or {}).get("rerun")
    out["attributions"] = [_attr(a) for a in insp.attributions()]
    if fault is not None:
        fault.remove()
    insp.close(check=False)
    return ddp


def worker(scenario):
    torch, dist = _setup()
    rank = dist.get_rank()
    import numguard
    out = {"rank": rank, "error": None}
    if scenario in ("device", "data"):
        _non_finite_case(torch, rank, out, scenario)
    elif scenario == "transient":
        ddp = _non_finite_case(torch, rank, out, "transient")
        clean = _ddp(torch)
        _train(torch, clean, 6, rank, {})
        out["weights_equal_clean_run"] = all(torch.equal(a, b) for a, b in
                                             zip(ddp.parameters(), clean.parameters()))
    elif scenario == "healthy":
        ddp = _ddp(torch, low=-1.0, high=1.0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            insp = numguard.watch(ddp, spikes=True, rerun=True, backward=True, report_to=None)
            _train(torch, ddp, 40, rank, out)
            insp.close()
        out["warnings"] = [str(w.message) for w in caught if "numguard" in str(w.message)]
        out["attributions"] = [_attr(a) for a in insp.attributions()]
        out["spikes"] = insp.spikes()
    elif scenario == "spike":
        from numguard.inspector.spikes import ARM
        from numguard.testing import faults
        ddp = _ddp(torch, low=2.0, high=3.0)   # exponent 128: flipping its bit 4 multiplies by 2**16
        insp = numguard.watch(ddp, spikes=True, rerun=True, report_to=None)
        out["fault_batch"] = at = ARM + 6
        # A failing unit: from batch `at` on, the same element and bit at every call on rank 1 (lr=0:
        # the weights stay, so nothing else moves).
        faults.inject_output(ddp.module.act, bit=27, persistent=True, at_call=at, rank=1)
        out["spikes"] = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")

            def after(step):
                out["spikes"].extend({"message": str(w.message), "spike": w.message.spike,
                                      "attribution": _attr(w.message.attribution), "at_batch": step}
                                     for w in caught if isinstance(w.message, numguard.SpikeWarning))
                caught.clear()
            _train(torch, ddp, at + 4, rank, out, lr=0.0, after=after)
        insp.close(check=False)
    elif scenario == "plain":   # no DDP: same weights by seed, no training (lr=0)
        ddp = _ddp(torch)
        model = ddp.module
        insp = numguard.watch(model, rerun=True, replicas=1, report_to=None)
        g = torch.Generator().manual_seed(100 + rank)
        for step in range(4):   # forwards only: the replicas stay equal
            x = torch.randn(4, 4, generator=g)
            if rank == 1 and step == 2:
                x[0, 0] = float("nan")
            try:
                model(x)
            except numguard.NonFiniteError as exc:
                out.update(error="NonFiniteError", batch=exc.batch_number, attribution=_attr(exc.attribution))
                break
        out["replica_forwards"] = insp._handles[-1].forwards
        insp.close(check=False)
    elif scenario == "replicas":
        from numguard.errors import NonFiniteWarning
        from numguard.testing import faults
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ddp = _ddp(torch, low=-1.0, high=1.0)
            fault = faults.inject_bucket(ddp, "low_mantissa", at_call=3, rank=1)   # one bucket per step here
            insp = numguard.watch(ddp, replicas=1, on_trip="warn", spikes=True, report_to=None)
            _train(torch, ddp, 5, rank, out)
            out["bucket"] = insp._handles[-1].findings[0] if insp._handles[-1].findings else None
            out["bucket_fired"] = fault.fired
            insp.close(check=False)
            ddp = _ddp(torch, low=-1.0, high=1.0)
            insp = numguard.watch(ddp, replicas=1, on_trip="warn", spikes=True, report_to=None)

            def flip_weight(step):
                if step == 3:
                    faults.inject_weight(ddp.module.out, "weight", "low_mantissa", rank=1)
            _train(torch, ddp, 5, rank, out, plant=flip_weight)
            out["weight"] = insp._handles[-1].findings[0] if insp._handles[-1].findings else None
            insp.close(check=False)
        out["other_alarms"] = sum(isinstance(w.message, (NonFiniteWarning, numguard.SpikeWarning)) for w in caught)
    elif scenario == "dead_peer":
        import time
        from numguard.testing import faults
        ddp = _ddp(torch, tripwire=rank == 1)
        insp = numguard.watch(ddp, rerun=True, report_to=None)
        faults.inject_output(ddp.module.act, bit=30, persistent=True, at_call=2, rank=0)
        t0 = time.monotonic()
        _train(torch, ddp, 4, rank, out)
        out["seconds"] = time.monotonic() - t0
        with open(os.environ["NG_OUT"], "w") as f:
            json.dump(out, f)
        sys.stdout.flush()
        os._exit(0)   # the peer is gone: no barrier, no teardown
    return out


if __name__ == "__main__":
    finish_rank(worker(sys.argv[1]))
