"""Multi-process cases of the integration tests: one subprocess per rank (gloo on loopback, a free
port), every process killed after a hard timeout, a JSON result per rank.

    results = run_ranks("lightning_ddp", world=2, timeout=150)

A case is ``case_<name>(rank, world) -> dict`` in this file. Workers leave with ``os._exit`` so a
process left in a collective cannot keep the test waiting.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from dist_workers import RankProcesses, job_environs  # noqa: E402


def run_ranks(name, world=2, timeout=150.0, env=None):
    """Run ``case_<name>`` on `world` processes (dist_workers.RankProcesses); returns their result
    dicts (each with its "log"). Raises AssertionError with every rank's output when one fails or
    the timeout passes."""
    with tempfile.TemporaryDirectory() as tmp:
        environs = [dict(e, NODE_RANK="0", NG_RESULT=os.path.join(tmp, f"r{r}.json"))
                    for r, e in enumerate(job_environs(world, env))]
        job = RankProcesses([sys.executable, __file__, name], environs, cwd=tmp, merged=True)
        logs = [out for _, out, _ in job.wait(timeout)]
        results = []
        for r in range(world):
            path = os.path.join(tmp, f"r{r}.json")
            results.append(json.load(open(path)) if os.path.exists(path) else None)
    if job.timed_out or any(res is None or "error" in res for res in results):
        detail = "\n".join(f"--- rank {r} ---\n{logs[r][-5000:]}" for r in range(world))
        raise AssertionError(f"case {name!r}: {'timed out' if job.timed_out else 'a rank failed'}\n{detail}")
    for res, log in zip(results, logs):
        res["log"] = log
    return results


def _outcome(fn):
    try:
        return {"ok": fn()}
    except Exception as exc:  # noqa: BLE001 - the tests look at it
        return {"exc": type(exc).__name__, "msg": str(exc), "module": getattr(exc, "module", None),
                "batch_number": getattr(exc, "batch_number", None), "ranks": getattr(exc, "ranks", None)}


def case_lightning_ddp(rank, world):
    """ddp on 2 CPU processes: rank 0's forward makes a NaN at its step 2; every rank stops there."""
    import pytorch_lightning as pl

    from integ_models import lightning_module_class, loader
    from numguard.integrations.lightning import NumguardCallback

    LitNet = lightning_module_class(pl)
    pl.seed_everything(0)
    model = LitNet(poison_at=2 if rank == 0 else None)
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy="ddp", max_steps=5, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[NumguardCallback(report_to=None)], use_distributed_sampler=False)
    out = _outcome(lambda: trainer.fit(model, loader()))
    out["steps_run"] = len(model.losses)
    out["global_step"] = trainer.global_step
    return out


def case_transformers_ddp(rank, world):
    """Trainer on 2 CPU processes (DDP, gloo): a healthy run with evaluation every 2 steps (the
    evaluation checks stay on their own rank), then rank 0's forward makes a NaN at step 2."""
    import tempfile

    import torch
    from transformers import Trainer, TrainingArguments

    from integ_models import TinyNet, samples
    from numguard.integrations.transformers import NumguardCallback

    def trainer(poison_at, out):
        torch.manual_seed(0)
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=4, per_device_eval_batch_size=4,
                                 max_steps=4, logging_steps=1, report_to=[], use_cpu=True, seed=0,
                                 save_strategy="no", disable_tqdm=True, eval_strategy="steps", eval_steps=2)
        return Trainer(model=TinyNet(poison_at), args=args, train_dataset=samples(), eval_dataset=samples(8, 1),
                       callbacks=[NumguardCallback(report_to=None)])

    res = {}
    with tempfile.TemporaryDirectory() as out:
        healthy = trainer(None, out)
        res["healthy"] = _outcome(lambda: healthy.train().global_step)
        res["eval_losses"] = [e["eval_loss"] for e in healthy.state.log_history if "eval_loss" in e]
        res["parallel"] = str(healthy.args.parallel_mode)
        bad = trainer(2 if rank == 0 else None, out)
        res["poisoned"] = _outcome(lambda: bad.train().global_step)
        res["poisoned_step"] = bad.state.global_step
    return res


def case_accelerate_ops(rank, world):
    """NUMGUARD_DIST_CHECK=1 and ACCELERATE_DEBUG_MODE=1: every Accelerate operation given
    mismatched shapes raises numguard's exception on every process; matching ones work."""
    import torch
    from accelerate import Accelerator
    from accelerate.state import PartialState
    from accelerate.utils import broadcast, gather, pad_across_processes, reduce

    import numguard.distributed as ngd
    from numguard.integrations.accelerate import watch
    from integ_models import TinyNet

    accelerator = Accelerator(cpu=True)
    res = {"debug_before": bool(PartialState().debug), "processes": accelerator.num_processes}
    model = accelerator.prepare(TinyNet())
    inspector = watch(accelerator, model, report_to=None)
    res["debug_after"] = bool(PartialState().debug)
    calls = []
    original = ngd.guard.check_shapes

    def counting(*args, **kwargs):
        calls.append(kwargs.get("op"))
        return original(*args, **kwargs)

    ngd.guard.check_shapes = counting  # the guard's wrappers look it up at every call
    wrong = torch.ones(2, 3 + rank)
    res["gather"] = _outcome(lambda: gather(wrong).shape[0])
    res["reduce"] = _outcome(lambda: float(reduce(wrong).sum()))
    res["broadcast"] = _outcome(lambda: broadcast(wrong).shape[1])
    res["pad_across_processes"] = _outcome(lambda: pad_across_processes(torch.ones(2) if rank == 0 else torch.ones(2, 2)).shape[0])
    res["gather_for_metrics"] = _outcome(lambda: accelerator.gather_for_metrics(wrong).shape[0])
    # Matching calls still work, and went through the guard.
    res["pad_uneven"] = _outcome(lambda: list(gather(pad_across_processes(torch.ones(2 + rank, 3))).shape))
    res["gather_ok"] = _outcome(lambda: list(gather(torch.ones(2, 3)).shape))
    res["checked_ops"] = sorted(set(op for op in calls if op))
    ngd.guard.check_shapes = original
    inspector.close()
    return res


