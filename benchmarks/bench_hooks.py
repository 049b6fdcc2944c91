"""Step time and host syncs of watching every module of a model, side by side in one process.

Conditions (interleaved round-robin, medians): no hooks / an empty forward hook on every module
(PyTorch's hook dispatch alone) / numguard.watch (sync check) / numguard
check="async" / numguard check_every=10 / numguard backward=True (training only, when available)
/ numguard ops=True (training only) / numguard replay=True / numguard spikes=True (also with
backward=True, and with rerun=True) / numguard quant=float8_e4m3fn and quant=mxfp8_e4m3 (float8 also with backward=True)
/ a torch reference of Transformer Engine's float8 statistics (cast, compare, .item() per tensor
on every module's outputs, without numguard) / Transformers' DebugUnderflowOverflow /
torch.autograd.detect_anomaly. Models: a stack of 200 Linear(4, 4) (host cost per module call),
random-init GPT-2 (~1M and ~14M parameters) and T5 (~13M), CPU, one thread. Steps: forward only
(no_grad) and
forward + backward + AdamW.

    python benchmarks/bench_hooks.py [--reps 7] [--steps 3] [--models gpt2-1m,gpt2-14m,t5-13m]
        [--conditions "numguard,numguard replay=True"] [--advise]

Prints a table and writes benchmarks/results/bench_hooks.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import numguard  # noqa: E402
from numguard import schema  # noqa: E402
from numguard.testing import SyncCounter  # noqa: E402

warnings.filterwarnings("ignore")


# -- models ------------------------------------------------------------------------------------

def gpt2(n_embd, n_layer, n_head, vocab, seq, batch):
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(vocab_size=vocab, n_embd=n_embd, n_layer=n_layer, n_head=n_head, n_positions=seq,
                     bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg)
    ids = torch.randint(0, vocab, (batch, seq))
    return model, (lambda m: m(ids, labels=ids)), (lambda m: m(ids))


def t5(d_model, d_ff, layers, heads, vocab, seq, batch):
    from transformers import T5Config, T5ForConditionalGeneration
    cfg = T5Config(vocab_size=vocab, d_model=d_model, d_kv=d_model // heads, d_ff=d_ff, num_layers=layers,
                   num_decoder_layers=layers, num_heads=heads, decoder_start_token_id=0, pad_token_id=0,
                   eos_token_id=1)
    model = T5ForConditionalGeneration(cfg)
    ids = torch.randint(2, vocab, (batch, seq))
    return model, (lambda m: m(input_ids=ids, labels=ids)), (lambda m: m(input_ids=ids, labels=ids))


class _Loss:
    def __init__(self, loss):
        self.loss = loss


def linear_stack(n, width, batch):
    """n x Linear(width, width): tiny tensors, so the host time per watched module call is all there is."""
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(n)])
    x = torch.randn(batch, width)
    return model, (lambda m: _Loss(m(x).square().mean())), (lambda m: m(x))


MODELS = {
    "stack-200": lambda: linear_stack(200, 4, 2),
    "gpt2-1m": lambda: gpt2(128, 4, 4, 1024, 64, 4),
    "gpt2-14m": lambda: gpt2(384, 6, 6, 8192, 128, 4),
    "t5-13m": lambda: t5(256, 1024, 6, 4, 8000, 64, 4),
}


# -- conditions --------------------------------------------------------------------------------

class HFHooks:
    """Transformers' DebugUnderflowOverflow, removable (it keeps no hook handles of its own)."""

    def __init__(self, model):
        from transformers.debug_utils import DebugUnderflowOverflow
        before = {m: set(m._forward_hooks) for m in model.modules()}
        self.debug = DebugUnderflowOverflow(model)
        self.added = [(m, k) for m in model.modules() for k in m._forward_hooks if k not in before[m]]

    def close(self):
        for m, k in self.added:
            m._forward_hooks.pop(k, None)
            m._forward_hooks_with_kwargs.pop(k, None)


