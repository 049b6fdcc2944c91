"""What numguard finds of injected bit flips in a small transformer's training, and what a healthy
run pays for spikes=True, rerun=True. One process on the CPU (the "device" verdict, which needs a
data-parallel peer, is not built: a fault at every call reads "reproducible").

For each bit class (numguard.testing.faults.BIT_CLASSES) and each mode ("once": a transient fault;
"every call": the fault repeats in the rerun, as a failing device would), N faults are injected
into the output of a Linear layer drawn at random, one every GAP steps after the spike detector
armed, under watch(model, spikes=True, rerun=True, on_trip="warn"). A fault counts as detected
when a NonFiniteWarning or SpikeWarning names its batch within one step; the verdict is correct
when it is "transient" for "once" and "reproducible" for "every call". Then: false alarms of a
healthy 300-step run (warm-up and cosine decay, dropout), and the step time of plain watch() vs
spikes=True, rerun=True, measured in alternating blocks in one process (median ratio).

    python benchmarks/bench_faults.py [--faults 100] [--gap 4] [--kinds exponent,sign] [--quick]

Prints a table and writes benchmarks/results/bench_faults.json.
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
from numguard.errors import NonFiniteWarning  # noqa: E402
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


def overhead(blocks=7, steps=20):
    """The healthy step with spikes=True, rerun=True against plain watch(), interleaved in one run;
    also both with backward=True (gradients and the parameter-gradient norms watched)."""
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    xs = [torch.randn(BATCH, SEQ, D) for _ in range(steps)]
    armed = {"spikes": True, "rerun": True}
    options = {"watch()": {}, "spikes+rerun": armed,
               "watch(backward)": {"backward": True}, "backward+spikes+rerun": dict(armed, backward=True)}
    times = {name: [] for name in options}
    for _ in range(blocks):
        for name, opts in options.items():
            insp = numguard.watch(model, report_to=None, **opts)
            for x in xs[:3]:   # warm the hooks
                model(x)
            t0 = time.perf_counter()
            for x in xs:
                loss = (model(x) - x).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
            times[name].append((time.perf_counter() - t0) / steps)
            insp.close(check=False)
    out = {}
    for base, armed_name, key in (("watch()", "spikes+rerun", ""), ("watch(backward)", "backward+spikes+rerun",
                                                                    "_backward")):
        ratios = [b / a for a, b in zip(times[base], times[armed_name])]
        out.update({f"step_ms_watch{key}": 1e3 * statistics.median(times[base]),
                    f"step_ms_spikes_rerun{key}": 1e3 * statistics.median(times[armed_name]),
                    f"ratio_median{key}": statistics.median(ratios), f"ratios{key}": ratios})
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--faults", type=int, default=100)
    ap.add_argument("--gap", type=int, default=4)
    ap.add_argument("--kinds", default=",".join(faults.BIT_CLASSES))
    ap.add_argument("--quick", action="store_true", help="10 faults per kind, 60 healthy steps")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    n = 10 if args.quick else args.faults
    print(f"{'bit class':>14} {'mode':>10} {'faults':>6} {'>=2^8':>6} {'of them':>6} {'found':>6} {'nonfin':>6} "
          f"{'spike':>6} "
          f"{'verdict':>6} {'other':>6}")
    rows = fault_table(n, args.gap, [k for k in args.kinds.split(",") if k])
    healthy = healthy_alarms(60 if args.quick else 300)
    for h in healthy:
        print(f"healthy run seed={h['seed']} dropout={h['dropout']}: {h['alarms']} alarms in {h['steps']} steps")
    cost = overhead(3 if args.quick else 7)
    for key, label in (("", ""), ("_backward", ", both with backward=True")):
        print(f"step time{label}: watch() {cost['step_ms_watch' + key]:.2f} ms, spikes+rerun "
              f"{cost['step_ms_spikes_rerun' + key]:.2f} ms, median ratio {cost['ratio_median' + key]:.3f} over "
              f"{len(cost['ratios' + key])} alternating blocks")
    os.makedirs(os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"), exist_ok=True)
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "bench_faults.json")
    with open(path, "w") as f:
        json.dump({"faults": rows, "healthy": healthy, "overhead": cost, "torch": torch.__version__}, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