def case_accelerate_containers(rank, world):
    """Accelerate's operations over dicts and lists whose structure differs between the two
    processes, under numguard's collective check (NUMGUARD_DIST_CHECK=1 from the environment, or
    guard_collectives() called before Accelerate is imported or after the Accelerator is made, as
    NG_EXPLICIT_GUARD says: "before" or "after"); healthy containers still work and make one
    numguard exchange per tensor, no more."""
    import os

    explicit = os.environ.get("NG_EXPLICIT_GUARD")
    if explicit == "before":
        import numguard.distributed as ngd

        ngd.guard_collectives()  # before Accelerate is imported: followed when it is
    import torch
    from accelerate import Accelerator
    from accelerate.utils import broadcast, gather, pad_across_processes, reduce

    import numguard.distributed as ngd
    from numguard.distributed import collectives

    accelerator = Accelerator(cpu=True)
    if explicit == "after":
        ngd.guard_collectives()  # after the script bound Accelerate's functions to its own names
    res = {"processes": accelerator.num_processes}
    exchanges = []
    real_reduce, real_gather = collectives.timed_all_reduce, collectives.timed_all_gather

    def counted(real, kind):
        def call(*args, **kwargs):
            exchanges.append(kind)
            return real(*args, **kwargs)
        return call

    collectives.timed_all_reduce = counted(real_reduce, "all_reduce")
    collectives.timed_all_gather = counted(real_gather, "all_gather")

    def t(*shape, value=None):
        return torch.full(shape, float(rank if value is None else value))

    other = "b" if rank == 0 else "c"
    res["keys_differ"] = _outcome(lambda: gather({"a": t(2), other: t(2)}))
    extra = {"a": t(2), "b": t(2)}
    if rank == 0:
        extra["c"] = t(2)
    res["extra_key"] = _outcome(lambda: gather(extra))
    ab = {"a": t(2, value=0), "b": t(2, value=10)}
    res["key_order"] = _outcome(lambda: gather(ab if rank == 0 else {"b": ab["b"], "a": ab["a"]}))
    res["nested_keys"] = _outcome(lambda: gather(
        {"out": {"logits": t(2), ("loss" if rank == 0 else "aux"): t(1)}}))
    res["list_length"] = _outcome(lambda: gather({"xs": [t(2)] * (2 + rank)}))
    # rank 1's first leaf is a float: Accelerate would raise TypeError there alone
    res["tensor_vs_scalar"] = _outcome(lambda: reduce({"x": t(2) if rank == 0 else 2.0}))
    res["reduce_keys"] = _outcome(lambda: reduce({"a": t(2), other: t(2)}))
    res["broadcast_keys"] = _outcome(lambda: broadcast({"a": t(2), other: t(2)}))
    res["pad_keys"] = _outcome(lambda: pad_across_processes({"a": t(2 + rank), other: t(2)}))
    res["gather_for_metrics_keys"] = _outcome(
        lambda: accelerator.gather_for_metrics({"a": t(2), other: t(2)}))
    # healthy containers: right values, one numguard exchange per tensor
    del exchanges[:]
    res["healthy_gather"] = _outcome(lambda: {k: v.tolist() if torch.is_tensor(v) else [x.tolist() for x in v]
                                              for k, v in gather({"a": t(2), "b": [t(1, value=10 + rank),
                                                                                   t(1, value=20 + rank)]}).items()})
    res["healthy_gather_exchanges"] = list(exchanges)
    res["healthy_reduce"] = _outcome(lambda: reduce({"a": t(2), "b": t(1)}, reduction="sum")["a"].tolist())
    res["healthy_pad"] = _outcome(lambda: {k: list(v.shape) for k, v in pad_across_processes(
        {"a": t(2 + rank, 3), "b": t(1)}).items()})
    res["healthy_broadcast"] = _outcome(lambda: broadcast({"a": t(2)}, from_process=1)["a"].tolist())
    collectives.timed_all_reduce, collectives.timed_all_gather = real_reduce, real_gather
    return res


def case_fsdp2_local_shards(rank, world):
    """FSDP2 (fully_shard, DTensor parameters) on 2 CPU processes: rank 1's local shard of
    fc1.weight's gradient turns NaN before step 1's optimizer step."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import numguard
    from integ_models import TinyNet

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = TinyNet()
    fully_shard(model.fc1)
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    inspector = numguard.watch(model, backward=True, report_to=None)
    x, y = torch.randn(4, 4), torch.randn(4)
    res = {"steps": 0}

    def train():
        for step in range(3):
            model(x, labels=y)["loss"].backward()
            if step == 1 and rank == 1:
                with torch.no_grad():
                    model.fc1.weight.grad.to_local()[0, 0] = float("nan")
            optimizer.step()
            optimizer.zero_grad()
            res["steps"] += 1

    res.update(_outcome(train))
    res["unwatched"] = inspector.unwatched_modules()
    res["backward_closed"] = inspector.backward_watcher is None or inspector.backward_watcher.closed
    inspector.close(check=False)
    return res


def _main():
    name, path = sys.argv[1], os.environ["NG_RESULT"]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    try:
        result = globals()[f"case_{name}"](rank, world)
    except BaseException:  # noqa: BLE001 - reported to the parent
        result = {"error": traceback.format_exc()}
    with open(path, "w") as f:
        json.dump(result, f)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    _main()