class Anomaly:
    def __init__(self, model):
        self.ctx = torch.autograd.detect_anomaly(check_nan=True)
        self.ctx.__enter__()

    def close(self):
        self.ctx.__exit__(None, None, None)


class Watch:
    def __init__(self, model, **kw):
        self.insp = numguard.watch(model, report_to=None, **kw)

    def close(self):
        self.insp.close(check=False)


class CastAndRead:
    """What Transformer Engine's debug statistics do for a float8 what-if (LogFp8TensorStats:
    underflow %, overflow %, MSE): on every module's floating outputs, current scale, cast to
    float8_e4m3fn and back, compare, and read each statistic back to the host with .item()."""

    def __init__(self, model):
        fmax = torch.finfo(torch.float8_e4m3fn).max
        self.stats = []

        def hook(module, args, output):
            if isinstance(output, torch.Tensor):
                outs = [output]
            else:
                outs = output.values() if isinstance(output, dict) else output if isinstance(output, (tuple, list)) else []
            for t in outs:
                if not (isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()):
                    continue
                t = t.detach().float()
                scale = fmax / t.abs().amax().clamp(min=1e-30)
                q = (t * scale).clamp(-fmax, fmax).to(torch.float8_e4m3fn).float() / scale
                nonzero = (t != 0).sum().clamp(min=1)
                self.stats.append((((q == 0) & (t != 0)).sum() / nonzero).item())
                self.stats.append(((t * scale).abs() > fmax).sum().item())
                self.stats.append((q - t).square().mean().item())
        self.handles = [m.register_forward_hook(hook) for m in model.modules()]

    def close(self):
        for h in self.handles:
            h.remove()


class Nothing:
    def __init__(self, model):
        pass

    def close(self):
        pass


def _empty_hook(module, args, kwargs, output):
    return None


class EmptyHooks:
    """A forward hook that does nothing on every module: what PyTorch's hook dispatch alone costs,
    the floor of any hook-based watcher."""

    def __init__(self, model):
        self.handles = [m.register_forward_hook(_empty_hook, with_kwargs=True) for m in model.modules()]

    def close(self):
        for h in self.handles:
            h.remove()


def have_backward():
    try:
        import numguard.backward  # noqa: F401
        return True
    except ImportError:
        return False


def conditions(training):
    out = [("no hooks", Nothing),
           ("empty torch hooks", EmptyHooks),
           ("numguard", Watch),
           ("numguard async", lambda m: Watch(m, check="async")),
           ("numguard check_every=10", lambda m: Watch(m, check_every=10))]
    if training and have_backward():
        out.append(("numguard backward=True", lambda m: Watch(m, backward=True)))
    if training:
        out.append(("numguard ops=True", lambda m: Watch(m, ops=True)))
        if have_backward():
            out.append(("numguard ops=True backward=True", lambda m: Watch(m, ops=True, backward=True)))
    out.append(("numguard replay=True", lambda m: Watch(m, replay=True)))
    out.append(("numguard spikes=True", lambda m: Watch(m, spikes=True)))
    if training and have_backward():
        out.append(("numguard backward=True spikes=True", lambda m: Watch(m, backward=True, spikes=True)))
    out.append(("numguard spikes=True rerun=True", lambda m: Watch(m, spikes=True, rerun=True)))
    if training and have_backward():
        out.append(("numguard backward=True spikes=True rerun=True",
                    lambda m: Watch(m, backward=True, spikes=True, rerun=True)))
    out.append(("numguard quant=float8_e4m3fn", lambda m: Watch(m, quant="float8_e4m3fn")))
    out.append(("torch cast+compare+.item() float8_e4m3fn", CastAndRead))
    out.append(("numguard quant=mxfp8_e4m3", lambda m: Watch(m, quant="mxfp8_e4m3")))
    if training and have_backward():
        out.append(("numguard backward=True quant=float8_e4m3fn",
                    lambda m: Watch(m, backward=True, quant="float8_e4m3fn")))
    out += [("transformers DebugUnderflowOverflow", HFHooks),
            ("torch detect_anomaly", Anomaly)]
    return out


# -- sync counting -----------------------------------------------------------------------------

