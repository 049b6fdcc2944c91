"""What numguard finds of injected bit flips in a small transformer's training, and what a healthy
run pays for spikes=True, rerun=True: in one process on the CPU (no peer: a fault at every call
reads "reproducible"), and with --ranks on 2 and 4 gloo ranks under DDP, where a data-parallel
peer tells a failing device ("device") from the data ("reproducible").

For each bit class (numguard.testing.faults.BIT_CLASSES) and each mode ("once": a transient fault;
"every call": the fault repeats in the rerun, as a failing device would), N faults are injected
into the output of a Linear layer drawn at random, one every GAP steps after the spike detector
armed, under watch(model, spikes=True, rerun=True, on_trip="warn"). A fault counts as detected
when a NonFiniteWarning or SpikeWarning names its batch within one step; the verdict is correct
when it is "transient" for "once" and "reproducible" for "every call". Then: false alarms of a
healthy 300-step run (warm-up and cosine decay, dropout), and the step time of plain watch() vs
spikes=True, rerun=True, measured in alternating blocks in one process once the spike detector's
window is full (median ratio of wall and of CPU time; --overhead-only: these rows alone).

Multi-rank (--ranks 2,4): each rank trains a DDP copy under watch(spikes=True, rerun=True,
replicas=1, on_trip="warn"); the faults of each row are planned the same on every rank, each on a
rank drawn at random: a bit flip of each class in a Linear's output (once: "transient" wanted; at
every call: "device" naming that rank), a corrupted sample (one input element times 2^24 on one
rank: "reproducible"), a DDP gradient bucket after its all_reduce (faults.inject_bucket) and a
weight (faults.inject_weight, on one rank), both found by the replica check, whose verdict must be
"device" naming that rank (NOTE: [replica verdict]; no verdict is counted as not correct).
The steps a fault is in take no optimizer step on any rank (the next fault starts clean). A fault
counts as detected when any rank's alarm names its batch (or the replica check names its rank);
its verdict is correct when every rank's last verdict for that batch is the wanted one. Steps to
detect / to attribute: from the fault's batch to the first alarm / to every rank's verdict. Then
three healthy runs (warm-up and cosine decay, dropout) per world size, and spikes=True, rerun=True
against plain watch() on the DDP model, interleaved blocks on every rank.

    python benchmarks/bench_faults.py [--faults 100] [--gap 4] [--kinds exponent,sign] [--quick]
    python benchmarks/bench_faults.py --overhead-only [--blocks 7]
    python benchmarks/bench_faults.py --ranks 2,4 [--faults 20] [--healthy-steps 300]

Prints a table and writes benchmarks/results/bench_faults.json (bench_faults_ranks.json with
--ranks).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time
import warnings

import torch
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import numguard  # noqa: E402
from numguard.distributed import CrossRankWarning  # noqa: E402
from numguard.errors import NonFiniteWarning  # noqa: E402
from numguard.inspector.history import WINDOW  # noqa: E402
from numguard.inspector.spikes import ARM  # noqa: E402
from numguard.testing import faults  # noqa: E402

D, HEADS, LAYERS, SEQ, BATCH = 32, 4, 2, 16, 8


class TinyLM(nn.Module):
    def __init__(self, dropout=0.0):
        super().__init__()
        self.embed = nn.Linear(D, D)
        layer = nn.TransformerEncoderLayer(D, HEADS, 4 * D, dropout=dropout, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.head = nn.Linear(D, D)

    def forward(self, x):
        return self.head(self.encoder(self.embed(x)))


def _schedule(step, total, warmup=20, peak=1e-3):
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def _train(steps, plan=None, dropout=0.0, seed=0, **watch):
    """Train `steps` steps; `plan`: step -> (module name, kind, persistent). Returns the warnings
    as (category, batch, verdict) and the injected faults as (step, factor)."""
    torch.manual_seed(seed)
    model = TinyLM(dropout)
    modules = dict(model.named_modules())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    seen, injected = [], []
    fault, until = None, -1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        insp = numguard.watch(model, report_to=None, on_trip="warn", **watch)
        for step in range(steps):
            for g in opt.param_groups:
                g["lr"] = _schedule(step, steps)
            x = torch.randn(BATCH, SEQ, D)
            if plan and step in plan:
                name, kind, persistent = plan[step]
                fault = faults.inject_output(modules[name], kind, persistent=persistent, seed=step)
                # A fault at every call stays for the next step too (a spike is judged one check later).
                until = step + (1 if persistent else 0)
            out = model(x)
            loss = (out - x).pow(2).mean()
            opt.zero_grad()
            if fault is not None and step == until:
                fault.remove()
                injected.append((until - (1 if fault.persistent else 0),
                                 fault.records()[0]["factor"] if fault.fired else None))
                fault = None
            elif fault is None:   # a corrupted step does not update the weights (as GradScaler skips a step)
                loss.backward()
                opt.step()
        insp.close(check=False)
    for w in caught:
        m = w.message
        if isinstance(m, numguard.SpikeWarning):
            seen.append(("spike", m.spike["batch"], getattr(m.attribution, "verdict", None)))
        elif isinstance(m, NonFiniteWarning):
            seen.append(("non-finite", getattr(m.attribution, "batch_number", None),
                         getattr(m.attribution, "verdict", None)))
    return seen, injected


def fault_table(n, gap, kinds):
    rng = random.Random(0)
    targets = [name for name, m in TinyLM().named_modules() if isinstance(m, nn.Linear)]
    rows = []
    for kind in kinds:
        for persistent in (False, True):
            start = ARM + 4
            plan = {start + i * gap: (rng.choice(targets), kind, persistent) for i in range(n)}
            t0 = time.perf_counter()
            seen, injected = _train(start + n * gap + 2, plan, spikes=True, rerun=True)
            by_batch = {}
            for what, batch, verdict in seen:
                by_batch.setdefault(batch, (what, verdict))
            detected = {"spike": 0, "non-finite": 0}
            correct = 0
            want = "reproducible" if persistent else "transient"
            grown_found = 0
            for step, factor in injected:
                hit = by_batch.get(step)
                if hit is None:
                    continue
                detected[hit[0]] += 1
                correct += hit[1] == want
                grown_found += factor is not None and factor >= 2 ** 8
            found = sum(detected.values())
            up = sum(1 for _, f in injected if f is not None and f >= 2 ** 8)
            rows.append({"kind": kind, "mode": "every call" if persistent else "once", "faults": len(injected),
                         "grew >=2^8": up, "grown found": grown_found, "detected": found, "by non-finite": detected["non-finite"],
                         "by spike": detected["spike"], "verdict correct": correct,
                         # the step after a fault at every call still has it: not another alarm
                         "other alarms": len([b for b in by_batch if b not in plan and
                                              not (persistent and b - 1 in plan)]),
                         "seconds": round(time.perf_counter() - t0, 1)})
            print(_row(rows[-1]), flush=True)
    return rows


def _row(r):
    pct = lambda a, b: f"{100.0 * a / b:5.1f}%" if b else "   -  "
    return (f"{r['kind']:>14} {r['mode']:>10} {r['faults']:6d} {r['grew >=2^8']:6d} "
            f"{pct(r['grown found'], r['grew >=2^8'])} {pct(r['detected'], r['faults'])} "
            f"{r['by non-finite']:6d} {r['by spike']:6d} {pct(r['verdict correct'], r['detected'])} "
            f"{r['other alarms']:6d}")


def healthy_alarms(steps=300):
    out = []
    for seed, dropout in ((0, 0.0), (1, 0.1), (2, 0.1)):
        seen, _ = _train(steps, dropout=dropout, seed=seed, spikes=True, rerun=True)
        out.append({"seed": seed, "dropout": dropout, "steps": steps, "alarms": len(seen)})
    return out


def _timed_block(step, xs, warm):
    """(wall, process CPU) seconds per step of `step` over `xs`, after `warm` untimed steps."""
    for x in warm:
        step(x)
    t0, c0 = time.perf_counter(), time.process_time()
    for x in xs:
        step(x)
    return (time.perf_counter() - t0) / len(xs), (time.process_time() - c0) / len(xs)


def _ratios(times, base, armed):
    """Per block ratios armed/base of wall and CPU time, their medians and spread."""
    out = {}
    for clock, i in (("wall", 0), ("cpu", 1)):
        ratios = [b[i] / a[i] for a, b in zip(times[base], times[armed])]
        out[clock] = {"step_ms_base": 1e3 * statistics.median(t[i] for t in times[base]),
                      "step_ms_armed": 1e3 * statistics.median(t[i] for t in times[armed]),
                      "ratio_median": statistics.median(ratios), "ratios": ratios}
    return out


def overhead(blocks=7, steps=40):
    """The healthy step with spikes=True, rerun=True against plain watch(), interleaved blocks in
    one run; also both with backward=True (gradients and the parameter-gradient norms watched).
    Each block starts watching and trains untimed until the spike detector's window is full (as
    in a long run: armed, its baseline recomputed every spikes.REFRESH batches), then times
    `steps` steps by the wall clock and by the process's CPU time (steadier on a shared machine)."""
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    xs = [torch.randn(BATCH, SEQ, D) for _ in range(WINDOW + 8 + steps)]
    warm, timed = xs[:WINDOW + 8], xs[WINDOW + 8:]
    armed = {"spikes": True, "rerun": True}
    options = {"watch()": {}, "spikes+rerun": armed,
               "watch(backward)": {"backward": True}, "backward+spikes+rerun": dict(armed, backward=True)}

    def step(x):
        loss = (model(x) - x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()

    times = {name: [] for name in options}
    for _ in range(blocks):
        for name, opts in options.items():
            insp = numguard.watch(model, report_to=None, **opts)
            times[name].append(_timed_block(step, timed, warm))
            insp.close(check=False)
    return {"plain": _ratios(times, "watch()", "spikes+rerun"),
            "backward": _ratios(times, "watch(backward)", "backward+spikes+rerun")}


def print_overhead(cost):
    for key, label in (("plain", ""), ("backward", ", both with backward=True")):
        for clock in ("wall", "cpu"):
            c = cost[key][clock]
            print(f"step {clock} time{label}: watch() {c['step_ms_base']:.2f} ms, spikes+rerun {c['step_ms_armed']:.2f} "
                  f"ms, ratio median {c['ratio_median']:.3f} (blocks {min(c['ratios']):.3f}-{max(c['ratios']):.3f}) "
                  f"over {len(c['ratios'])} interleaved blocks")


# ---------------------------------------------------------------------------------------------
# Multi-rank: the same faults on 2 and 4 gloo ranks (DDP), with the peer's verdict

MULTI_ROWS = [(site, kind, persistent) for site in ("output",) for kind in faults.BIT_CLASSES
              for persistent in (False, True)] + [("data", "exponent", False)] + [
    (site, kind, persistent) for site in ("bucket",) for kind in ("exponent", "low_mantissa")
    for persistent in (False, True)] + [("weight", kind, False) for kind in ("exponent", "low_mantissa")]
# The verdict a fault should get: a one-time fault "transient", a fault at every call "device" (the
# faulty rank), a corrupted sample "reproducible". A gradient bucket corrupted after the all_reduce
# and a flipped weight are found by the replica check, whose verdict must be "device" naming the
# faulty rank (no verdict counts as not correct).
def _wanted(site, persistent):
    if site == "data":
        return "reproducible"
    if site in ("bucket", "weight"):
        return "device"
    return "device" if persistent else "transient"


def _span(site, persistent):
    """Steps a planned fault stays in (a weight stays for its spike's rerun one check later)."""
    return 2 if persistent or site == "weight" else 1


def _rank_events(caught, step, events, sentinel_findings):
    """Append (step seen, what, batch, verdict, verdict's rank) for each numguard alarm."""
    for w in caught:
        m = w.message
        a = getattr(m, "attribution", None)
        if isinstance(m, numguard.SpikeWarning):
            events.append((step, "spike", m.spike["batch"], getattr(a, "verdict", None), getattr(a, "rank", None)))
        elif isinstance(m, NonFiniteWarning):
            events.append((step, "non-finite", a.batch_number if a is not None else step,
                           getattr(a, "verdict", None), getattr(a, "rank", None)))
        elif isinstance(m, CrossRankWarning) and getattr(m, "finding", None) is not None:   # a replica check's
            verdict = m.finding.get("verdict") or {}
            events.append((step, "replica check", m.finding.get("batch_number"), verdict.get("verdict"),
                           verdict.get("rank")))
    caught.clear()


def _multi_plan(n, n_other, gap, world, start, rng):
    """step -> (site, kind, persistent, rank, module, seed): `n` faults in each row of exponent
    flips in outputs (the target's) and of corrupted samples, `n_other` in the other rows."""
    plan = {}
    targets = [name for name, m in TinyLM().named_modules() if isinstance(m, nn.Linear)]
    step = start
    for site, kind, persistent in MULTI_ROWS:
        for _ in range(n if (site, kind) in (("output", "exponent"), ("data", "exponent")) else n_other):
            plan[step] = (site, kind, persistent, rng.randrange(world), rng.choice(targets), rng.randrange(1 << 30))
            step += gap
    return plan, step + gap


def multi_rank_worker(n, n_other, gap, healthy_steps, blocks):
    """One rank of the multi-rank bench (torch.distributed is initialized): its alarms and its
    step times, gathered on every rank."""
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    plan, total = _multi_plan(n, n_other, gap, world, ARM + 8, random.Random(world))
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(TinyLM())
    model = ddp.module
    modules = dict(model.named_modules())
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    bucket = faults.inject_bucket(ddp, "exponent", at_call=0, rank=-1)   # armed per planned fault below
    gen = torch.Generator().manual_seed(1000 + rank)
    events, active, no_step, no_backward, factors, over_amax = [], {}, set(), set(), {}, {}
    for s, (site, kind, persistent, f, name, seed) in plan.items():
        (no_step if site == "bucket" else no_backward).update(range(s, s + _span(site, persistent)))
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        insp = numguard.watch(ddp, report_to=None, on_trip="warn", spikes=True, rerun=True, replicas=1)
        sentinel = insp._handles[-1]
        for step in range(total):
            for g in opt.param_groups:
                g["lr"] = _schedule(step, total)
            x = torch.randn(BATCH, SEQ, D, generator=gen)
            fault = plan.get(step)
            if fault is not None:
                site, kind, persistent, f, name, seed = fault
                if site == "output":
                    active[step] = faults.inject_output(modules[name], kind, persistent=persistent, rank=f, seed=seed)
                elif site == "data" and rank == f:
                    x[0, 0, 0] *= 2.0 ** 24    # a corrupted sample: every device computes the same spike
                elif site == "bucket":
                    bucket.rank, bucket.persistent, bucket.kind = f, persistent, kind
                    bucket.at_call, bucket.calls, bucket.log = 0, 0, []
                    bucket.rng = random.Random(seed)
                    active[step] = bucket
                elif site == "weight":
                    active[step] = faults.inject_weight(modules[name], "weight", kind, rank=f, seed=seed)
            out = ddp(x)
            if step not in no_backward:
                (out - x).pow(2).mean().backward()
                if step not in no_step:
                    opt.step()
                else:   # the gradients are compared as before a step, and the corrupted step is not taken
                    sentinel.check("gradients", [p.grad for p in sentinel.params], f"batch {step}")
            opt.zero_grad()
            for s in [s for s in active if step >= s + _span(*plan[s][0:3:2]) - 1]:
                fired = active.pop(s)
                if plan[s][3] == rank and plan[s][0] != "bucket" and fired.log:   # how much the flip scaled
                    first = fired.records()[0]
                    factors[s], over_amax[s] = first["factor"], first["over_amax"]
                elif plan[s][3] == rank and fired.log:
                    factors[s] = fired.records()[-1]["factor"]
                if plan[s][0] == "bucket":
                    bucket.rank = -1
                else:
                    fired.remove()
            _rank_events(caught, step, events, None)
            sentinel._known.clear()   # every finding is recorded, also a repeat of one reported before
        insp.close(check=False)
    seconds = time.perf_counter() - t0
    findings = [(fd["batch_number"], fd["kind"], [[] if m["tie"] else m["minority_ranks"] for m in fd["parameters"]])
                for fd in sentinel.findings]
    healthy = []
    for seed, dropout in ((0, 0.0), (1, 0.1), (2, 0.1)):
        healthy.append(_multi_healthy(healthy_steps, seed, dropout, rank))
    cost = _multi_overhead(blocks, rank)
    everything = [None] * world
    dist.all_gather_object(everything, {"rank": rank, "events": events, "findings": findings, "seconds": seconds,
                                        "healthy": healthy, "overhead": cost, "factors": factors,
                                        "over_amax": over_amax})
    return {"world": world, "plan": {str(k): v for k, v in plan.items()}, "ranks": everything}


def _multi_healthy(steps, seed, dropout, rank):
    torch.manual_seed(seed)
    ddp = nn.parallel.DistributedDataParallel(TinyLM(dropout))
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(10 * seed + rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        insp = numguard.watch(ddp, report_to=None, on_trip="warn", spikes=True, rerun=True)
        for step in range(steps):
            for g in opt.param_groups:
                g["lr"] = _schedule(step, steps)
            x = torch.randn(BATCH, SEQ, D, generator=gen)
            (ddp(x) - x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        insp.close()
    return {"seed": seed, "dropout": dropout, "steps": steps,
            "alarms": sum(1 for w in caught if "numguard" in str(w.message))}


def _multi_overhead(blocks, rank, steps=40):
    """spikes=True, rerun=True against plain watch() on a DDP model, interleaved blocks, each
    timed after the spike detector's window is full (as overhead())."""
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(TinyLM())
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(rank)
    xs = [torch.randn(BATCH, SEQ, D, generator=gen) for _ in range(WINDOW + 8 + steps)]

    def step(x):
        (ddp(x) - x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    times = {"watch()": [], "spikes+rerun": []}
    for _ in range(blocks):
        for name, opts in (("watch()", {}), ("spikes+rerun", {"spikes": True, "rerun": True})):
            insp = numguard.watch(ddp, report_to=None, **opts)
            times[name].append(_timed_block(step, xs[WINDOW + 8:], xs[:WINDOW + 8]))
            insp.close(check=False)
    return _ratios(times, "watch()", "spikes+rerun")


def multi_rank_table(result):
    """The rows of one world size from every rank's alarms (see the module docstring)."""
    world = result["world"]
    plan = {int(k): v for k, v in result["plan"].items()}
    per_rank = result["ranks"]
    rows = []
    for site, kind, persistent in MULTI_ROWS:
        steps = sorted(s for s, v in plan.items() if tuple(v[:3]) == (site, kind, persistent))
        row = {"world": world, "site": site, "kind": kind, "mode": "every call" if persistent else "once",
               "faults": len(steps), "detected": 0, "non-finite": 0, "spike": 0, "replica check": 0,
               "verdicts": 0, "correct": 0, "detect_steps": [], "attribute_steps": [], "rank named": 0,
               "grew >=2^8": 0, "grown found": 0, "grown found within 1 step": 0, "grown missed": []}
        want = _wanted(site, persistent)
        for s in steps:
            f = plan[s][3]
            seen = [(step, what) for r in per_rank for step, what, batch, _, _ in r["events"] if batch == s]
            factor = per_rank[f]["factors"].get(str(s), per_rank[f]["factors"].get(s))
            grew = site == "output" and factor is not None and factor >= 2 ** 8
            row["grew >=2^8"] += grew
            row["grown found"] += grew and bool(seen)
            row["grown found within 1 step"] += grew and bool(seen) and min(seen)[0] - s <= 1
            if grew and not (seen and min(seen)[0] - s <= 1):
                over = per_rank[f].get("over_amax", {})
                row["grown missed"].append({"batch": s, "rank": f, "module": plan[s][4], "factor": factor,
                                            "over_amax": over.get(str(s), over.get(s))})
            # a finding that names the rank, or a tie (2 ranks: which side is wrong cannot be told)
            replica = [b for r in per_rank for b, _, minority in r["findings"]
                       if b in (s, s + 1) and any(f in m or not m for m in minority)]
            if not seen and not replica:
                continue
            row["rank named"] += any(b in (s, s + 1) and any(f in m for m in minority)
                                     for b, _, minority in per_rank[0]["findings"])
            row["detected"] += 1
            first = min(seen)[1] if seen else "replica check"
            row[first] += 1
            row["detect_steps"].append(min(seen)[0] - s if seen else min(replica) - s)
            finals = []
            for r in per_rank:
                mine = [(step, v, vr) for step, what, batch, v, vr in r["events"] if batch == s and v is not None]
                finals.append(mine[-1] if mine else None)
            if want is not None and all(x is not None for x in finals):
                row["verdicts"] += 1
                row["attribute_steps"].append(max(x[0] for x in finals) - s)
                right = all(x[1] == want and (want != "device" or x[2] == f) for x in finals)
                row["correct"] += right
        rows.append(row)
    return rows


def _multi_row_text(r):
    pct = lambda a, b: f"{100.0 * a / b:5.1f}%" if b else "   -  "   # noqa: E731
    worst = lambda xs: str(max(xs)) if xs else "-"   # noqa: E731
    verdict = pct(r["correct"], r["detected"]) if _wanted(r["site"], r["mode"] != "once") else "   n/a"
    grown = pct(r["grown found within 1 step"], r["grew >=2^8"]) if r["site"] == "output" else "   n/a"
    return (f"{r['world']:>5} {r['site']:>7} {r['kind']:>14} {r['mode']:>10} {r['faults']:6d} "
            f"{r['grew >=2^8']:5d} {grown} "
            f"{pct(r['detected'], r['faults'])} {r['non-finite']:6d} {r['spike']:6d} {r['replica check']:7d} "
            f"{pct(r['verdicts'], r['detected'])} {verdict} {worst(r['detect_steps']):>6} "
            f"{worst(r['attribute_steps']):>6} {r['rank named']:6d}")


def launch_multi_rank(world, n, n_other, gap, healthy_steps, blocks, timeout):
    """Run this file's multi-rank worker on `world` gloo ranks (one process each); rank 0's JSON."""
    import socket
    import subprocess
    import tempfile
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        procs = []
        for r in range(world):
            env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port), OMP_NUM_THREADS="1", NUMGUARD_DIST_TIMEOUT="120")
            log = open(os.path.join(tmp, f"log{r}.txt"), "w")
            procs.append((subprocess.Popen([sys.executable, os.path.abspath(__file__), "--rank-worker", out,
                                            "--faults", str(n), "--faults-other", str(n_other),
                                            "--gap", str(gap), "--healthy-steps",
                                            str(healthy_steps), "--blocks", str(blocks)],
                                           env=env, stdout=log, stderr=subprocess.STDOUT), log))
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p, _ in procs) and time.monotonic() < deadline:
            time.sleep(0.5)
        for p, log in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
            log.close()
        if not os.path.exists(out):
            logs = "\n".join(open(os.path.join(tmp, f"log{r}.txt")).read()[-3000:] for r in range(world))
            raise RuntimeError(f"the {world}-rank bench left no result:\n{logs}")
        with open(out) as f:
            return json.load(f)


def main_ranks(args):
    """--ranks: launch each world size, print its table."""
    header = (f"{'ranks':>5} {'site':>7} {'bit class':>14} {'mode':>10} {'faults':>6} {'>=2^8':>5} {'in 1':>6} "
              f"{'found':>6} {'nonfin':>6} "
              f"{'spike':>6} {'replica':>7} {'verd.':>6} {'right':>6} {'detect':>6} {'attrib':>6} {'named':>6}")
    results = {}
    for world in [int(w) for w in args.ranks.split(",") if w]:
        t0 = time.perf_counter()
        result = launch_multi_rank(world, args.faults, args.faults_other or args.faults, args.gap,
                                   args.healthy_steps, args.blocks, args.timeout)
        rows = multi_rank_table(result)
        print(header)
        for row in rows:
            print(_multi_row_text(row), flush=True)
        for row in rows:   # an abs-max baseline sees a grown value only where it stands out of its tensor
            for m in row["grown missed"]:
                print(f"{world} ranks, {row['kind']} {row['mode']}: grown x{m['factor']:.3g} at batch {m['batch']} in "
                      f"{m['module']} on rank {m['rank']} not found within 1 step; the flipped value is "
                      f"{m['over_amax']:.3g}x its tensor's abs max before the flip")
        for h in result["ranks"][0]["healthy"]:
            alarms = sum(r["healthy"][result["ranks"][0]["healthy"].index(h)]["alarms"] for r in result["ranks"])
            print(f"{world} ranks, healthy run seed={h['seed']} dropout={h['dropout']}: {alarms} alarms on all "
                  f"ranks in {h['steps']} steps")
        ratios = {clock: [r["overhead"][clock]["ratio_median"] for r in result["ranks"]] for clock in ("wall", "cpu")}
        print(f"{world} ranks, step time spikes+rerun / watch() (median of {args.blocks} interleaved blocks per "
              f"rank): wall {', '.join(f'{x:.3f}' for x in ratios['wall'])}, CPU "
              f"{', '.join(f'{x:.3f}' for x in ratios['cpu'])}; {time.perf_counter() - t0:.0f} s in all")
        results[world] = {"rows": rows, "ranks": result["ranks"], "overhead_ratio_by_rank": ratios}
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "bench_faults_ranks.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"faults_per_row": args.faults, "gap": args.gap, "worlds": results, "torch": torch.__version__},
                  f, indent=1)
    print(f"wrote {path}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--faults", type=int, default=100)
    ap.add_argument("--gap", type=int, default=4)
    ap.add_argument("--kinds", default=",".join(faults.BIT_CLASSES))
    ap.add_argument("--quick", action="store_true", help="10 faults per kind, 60 healthy steps")
    ap.add_argument("--ranks", default="", help="world sizes to run on gloo ranks, e.g. 2,4")
    ap.add_argument("--faults-other", type=int, default=0,
                    help="--ranks: faults per row other than exponent flips in outputs and corrupted samples "
                         "(default: --faults)")
    ap.add_argument("--healthy-steps", type=int, default=300)
    ap.add_argument("--blocks", type=int, default=7, help="interleaved blocks of the overhead rows")
    ap.add_argument("--overhead-only", action="store_true", help="only the overhead rows (one process)")
    ap.add_argument("--timeout", type=float, default=7200.0, help="seconds per world size")
    ap.add_argument("--rank-worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.rank_worker:
        import torch.distributed as dist
        dist.init_process_group("gloo")
        result = multi_rank_worker(args.faults, args.faults_other or args.faults, args.gap, args.healthy_steps,
                                   args.blocks)
        if dist.get_rank() == 0:
            with open(args.rank_worker, "w") as f:
                json.dump(result, f)
        dist.barrier()
        dist.destroy_process_group()
        return
    if args.ranks:
        main_ranks(args)
        return
    if args.overhead_only:
        print_overhead(overhead(args.blocks))
        return
    n = 10 if args.quick else args.faults
    print(f"{'bit class':>14} {'mode':>10} {'faults':>6} {'>=2^8':>6} {'of them':>6} {'found':>6} {'nonfin':>6} "
          f"{'spike':>6} "
          f"{'verdict':>6} {'other':>6}")
    rows = fault_table(n, args.gap, [k for k in args.kinds.split(",") if k])
    healthy = healthy_alarms(60 if args.quick else 300)
    for h in healthy:
        print(f"healthy run seed={h['seed']} dropout={h['dropout']}: {h['alarms']} alarms in {h['steps']} steps")
    cost = overhead(3 if args.quick else args.blocks)
    print_overhead(cost)
    os.makedirs(os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"), exist_ok=True)
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "bench_faults.json")
    with open(path, "w") as f:
        json.dump({"faults": rows, "healthy": healthy, "overhead": cost, "torch": torch.__version__}, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
