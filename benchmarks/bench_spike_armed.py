"""The healthy cost of spikes=True, rerun=True over plain watch() on a transformer once the spike
detector is armed, as a long run sees it: bench_hooks' GPT-2 (~14M parameters, CPU, one thread),
one copy of the model (same weights) per condition, each watched for the whole run and trained
untimed until the history window is full (every batch tested, the baseline recomputed every
spikes.REFRESH batches), then timed in interleaved blocks by the process's CPU time.

bench_hooks' spikes rows start a new watch() for each repetition of a few steps, so its spike
detector never arms there: they measure the loss row, the gradient norms and the rerun's keeping,
not the spike test. This benchmark measures all of it.

Rows: forward (no_grad) and training (forward + backward + AdamW), the latter also with
backward=True on both sides.

    python benchmarks/bench_spike_armed.py [--blocks 5] [--steps 3] [--model gpt2-14m]

Prints a table and writes benchmarks/results/bench_spike_armed.json.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_hooks  # noqa: E402
import numguard  # noqa: E402
from numguard.inspector.history import WINDOW  # noqa: E402

ARMED = {"spikes": True, "rerun": True}
ROWS = {"forward": {"watch()": {}, "spikes+rerun": ARMED},
        "train": {"watch()": {}, "spikes+rerun": ARMED, "watch(backward)": {"backward": True},
                  "backward+spikes+rerun": dict(ARMED, backward=True)}}


def measure(model_name, blocks, steps):
    torch.manual_seed(0)
    model, train_fn, forward_fn = bench_hooks.MODELS[model_name]()
    rows = []
    for mode, conditions in ROWS.items():
        runs = {}
        for name, opts in conditions.items():
            m = copy.deepcopy(model)
            opt = torch.optim.AdamW(m.parameters(), lr=1e-5)

            def step(m=m, opt=opt):
                if mode == "forward":
                    with torch.no_grad():
                        forward_fn(m)
                else:
                    opt.zero_grad()
                    train_fn(m).loss.backward()
                    opt.step()
            insp = numguard.watch(m, report_to=None, **opts)
            for _ in range(WINDOW + 2):   # the window full: armed, as in a long run
                step()
            runs[name] = (insp, step, [])
        for _ in range(blocks):
            for insp, step, times in runs.values():
                c0 = time.process_time()
                for _ in range(steps):
                    step()
                times.append((time.process_time() - c0) / steps)
        names = list(conditions)
        for base, armed in zip(names[0::2], names[1::2]):
            ratios = [a / b for a, b in zip(runs[armed][2], runs[base][2])]
            rows.append({"model": model_name, "step": mode, "condition": f"{armed} / {base}",
                         "base_cpu_ms": 1e3 * statistics.median(runs[base][2]),
                         "armed_cpu_ms": 1e3 * statistics.median(runs[armed][2]),
                         "ratio_median": statistics.median(ratios), "ratios": ratios})
        for insp, _, _ in runs.values():
            insp.close(check=False)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3, help="steps per timed block")
    ap.add_argument("--model", default="gpt2-14m", choices=["gpt2-1m", "gpt2-14m"])
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    rows = measure(args.model, args.blocks, args.steps)
    print(f"{'model':9} {'step':7} {'condition':40} {'base ms':>8} {'armed ms':>8} {'ratio':>6}  blocks")
    for r in rows:
        print(f"{r['model']:9} {r['step']:7} {r['condition']:40} {r['base_cpu_ms']:8.1f} {r['armed_cpu_ms']:8.1f} "
              f"{r['ratio_median']:6.3f}  {min(r['ratios']):.3f}-{max(r['ratios']):.3f}")
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "bench_spike_armed.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"rows": rows, "blocks": args.blocks, "steps": args.steps, "torch": torch.__version__}, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