# -- measurement -------------------------------------------------------------------------------

def make_step(model, run, training, optimizer):
    if training:
        def step():
            out = run(model)
            out.loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    else:
        def step():
            with torch.no_grad():
                run(model)
    return step


def bench_model(name, reps, steps, sync_steps, only=None):
    model, train_run, fwd_run = MODELS[name]()
    params = sum(p.numel() for p in model.parameters())
    rows = []
    for training in (False, True):
        model.train(training)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4) if training else None
        step = make_step(model, train_run if training else fwd_run, training, optimizer)
        conds = [c for c in conditions(training) if only is None or c[0] in only or c[0] == "no hooks"]
        times = {c: [] for c, _ in conds}
        cpu = {c: [] for c, _ in conds}
        step()  # warm up (allocator, AdamW state)
        for _ in range(reps):
            for cname, make in conds:
                handle = make(model)
                try:
                    step()  # first step after attaching: numguard's layout, ring growth
                    t0, c0 = time.perf_counter(), time.thread_time()
                    for _ in range(steps):
                        step()
                    cpu[cname].append((time.thread_time() - c0) / steps)
                    times[cname].append((time.perf_counter() - t0) / steps)
                finally:
                    handle.close()
        syncs = {}
        for cname, make in conds:
            handle = make(model)
            try:
                step()
                step()
                counter = SyncCounter()
                with counter():
                    for _ in range(sync_steps):
                        step()
                syncs[cname] = counter.total / sync_steps
            finally:
                handle.close()
        base = statistics.median(times["no hooks"])
        cpu_base = statistics.median(cpu["no hooks"])
        for cname, _ in conds:
            med = statistics.median(times[cname])
            cpu_med = statistics.median(cpu[cname])
            rows.append({"model": name, "params": params, "step": "train" if training else "forward",
                         "condition": cname, "median_s": med, "ratio": med / base,
                         "cpu_median_s": cpu_med, "cpu_ratio": cpu_med / cpu_base, "cpu_samples_s": cpu[cname],
                         "syncs_per_step": syncs[cname], "extra_syncs_per_step": syncs[cname] - syncs["no hooks"],
                         "samples_s": times[cname]})
    return rows


# -- precision advice on a dump -----------------------------------------------------------------

