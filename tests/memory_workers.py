"""Two-rank scenarios for tests/test_memory.py (and benchmarks/compare_batch_finder.py).

``run(name, world)`` launches this file once per rank (gloo on loopback, a free port, a hard
timeout for the whole group; every process is killed when it expires) and returns each rank's
dict. ``scenario_all`` runs every scenario in one launch, the one that leaves the process group
broken ("stuck") last. Out-of-memory is simulated above a per-rank size limit.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback
from datetime import timedelta

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CPU_OOM = "DefaultCPUAllocator: can't allocate memory: you tried to allocate {} bytes."


def launch(script, args, world, timeout, env=None):
    """Run ``python script *args`` as ``world`` gloo ranks (dist_workers.RankProcesses). Returns
    (each rank's output, timed_out); after ``timeout`` seconds every rank still running is
    killed."""
    sys.path.insert(0, HERE)
    from dist_workers import RankProcesses, job_environs

    job = RankProcesses([sys.executable, script, *args], job_environs(world, env), merged=True)
    outputs = job.wait(timeout)
    return [out for _, out, _ in outputs], job.timed_out


def run(name, world, timeout=180.0, env=None):
    """Every rank's result dict of ``scenario_<name>``; AssertionError with the logs on failure."""
    env = dict(env or {})
    env.setdefault("NUMGUARD_DIST_TIMEOUT", "4")
    with tempfile.TemporaryDirectory() as tmp:
        logs, timed_out = launch(os.path.abspath(__file__), [name, tmp], world, timeout, env)
        results = [dict(_result(tmp, r), log=logs[r]) for r in range(world)]
    failed = [r for r, res in enumerate(results) if "error" in res]
    if timed_out or failed:
        why = f"timed out after {timeout} s" if timed_out else f"ranks {failed} failed"
        raise AssertionError(f"scenario {name!r} on {world} ranks: {why}" + "".join(
            f"\n--- rank {r} ---\n{res['log'][-4000:]}" for r, res in enumerate(results)))
    return results


def _result(folder, rank):
    path = os.path.join(folder, f"r{rank}.json")
    if not os.path.exists(path):
        return {"error": "no result: the rank was killed or crashed"}
    with open(path) as f:
        return json.load(f)


def tensors_alive_at_each_try(decorate, limit=16):
    """Decorate a function that keeps its activations in a frame the error's traceback holds
    (``except ... as err: saved = err; raise``, a cycle only the collector breaks) and runs out
    of memory above ``limit``; returns how many earlier tries' activations are still alive as
    each try starts. Automatic collection is off meanwhile: the release must not rely on it."""
    import gc
    import weakref

    refs, alive = [], []

    @decorate
    def train(batch_size):
        alive.append(sum(r() is not None for r in refs))
        activations = torch.ones(batch_size, 1024)
        refs.append(weakref.ref(activations))
        try:
            if batch_size > limit:
                raise torch.OutOfMemoryError("CUDA out of memory. (simulated)")
        except torch.OutOfMemoryError as err:
            saved = err  # noqa: F841
            raise
        return batch_size

    gc.disable()
    try:
        train()
    finally:
        gc.enable()
    return alive


def _oom(size, rank):
    return torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {size} MiB (simulated, "
                                  f"rank {rank})")


class OutOfMemoryInBackward(torch.autograd.Function):
    """Identity forward; its backward runs out of memory when the batch is above ``limit``."""

    @staticmethod
    def forward(ctx, x, limit, rank):
        ctx.limit, ctx.rank = limit, rank
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if grad.shape[0] > ctx.limit:
            raise _oom(grad.shape[0], ctx.rank)
        return grad, None, None


class Net(torch.nn.Module):
    def __init__(self, limit, rank):
        super().__init__()
        self.first, self.last = torch.nn.Linear(8, 64), torch.nn.Linear(64, 4)
        self.limit, self.rank = limit, rank

    def forward(self, x):
        return self.last(OutOfMemoryInBackward.apply(self.first(x), self.limit, self.rank))


def ddp_step(batch_size, rank, limit, guard):
    """One DDP training step; returns the all-reduced gradient sums (equal on every rank)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    ddp = DDP(Net(limit, rank), bucket_cap_mb=0.001)   # small buckets: several all_reduces
    if guard:
        from numguard.memory import guard_ddp
        guard_ddp(ddp)
    x = torch.randn(batch_size, 8, generator=torch.Generator().manual_seed(rank))
    ddp(x).square().mean().backward()
    return [round(p.grad.sum().item(), 5) for p in ddp.parameters()]


class NetWithBuffers(Net):
    """Net with a BatchNorm: DDP broadcasts its buffers before each training forward."""

    def __init__(self, limit, rank):
        super().__init__(limit, rank)
        self.norm = torch.nn.BatchNorm1d(64)

    def forward(self, x):
        return self.last(OutOfMemoryInBackward.apply(self.norm(self.first(x)), self.limit,
                                                     self.rank))


def ddp_train(batch_size, rank, limit, where, guard, steps=2, prepare=None):
    """``steps`` DDP training steps; above ``limit`` this rank runs out of memory in the
    backward of step 0 (``where="backward"``) or in its optimizer step (``"optimizer"``: the
    other rank goes on into step 1's forward, where DDP rebuilds its buckets and broadcasts
    buffers). ``prepare(model, optimizer)`` wraps them instead of DDP (accelerator.prepare).
    Returns the parameter sums after the steps (equal on every rank)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    net = NetWithBuffers(limit if where == "backward" else 10**9, rank)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    if prepare is not None:
        model, opt = prepare(net, opt)
    else:
        model = DDP(net, bucket_cap_mb=0.001)   # small buckets: several all_reduces
    if guard:
        from numguard.memory import guard_ddp
        guard_ddp(model)
    gen = torch.Generator().manual_seed(rank)
    for step in range(steps):
        opt.zero_grad()
        model(torch.randn(batch_size, 8, generator=gen)).square().mean().backward()
        if where == "optimizer" and step == 0 and batch_size > limit:
            raise _oom(batch_size, rank)   # as Adam's first step allocating its state
        opt.step()
    return [round(p.detach().sum().item(), 4) for p in model.parameters()]


def _search(rank, step):
    """Decorate ``step(batch_size)`` (halving from 128); returns what the tests compare."""
    import numguard

    tried = []

    @numguard.find_executable_batch_size(starting_batch_size=128, reduction=0.5)
    def train(batch_size):
        tried.append(batch_size)
        return step(batch_size)

    return _catch(train) | {"tried": tried}


def scenario_ddp_optimizer(rank, world):
    """guard_ddp in place; rank 1 runs out of memory in the optimizer step of step 0."""
    from torch.distributed import distributed_c10d as c10d

    before = c10d._world.group_count
    res = _search(rank, lambda b: ddp_train(b, rank, 1000 if rank == 0 else 40, "optimizer",
                                            guard=True))
    return res | {"groups_before": before, "groups_after": c10d._world.group_count}


def scenario_plain_ddp_backward(rank, world):
    """A plain DDP model built inside the function (no guard_ddp); rank 1 out in backward."""
    return _search(rank, lambda b: ddp_train(b, rank, 1000 if rank == 0 else 40, "backward",
                                             guard=False))


def scenario_plain_ddp_optimizer(rank, world):
    return _search(rank, lambda b: ddp_train(b, rank, 1000 if rank == 0 else 40, "optimizer",
                                             guard=False))


def scenario_eval_on_rank0(rank, world):
    """After the search's training step, rank 0 alone evaluates the DDP model under no_grad
    (DDP communicates nothing there): numguard must not wait for rank 1 in that forward."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    def step(batch_size):
        torch.manual_seed(0)
        ddp = DDP(Net(1000 if rank == 0 else 40, rank), bucket_cap_mb=0.001)
        for _ in range(2):   # the second forward rebuilds the buckets
            ddp(torch.randn(batch_size, 8)).square().mean().backward()
        if rank == 0:
            with torch.no_grad():
                ddp(torch.randn(batch_size, 8))
        return batch_size

    return _search(rank, step)


def scenario_accelerate_prepare(rank, world):
    """Accelerate's recipe: accelerator.prepare inside the decorated function, nothing else."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)

    def prepare(model, optimizer):
        return accelerator.prepare(model, optimizer)

    res = _search(rank, lambda b: ddp_train(b, rank, 1000 if rank == 0 else 40, "backward",
                                            guard=False, prepare=prepare))
    return res | {"distributed_type": str(accelerator.distributed_type)}


def _catch(fn):
    try:
        return {"ok": fn()}
    except Exception as exc:  # noqa: BLE001 - the tests inspect it
        return {"exc": type(exc).__name__, "msg": str(exc), "rank": getattr(exc, "rank", None),
                "oom": getattr(exc, "out_of_memory", None)}


def scenario_ddp_backward(rank, world):
    import numguard

    tried, ooms = [], [0]

    @numguard.find_executable_batch_size(starting_batch_size=128, reduction=0.5)
    def train(batch_size):
        tried.append(batch_size)
        try:
            return ddp_step(batch_size, rank, 1000 if rank == 0 else 40, guard=True)
        except torch.OutOfMemoryError:
            ooms[0] += 1
            raise

    result = train()
    # outside a search the hook is DDP's default all_reduce: same gradients as without it
    hook_alone = ddp_step(16, rank, 1000, guard=True) == ddp_step(16, rank, 1000, guard=False)
    return {"tried": tried, "size": train.finder.batch_size, "result": result, "ooms": ooms[0],
            "hook_alone_matches": hook_alone}


def scenario_after_success(rank, world):
    """A size that ran once, then runs out of memory on rank 1: raised, not retried."""
    import numguard

    limit, calls = [100], []

    @numguard.find_executable_batch_size(starting_batch_size=32)
    def train(batch_size):
        calls.append(batch_size)
        if batch_size > limit[0]:
            raise _oom(batch_size, rank)
        return batch_size

    first = train()
    if rank == 1:
        limit[0] = 10
    return {"first": first, "second": _catch(train), "calls": calls}


def scenario_global_batch(rank, world):
    import numguard

    calls = []

    @numguard.find_executable_batch_size(starting_batch_size=128, global_batch_size=96,
                                         reduction=0.5)
    def train(batch_size, accumulation_steps):
        calls.append([batch_size, accumulation_steps])
        if batch_size > (100 if rank == 0 else 20):
            raise _oom(batch_size, rank)
        return batch_size, accumulation_steps

    size, accum = train()
    return {"calls": calls, "size": size, "accum": accum}


def scenario_non_oom(rank, world):
    import numguard

    calls = []

    @numguard.find_executable_batch_size(starting_batch_size=32)
    def train(batch_size):
        calls.append(batch_size)
        if rank == 1:
            raise ValueError("bad batch on rank 1")
        return batch_size

    return _catch(train) | {"calls": len(calls)}


def scenario_binary(rank, world):
    import numguard

    tried = []

    @numguard.find_executable_batch_size(starting_batch_size=128, search="binary", reduction=0.5)
    def train(batch_size):
        tried.append(batch_size)
        if batch_size > (100 if rank == 0 else 70):
            raise RuntimeError(CPU_OOM.format(batch_size << 20))
        return batch_size

    return {"size": train(), "tried": tried}


def scenario_minimum(rank, world):
    import numguard

    tried = []

    @numguard.find_executable_batch_size(starting_batch_size=16, minimum_batch_size=4,
                                         reduction=0.5)
    def train(batch_size):
        tried.append(batch_size)
        if rank == 0:
            raise _oom(batch_size, rank)
        return batch_size

    return _catch(train) | {"tried": tried}


def scenario_stuck(rank, world):
    """Rank 1 runs out of memory while rank 0 waits in a plain all_reduce (no DDP hook)."""
    import torch.distributed as dist

    import numguard

    @numguard.find_executable_batch_size(starting_batch_size=8)
    def train(batch_size):
        if rank == 1:
            raise _oom(batch_size, rank)
        t = torch.ones(batch_size)
        dist.all_reduce(t)
        return t.sum().item()

    return _catch(train)


def scenario_all(rank, world):
    out = {}
    for name in ("ddp_backward", "ddp_optimizer", "plain_ddp_backward", "plain_ddp_optimizer",
                 "eval_on_rank0", "global_batch", "non_oom", "after_success", "binary", "minimum",
                 "stuck"):
        out[name] = globals()["scenario_" + name](rank, world)
    return out


def main(name, out_dir):
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    try:
        # The user's own group timeout: longer than NUMGUARD_DIST_TIMEOUT, as in real jobs.
        dist.init_process_group("gloo", timeout=timedelta(seconds=60))
        result = globals()["scenario_" + name](rank, dist.get_world_size())
    except BaseException:  # noqa: BLE001
        result = {"error": traceback.format_exc()}
    with open(os.path.join(out_dir, f"r{rank}.json.tmp"), "w") as f:
        json.dump(result, f)
    os.replace(os.path.join(out_dir, f"r{rank}.json.tmp"), os.path.join(out_dir, f"r{rank}.json"))
    if rank == 0:  # rank 0 hosts the store: stay until every rank has written its result
        world = int(os.environ["WORLD_SIZE"])
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all(
                os.path.exists(os.path.join(out_dir, f"r{r}.json")) for r in range(world)):
            time.sleep(0.05)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # a rank abandoned in a collective must not hang in the group's destructor


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
