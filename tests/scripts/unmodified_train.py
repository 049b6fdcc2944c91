"""A small training script that knows nothing of numguard (it never imports it).

It trains a tiny MLP in fp16 and, at step --overflow-at, scales a weight so that the next forward
overflows fp16 (Inf, then NaN). Run as one process, or as several ranks of a gloo job (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT set, as torchrun does).

    python unmodified_train.py [--steps N] [--overflow-at K] [--overflow-rank R] [--nan-grad-at K]
                               [--print-modules]

Prints "step N loss X" per step and "finished N steps" at the end (exit status 0).
"""
import argparse
import os
import sys

import torch
from torch import nn


class NaNGradient(torch.autograd.Function):
    """Identity forward; NaN gradient backward (a backward-only failure)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.broken = False

    def forward(self, x):
        return NaNGradient.apply(x) if self.broken else x


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--overflow-at", type=int, default=-1)
    parser.add_argument("--overflow-rank", type=int, default=None,
                        help="only this rank overflows (default: every rank)")
    parser.add_argument("--nan-grad-at", type=int, default=-1)
    parser.add_argument("--print-modules", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo")
    dtype = torch.float16
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), Gate(), nn.Linear(16, 4)).to(dtype)
    model = net
    if world > 1:
        model = nn.parallel.DistributedDataParallel(net)
    loss_fn = nn.MSELoss()
    optimizer = torch.optim.SGD(net.parameters(), lr=1e-3)
    x = torch.randn(32, 8, dtype=dtype)
    target = torch.randn(32, 4, dtype=dtype)
    for step in range(args.steps):
        if step == args.overflow_at and args.overflow_rank in (None, rank):
            with torch.no_grad():
                net[3].weight.fill_(3e4)
        net[2].broken = step == args.nan_grad_at
        out = model(x)
        loss = loss_fn(out.float(), target.float())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print(f"step {step} loss {loss.item():.4f}", flush=True)
    if args.print_modules:
        print("numguard imported:", "numguard" in sys.modules, flush=True)
    if world > 1:
        torch.distributed.destroy_process_group()
    print(f"finished {args.steps} steps", flush=True)


if __name__ == "__main__":
    main()
