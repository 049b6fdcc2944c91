"""Training step time under each framework integration, side by side with the unwatched run and
with the framework's own numerics option, in one process.

Frameworks and conditions (interleaved round-robin over repetitions; per run the median step time
after warm-up, then the median over repetitions):

- Transformers Trainer: unwatched / NumguardCallback / TrainingArguments(debug="underflow_overflow")
- Lightning Trainer:    unwatched / NumguardCallback / Trainer(detect_anomaly=True)
- Accelerate loop:      unwatched / numguard.integrations.accelerate.watch / Transformers'
                        DebugUnderflowOverflow on the model (Accelerate has no numerics option of
                        its own; ACCELERATE_DEBUG_MODE checks collectives only)

Model: a random-init GPT-2 (~1M parameters, seq 64, batch 4), CPU, one thread, AdamW.

    python benchmarks/bench_integrations.py [--reps 5] [--steps 8] [--warmup 2] [--frameworks transformers,lightning,accelerate]

Prints a table of ratios to the unwatched run and writes benchmarks/results/bench_integrations.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import numguard  # noqa: E402

warnings.filterwarnings("ignore")
SEQ, BATCH, VOCAB = 64, 4, 1024


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=VOCAB, n_embd=128, n_layer=4, n_head=4, n_positions=SEQ, bos_token_id=0,
                     eos_token_id=0)
    return GPT2LMHeadModel(cfg)


def dataset(n):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    return [{"input_ids": ids[i], "labels": ids[i]} for i in range(n)]


def step_time(stamps, warmup):
    gaps = [b - a for a, b in zip(stamps[warmup:], stamps[warmup + 1:])]
    return statistics.median(gaps)


# -- one run per framework and condition; each returns the median step time in seconds ---------

def run_transformers(condition, steps, warmup):
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from numguard.integrations.transformers import NumguardCallback

    stamps = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            stamps.append(time.perf_counter())

    callbacks = [Clock()] + ([NumguardCallback(report_to=None)] if condition == "numguard" else [])
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=BATCH, max_steps=steps + 1,
                                 report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True,
                                 logging_steps=10_000, seed=0,
                                 debug="underflow_overflow" if condition == "own" else "")
        trainer = Trainer(model=gpt2(), args=args, train_dataset=dataset(BATCH * (steps + 1)),
                          callbacks=callbacks)
        with _quiet():
            trainer.train()
    return step_time(stamps, warmup)


def run_lightning(condition, steps, warmup):
    import pytorch_lightning as pl

    from numguard.integrations.lightning import NumguardCallback

    stamps = []

    class Lit(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = gpt2()

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss

        def on_train_batch_end(self, outputs, batch, batch_idx):
            stamps.append(time.perf_counter())

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    data = torch.utils.data.DataLoader(dataset(BATCH * (steps + 1)), batch_size=BATCH)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps + 1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         detect_anomaly=condition == "own",
                         callbacks=[NumguardCallback(report_to=None)] if condition == "numguard" else [])
    with _quiet():
        trainer.fit(Lit(), data)
    return step_time(stamps, warmup)


def run_accelerate(condition, steps, warmup):
    from accelerate import Accelerator

    from numguard.integrations.accelerate import watch

    accelerator = Accelerator(cpu=True)
    model = gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = torch.utils.data.DataLoader(dataset(BATCH * (steps + 1)), batch_size=BATCH)
    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    watcher = None
    if condition == "numguard":
        watcher = watch(accelerator, model, report_to=None)
    elif condition == "own":
        from transformers.debug_utils import DebugUnderflowOverflow
        DebugUnderflowOverflow(accelerator.unwrap_model(model))
    stamps = []
    for batch in data:
        loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        stamps.append(time.perf_counter())
    if watcher is not None:
        watcher.close()
    return step_time(stamps, warmup)


class _quiet:
    """Frameworks print banners; the table is what this script is for."""

    def __enter__(self):
        self._devnull = open(os.devnull, "w")
        self._stdout, sys.stdout = sys.stdout, self._devnull

    def __exit__(self, *exc):
        sys.stdout = self._stdout
        self._devnull.close()
        return False


FRAMEWORKS = {
    "transformers": (run_transformers, 'Trainer debug="underflow_overflow"'),
    "lightning": (run_lightning, "Trainer(detect_anomaly=True)"),
    "accelerate": (run_accelerate, "Transformers' DebugUnderflowOverflow"),
}
CONDITIONS = ("unwatched", "numguard", "own")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per run (after warm-up)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--frameworks", default=",".join(FRAMEWORKS))
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                     "bench_integrations.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    frameworks = [f for f in args.frameworks.split(",") if f]
    times = {f: {c: [] for c in CONDITIONS} for f in frameworks}
    for _ in range(args.reps):
        for framework in frameworks:
            run = FRAMEWORKS[framework][0]
            for condition in CONDITIONS:  # interleaved: drifts in machine load hit every condition
                times[framework][condition].append(run(condition, args.steps + args.warmup, args.warmup))
    rows = []
    print(f"{'framework':<13} {'condition':<38} {'step ms':>8} {'x unwatched':>11}")
    for framework in frameworks:
        base = statistics.median(times[framework]["unwatched"])
        for condition in CONDITIONS:
            label = {"unwatched": "unwatched", "numguard": "numguard integration",
                     "own": FRAMEWORKS[framework][1]}[condition]
            median = statistics.median(times[framework][condition])
            rows.append({"framework": framework, "condition": condition, "label": label,
                         "median_step_s": median, "ratio": median / base,
                         "step_s": times[framework][condition]})
            print(f"{framework:<13} {label:<38} {median * 1e3:8.2f} {median / base:11.2f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"torch": torch.__version__, "numguard_backend": numguard.backend(),
                   "python": platform.python_version(), "machine": platform.machine(), "threads": 1,
                   "reps": args.reps, "steps": args.steps, "warmup": args.warmup,
                   "model": "GPT-2 n_embd=128 n_layer=4 seq=64 batch=4", "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
