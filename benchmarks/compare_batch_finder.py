"""Accelerate's find_executable_batch_size next to numguard's, on the same simulated two-rank cases.

    .venv/bin/python benchmarks/compare_batch_finder.py [--timeout 40]

Cases (out-of-memory simulated above a per-rank size limit: rank 0 fits anything, rank 1 fits 40):
  plain     no collective in the step: what size (and result) each rank ends with;
  ddp       a two-rank gloo DDP step; rank 1 runs out inside a custom autograd Function's
            backward while rank 0 goes on to the gradient all_reduce;
  ddp-nohook  numguard without the user's guard_ddp(model): a DDP model built inside the
            decorated function is guarded all the same (NUMGUARD_DIST_TIMEOUT=4);
  release   one process: tensors of the failed try still alive when the retry starts.
Every two-rank case runs under a hard timeout; a rank still running then is reported as hung.
Prints a table and writes benchmarks/results/compare_batch_finder.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))
import memory_workers  # noqa: E402

LIMITS = {0: 10**6, 1: 40}


def decorator(lib):
    if lib == "accelerate":
        from accelerate.utils import find_executable_batch_size
    else:
        from numguard import find_executable_batch_size
    return find_executable_batch_size(starting_batch_size=128)


def worker(lib, case, out_dir):
    """One rank of one case; writes r<rank>.json (a rank that hangs writes nothing)."""
    from datetime import timedelta

    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    tried = []

    @decorator(lib)
    def train(batch_size):
        tried.append(batch_size)
        if case == "plain":
            if batch_size > LIMITS[rank]:
                raise torch.OutOfMemoryError("CUDA out of memory. (simulated)")
            return batch_size
        return memory_workers.ddp_step(batch_size, rank, LIMITS[rank], guard=case == "ddp"
                                       and lib == "numguard")

    try:
        res = {"result": train(), "tried": tried}
    except Exception as exc:  # noqa: BLE001 - reported in the table
        text = str(exc).splitlines()[0].replace("numguard.find_executable_batch_size: ", "")
        res = {"exc": f"{type(exc).__name__}: {text.split(';')[0].split(' (')[0][:60]}",
               "tried": tried, "message": str(exc)}
    with open(os.path.join(out_dir, f"r{rank}.json"), "w") as f:
        json.dump(res, f)
    sys.stdout.flush()
    os._exit(0)


def two_ranks(lib, case, timeout):
    import tempfile

    env = {"NUMGUARD_DIST_TIMEOUT": "4"}
    with tempfile.TemporaryDirectory() as tmp:
        _, timed_out = memory_workers.launch(os.path.abspath(__file__),
                                             ["--worker", lib, case, tmp], 2, timeout, env)
        ranks = []
        for r in range(2):
            path = os.path.join(tmp, f"r{r}.json")
            ranks.append(json.load(open(path)) if os.path.exists(path) else None)
    return {"ranks": ranks, "timed_out": timed_out}


def describe(rank_result, timeout):
    if rank_result is None:
        return f"hung (killed after {timeout:g} s)"
    tried = rank_result["tried"]
    if "exc" in rank_result:
        return f"raised {rank_result['exc']} (tried {tried})"
    value = rank_result["result"]
    shown = tried[-1] if isinstance(value, list) else value
    return f"size {shown} (tried {tried})"


def release(lib):
    """Tensors of failed tries still alive when each retry starts (one process)."""
    return memory_workers.tensors_alive_at_each_try(decorator(lib), limit=16)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--timeout", type=float, default=40.0, help="hard limit per two-rank launch (s)")
    ap.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    rows, table = {}, []
    for case in ("plain", "ddp", "ddp-nohook"):
        for lib in ("accelerate", "numguard"):
            if case == "ddp-nohook" and lib == "accelerate":
                continue  # the same run as "ddp" for Accelerate (it has no hook)
            res = two_ranks(lib, case, args.timeout)
            rows[f"{case}/{lib}"] = res
            r0, r1 = (describe(r, args.timeout) for r in res["ranks"])
            both = res["ranks"]
            same = (None not in both and all("result" in r for r in both)
                    and both[0]["result"] == both[1]["result"])
            table.append((case, lib, r0, r1, "yes" if same else "no"))
    for lib in ("accelerate", "numguard"):
        alive = release(lib)
        rows[f"release/{lib}"] = {"alive_at_each_try": alive}
        table.append(("release", lib, f"failed tries' tensors alive at each try: {alive}", "", ""))
    head = ("case", "library", "rank 0", "rank 1", "same result")
    widths = [max(len(str(r[i])) for r in table + [head]) for i in range(5)]
    for r in [head] + table:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip())
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    path = os.path.join(HERE, "results", "compare_batch_finder.json")
    with open(path, "w") as f:
        json.dump({"limits": LIMITS, "timeout_s": args.timeout, "torch": torch.__version__,
                   "cases": rows}, f, indent=1)
    print(f"\nwrote {os.path.relpath(path, ROOT)}")


if __name__ == "__main__":
    main()