def bench_advise(name, train_batches=4, forward_batches=60, reps=5):
    """Time `numguard advise` on a real dump of `name`: a full history window (a few training
    steps with backward=True, then forward batches), then a NaN weight trips on_trip="dump"."""
    import subprocess
    import tempfile

    from numguard import advice as _advice
    from numguard import dump as _dump

    model, train_run, fwd_run = MODELS[name]()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    directory = tempfile.mkdtemp(prefix="numguard-bench-advise-")
    insp = numguard.watch(model, backward=True, on_trip="dump", dump_dir=directory, report_to=None)
    for _ in range(train_batches):
        run_step = make_step(model, train_run, True, optimizer)
        run_step()
    with torch.no_grad():
        for _ in range(forward_batches):
            fwd_run(model)
        next(model.parameters()).view(-1)[0] = float("nan")
        fwd_run(model)
    insp.close(check=False)
    (path,) = [os.path.join(directory, f) for f in os.listdir(directory)]
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        data = _dump.load(path)
        result = _advice.advise(data["history"])
        _advice.render(result)
        times.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "numguard", "advise", path], check=True, capture_output=True)
    process = time.perf_counter() - t0
    return {"model": name, "modules": len(data["history"]["modules"]), "batches": len(data["history"]["batches"]),
            "dump_bytes": os.path.getsize(path), "advise_s": statistics.median(times), "process_s": process}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--sync-steps", type=int, default=2)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--compiled", action="store_true",
                        help="only the compiled rows (bench_compiled): torch.compile'd train steps, watched vs not")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                     "bench_hooks.json"))
    parser.add_argument("--conditions", default=None,
                        help="comma-separated condition names to run (default: all; 'no hooks' always runs)")
    parser.add_argument("--advise", action="store_true",
                        help="also time `python -m numguard advise` on a dump of each model (see bench_advise)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.compiled:
        return main_compiled(args)
    rows = []
    only = set(c.strip() for c in args.conditions.split(",")) if args.conditions else None
    advise_rows = []
    for name in args.models.split(","):
        rows += bench_model(name.strip(), args.reps, args.steps, args.sync_steps, only)
        if args.advise:
            advise_rows.append(bench_advise(name.strip()))
    header = (f"{'model':9} {'params':>7} {'step':7} {'condition':42} {'wall ms':>8} {'ratio':>6} "
              f"{'cpu ms':>8} {'ratio':>6} {'syncs/step':>10}")
    print("medians over interleaved repetitions; ratio = condition / no hooks (wall clock and this thread's CPU time)")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['model']:9} {r['params'] / 1e6:6.1f}M {r['step']:7} {r['condition']:42} "
              f"{r['median_s'] * 1e3:8.2f} {r['ratio']:6.2f} {r['cpu_median_s'] * 1e3:8.2f} {r['cpu_ratio']:6.2f} "
              f"{r['syncs_per_step']:10.1f}")
    plain = {(r["model"], r["step"], "backward=True" in r["condition"]): r for r in rows
             if r["condition"] in ("numguard", "numguard backward=True")}
    # the what-if's and spike detection's cost over the watch they ride on (targets: <= 1.05x for
    # quant=, <= 1.01x for spikes=True rerun=True)
    for r in rows:
        base = plain.get((r["model"], r["step"], "backward=True" in r["condition"]))
        if base is not None and ("quant=" in r["condition"] or "rerun=" in r["condition"]
                                 or r["condition"].startswith("torch cast")):
            print(f"{r['model']} {r['step']}: {r['condition']} / {base['condition']}: wall "
                  f"{r['median_s'] / base['median_s']:.2f}x, CPU {r['cpu_median_s'] / base['cpu_median_s']:.2f}x")
    for r in advise_rows:
        print(f"advise on a dump of {r['model']} ({r['modules']} modules, {r['batches']} batches of history, "
              f"{r['dump_bytes'] / 1e6:.1f} MB): load + advise + render {r['advise_s'] * 1e3:.0f} ms median, "
              f"`python -m numguard advise` process {r['process_s']:.2f} s")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"torch": torch.__version__, "numguard_backend": numguard.backend(),
                   "threads": args.threads, "reps": args.reps, "steps": args.steps,
                   "machine": platform.machine(), "processor": platform.processor(), "rows": rows,
                   "advise": advise_rows}, f, indent=1)
    print(f"\nwrote {args.out}")


# -- compiled rows -----------------------------------------------------------------------------
# A torch.compile'd (inductor, CPU) train step with every submodule recorded inside the graph
# (numguard.watch(torch.compile(model))), with and without backward=True, against the same compiled
# step unwatched. Copies of the model with the same weights, each compiled once before timing; the
# steps are interleaved.

def _compile_counts(counters):
    return {"graphs": counters["stats"]["unique_graphs"], "graph_breaks": sum(counters["graph_break"].values())}


class NumguardGraphBreaks:
    """Graph breaks whose user code traceback passes through numguard (dynamo's graph_breaks log,
    its stderr output muted meanwhile). The model's own breaks are not counted."""

    def __init__(self):
        import logging

        import torch._logging

        self.count = 0
        torch._logging.set_logs(graph_breaks=True)
        self.logger = logging.getLogger("torch._dynamo")
        self.muted = [(h, h.level) for h in self.logger.handlers]
        for handler, _ in self.muted:
            handler.setLevel(logging.CRITICAL)
        outer = self

        class Handler(logging.Handler):
            def emit(self, record):
                message = record.getMessage()
                if "Graph break" in message and "/numguard/" in message:
                    outer.count += 1

        self.handler = Handler()
        self.logger.addHandler(self.handler)

    def close(self):
        import torch._logging

        self.logger.removeHandler(self.handler)
        for handler, level in self.muted:
            handler.setLevel(level)
        torch._logging.set_logs()


