"""Where the healthy cost of spikes=True, rerun=True goes, part by part: bench_faults' TinyLM on the
CPU, trained with the spike detector armed and its window full, each part's time per step (wall
and process CPU time) from timers around numguard's own functions:

- spike test: SpikeDetector.after_fold (of which the baseline, _baseline_of, every spikes.REFRESH
  batches), the loss row (note_loss) and with --backward the gradient norms (note_gradients);
- rerun: keeping the root call (RootRerun._keep, of which the input fingerprint), its return
  (_returned) and dropping kept calls at the check (frames_confirmed).

The timers cost a little themselves; the step times are only for scale (bench_faults' overhead
rows give the ratio against plain watch()).

    python benchmarks/bench_spike_parts.py [--backward] [--steps 200]

Prints a table and writes benchmarks/results/bench_spike_parts.json.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_faults  # noqa: E402
import numguard  # noqa: E402
from numguard.inspector import rerun as _rerun  # noqa: E402
from numguard.inspector import spikes as _spikes  # noqa: E402
from numguard.inspector.history import WINDOW  # noqa: E402

PARTS = [(_spikes.SpikeDetector, "after_fold", "spike test (after_fold)"),
         (_spikes.SpikeDetector, "_baseline_of", "  of which the baseline"),
         (_spikes.SpikeDetector, "note_loss", "loss row (note_loss)"),
         (_spikes.SpikeDetector, "note_gradients", "gradient norms (note_gradients)"),
         (_rerun.RootRerun, "_keep", "rerun: keep the call"),
         (_rerun, "_fingerprint", "  of which the input fingerprint"),
         (_rerun.RootRerun, "_returned", "rerun: the call's return"),
         (_rerun.RootRerun, "frames_confirmed", "rerun: drop kept calls")]


def _timed(owner, name, label, spent):
    original = getattr(owner, name)

    def timed(*args, **kwargs):
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            return original(*args, **kwargs)
        finally:
            part = spent[label]
            part[0] += time.perf_counter() - t0
            part[1] += time.process_time() - c0
            part[2] += 1
    setattr(owner, name, timed)
    return original


def measure(backward, steps):
    spent = collections.defaultdict(lambda: [0.0, 0.0, 0])
    originals = [(owner, name, _timed(owner, name, label, spent)) for owner, name, label in PARTS]
    try:
        torch.manual_seed(0)
        model = bench_faults.TinyLM()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        warm = WINDOW + 16
        xs = [torch.randn(bench_faults.BATCH, bench_faults.SEQ, bench_faults.D) for _ in range(warm + steps)]
        insp = numguard.watch(model, report_to=None, spikes=True, rerun=True, backward=backward)
        for i, x in enumerate(xs):
            if i == warm:
                spent.clear()
                t0, c0 = time.perf_counter(), time.process_time()
            loss = (model(x) - x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        wall, cpu = (time.perf_counter() - t0) / steps, (time.process_time() - c0) / steps
        insp.close(check=False)
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)
    parts = {label: {"wall_ms": 1e3 * w / steps, "cpu_ms": 1e3 * c / steps, "calls_per_step": n / steps}
             for label, (w, c, n) in spent.items()}
    return {"backward": backward, "step_wall_ms": 1e3 * wall, "step_cpu_ms": 1e3 * cpu, "parts": parts}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backward", action="store_true", help="also watch gradients (and their norms)")
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    result = measure(args.backward, args.steps)
    print(f"spikes=True, rerun=True, backward={args.backward}: step {result['step_wall_ms']:.2f} ms wall, "
          f"{result['step_cpu_ms']:.2f} ms CPU")
    for label, part in result["parts"].items():
        print(f"  {label:34s} {part['wall_ms']:7.3f} ms wall {part['cpu_ms']:7.3f} ms CPU per step "
              f"({part['calls_per_step']:.2f} calls)")
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "bench_spike_parts.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(dict(result, torch=torch.__version__), f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