def bench_compiled(name, reps, steps):
    import copy

    import torch._dynamo
    from torch._dynamo.utils import counters

    base, train_run, _ = MODELS[name]()
    base.train(True)
    params = sum(p.numel() for p in base.parameters())
    setups = {}
    # By default dynamo does not guard on module hooks (skip_nnmodule_hook_guards): the two copies
    # share code objects, and one could run the code compiled for the other (with or without the
    # hooks). Guarding on hooks gives each copy its own graphs (the same guard cost in both rows);
    # the frames/step column shows the watched copy's frames are recorded in its graph.
    torch._dynamo.config.skip_nnmodule_hook_guards = False
    for cname in ("compiled, no hooks", "compiled, numguard (frames in the graph)",
                  "compiled, numguard backward=True"):
        model = copy.deepcopy(base)
        compiled = torch.compile(model, backend="inductor")
        if "numguard" in cname:
            # backward=True: the gradients of the modules inside the graph are recorded in its backward.
            handle = numguard.watch(compiled, report_to=None, backward="backward=True" in cname)
        else:
            handle = Nothing(compiled)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        step = make_step(compiled, train_run, True, optimizer)
        counters.clear()
        breaks = NumguardGraphBreaks()
        t0 = time.perf_counter()
        try:
            step()  # compiles forward and backward
            step()
        finally:
            breaks.close()
        compile_s = time.perf_counter() - t0
        setups[cname] = (step, handle, dict(_compile_counts(counters), by_numguard=breaks.count), compile_s)
        print(f"{cname}: compiled in {compile_s:.0f} s, {setups[cname][2]}", flush=True)
    counters.clear()
    times = {c: [] for c in setups}
    for _ in range(reps):
        for cname, (step, _, _, _) in setups.items():
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            times[cname].append((time.perf_counter() - t0) / steps)
    recompiled = _compile_counts(counters)  # graphs made or broken while timing: 0 when compiled once
    rows = []
    base_s = statistics.median(times["compiled, no hooks"])
    for cname, (_, handle, counts, compile_s) in setups.items():
        med = statistics.median(times[cname])
        graph = getattr(handle, "_graph", None)
        rows.append({"model": name, "params": params, "step": "train (compiled)", "condition": cname,
                     "median_s": med, "ratio": med / base_s, "samples_s": times[cname], "compile_s": compile_s,
                     "graphs": counts["graphs"], "graph_breaks": counts["graph_breaks"],
                     "graph_breaks_by_numguard": counts["by_numguard"],
                     "graphs_made_while_timing": recompiled["graphs"],
                     "frames_in_graph_per_step": None if graph is None else
                     graph.cursor[schema.CURSOR_CALLS].item() // (2 + reps * steps)})
        handle.close()
    return rows


def main_compiled(args):
    rows = []
    for name in args.models.split(","):
        rows += bench_compiled(name.strip(), args.reps, args.steps)
    header = (f"{'model':9} {'params':>7} {'condition':42} {'wall ms':>8} {'ratio':>6} {'graphs':>6} "
              f"{'breaks':>6} {'by numguard':>11} {'recompiled':>10} {'frames/step':>11}")
    print("compiled (inductor, CPU) train step; medians over interleaved repetitions; ratio = condition / "
          "compiled, no hooks")
    print(header)
    print("-" * len(header))
    for r in rows:
        frames = "" if r["frames_in_graph_per_step"] is None else r["frames_in_graph_per_step"]
        print(f"{r['model']:9} {r['params'] / 1e6:6.1f}M {r['condition']:42} {r['median_s'] * 1e3:8.2f} "
              f"{r['ratio']:6.2f} {r['graphs']:6} {r['graph_breaks']:6} {r['graph_breaks_by_numguard']:11} "
              f"{r['graphs_made_while_timing']:10} {frames:>11}")
    out = args.out.replace(".json", "_compiled.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"torch": torch.__version__, "numguard_backend": numguard.backend(), "threads": args.threads,
                   "reps": args.reps, "steps": args.steps, "machine": platform.machine(), "rows": rows}, f, indent=1)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
