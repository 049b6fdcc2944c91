"""Launch multi-rank scenarios for the distributed tests: one subprocess per rank (gloo, loopback,
a free port), a hard timeout for the whole group, results as JSON per rank.

A scenario is a function ``scenario_<name>(rank, world) -> dict`` in this file; the parent calls
:func:`run_scenario` and gets the list of per-rank dicts (or a failure with every rank's output).
Workers leave with ``os._exit`` so a rank abandoned in a collective cannot hang the test.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_environ(base: dict, rank: int, world: int, port: int, **variables) -> dict:
    """`base` plus what torchrun sets for `rank` of a one-node job of `world` ranks."""
    return dict(base, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                **variables)


class RankProcesses:
    """The one multi-rank launcher of the tests: one process per rank (``environs[r]``; None: rank
    ``r`` is absent), each writing to files (never pipes: a rank that prints a lot cannot block
    while the parent waits on another), all waited for under one deadline.

    ``merged``: stdout and stderr in one log, in the order written (``out``; ``err`` is "")."""

    def __init__(self, argv: list, environs: list, cwd: str = ROOT, merged: bool = False):
        self.world = len(environs)
        self.tmp = tempfile.TemporaryDirectory()
        self.merged = merged
        self.procs = [None] * self.world
        self.files = [None] * self.world
        for r, environ in enumerate(environs):
            if environ is None:
                continue
            out = open(os.path.join(self.tmp.name, f"out{r}.txt"), "w+")
            err = subprocess.STDOUT if merged else open(os.path.join(self.tmp.name, f"err{r}.txt"), "w+")
            self.files[r] = (out, err)
            self.procs[r] = subprocess.Popen(argv, env=environ, cwd=cwd, stdout=out, stderr=err, text=True)
        self.start = time.monotonic()
        self.ended_s = [None] * self.world
        self.timed_out = False

    def wait(self, timeout: float) -> list:
        """[(exit status, stdout, stderr) or None for an absent rank] by rank. After `timeout`
        seconds every rank still running is killed and ``timed_out`` is set (its status is then
        the kill's)."""
        deadline = self.start + timeout
        try:
            while any(p is not None and self.ended_s[r] is None for r, p in enumerate(self.procs)):
                for r, p in enumerate(self.procs):
                    if p is not None and self.ended_s[r] is None and p.poll() is not None:
                        self.ended_s[r] = time.monotonic() - self.start
                if time.monotonic() > deadline:
                    self.timed_out = True
                    break
                time.sleep(0.02)
        finally:
            for p in self.procs:
                if p is not None and p.poll() is None:
                    p.kill()
            for p in self.procs:
                if p is not None:
                    p.wait()
        results = []
        for r, p in enumerate(self.procs):
            if p is None:
                results.append(None)
                continue
            texts = []
            for f in self.files[r]:
                if f is subprocess.STDOUT:
                    texts.append("")
                    continue
                f.seek(0)
                texts.append(f.read())
                f.close()
            results.append((p.returncode, *texts))
        self.tmp.cleanup()
        return results


def job_environs(world: int, env: dict | None = None, rank_env: dict | None = None, absent=(),
                 port: int | None = None, base: dict | None = None) -> list:
    """The environments of a one-node job of `world` ranks on a free port (rank_environ), with
    this checkout first on PYTHONPATH; `env` for every rank, `rank_env[r]` for rank r; ranks in
    `absent` get None (not started)."""
    base = dict(os.environ if base is None else base)
    base.update(OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + base.get("PYTHONPATH", ""))
    port = port or free_port()
    environs = []
    for r in range(world):
        environ = None
        if r not in absent:
            environ = rank_environ(base, r, world, port)
            environ.update(env or {})
            environ.update((rank_env or {}).get(r, {}))
        environs.append(environ)
    return environs


def run_rank_processes(argv: list, environs: list, cwd: str, timeout: float = 240) -> list:
    """Run one process per rank (`environs[r]`) under `timeout` (RankProcesses); returns
    [(exit status, stdout, stderr)] by rank, or an AssertionError with every rank's output when
    the timeout passed."""
    job = RankProcesses(argv, environs, cwd)
    results = job.wait(timeout)
    if job.timed_out:
        raise AssertionError(f"ranks still running after {timeout} s were killed:\n" + "\n".join(
            f"--- rank {r} ---\n{out[-3000:]}\n{err[-3000:]}" for r, (_, out, err) in enumerate(results)))
    return results


def run_worker_file(path: str, scenario: str, world: int, timeout: float = 150) -> list:
    """Run ``python <path> <scenario>`` on `world` gloo ranks; each rank writes its result as JSON
    to $NG_OUT (scratch folder: $NG_TMP). The per-rank results, or an AssertionError with the
    output of a rank that failed."""
    with tempfile.TemporaryDirectory() as tmp:
        environs = job_environs(world, env={"NG_TMP": tmp},
                                rank_env={r: {"NG_OUT": os.path.join(tmp, f"r{r}.json")} for r in range(world)})
        results = run_rank_processes([sys.executable, os.path.abspath(path), scenario], environs,
                                     cwd=ROOT, timeout=timeout)
        out = []
        for r, (code, stdout, stderr) in enumerate(results):
            if code != 0:
                raise AssertionError(f"rank {r} of {scenario} exited {code}:\n{stdout}\n{stderr[-4000:]}")
            with open(os.path.join(tmp, f"r{r}.json")) as f:
                out.append(json.load(f))
        return out


def kept_messages(logger_name: str) -> list:
    """A list that gets the message of every record logged to `logger_name` from now on."""
    import logging

    kept = []

    class Keep(logging.Handler):
        def emit(self, record):
            kept.append(record.getMessage())
    logging.getLogger(logger_name).addHandler(Keep())
    return kept


def finish_rank(result: dict) -> None:
    """The end of a :func:`run_worker_file` rank: write `result` to $NG_OUT, meet the other
    ranks, tear the process group down and leave at once."""
    import torch.distributed as dist
    with open(os.environ["NG_OUT"], "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


class ScenarioFailed(AssertionError):
    pass


class Launch:
    """One scenario's ranks, started by :func:`start_scenario`; :meth:`finish` waits for them."""

    def __init__(self, name: str, world: int, timeout: float, env: dict | None,
                 rank_env: dict | None):
        self.name, self.world, self.timeout = name, world, timeout
        self.tmp = tempfile.TemporaryDirectory()
        self.job = RankProcesses(
            [sys.executable, os.path.abspath(__file__), name], [
                dict(environ, NG_RESULT=self._path(f"r{r}.json"))
                for r, environ in enumerate(job_environs(world, env, rank_env))], merged=True)

    def _path(self, name: str) -> str:
        return os.path.join(self.tmp.name, name)

    def finish(self, allow_failure: bool = False) -> list[dict]:
        """Per-rank result dicts, each with ``log``, ``ended_s`` and ``returncode``. Raises
        ScenarioFailed on a timeout, and (unless ``allow_failure``) when a rank failed or left no
        result; with ``allow_failure`` a rank without a result gets ``{}``."""
        outputs = self.job.wait(self.timeout)
        logs = [out for _, out, _ in outputs]
        results = []
        for r in range(self.world):
            path = self._path(f"r{r}.json")
            results.append(json.load(open(path)) if os.path.exists(path) else None)
        self.tmp.cleanup()
        failed = any(res is None or "error" in res for res in results)
        if self.job.timed_out or (failed and not allow_failure):
            detail = "\n".join(f"--- rank {r} ---\n{logs[r][-4000:]}" for r in range(self.world))
            why = f"timed out after {self.timeout} s" if self.job.timed_out else "a rank failed"
            raise ScenarioFailed(f"scenario {self.name!r} on {self.world} ranks: {why}\n{detail}")
        results = [res if res is not None else {} for res in results]
        for r, res in enumerate(results):
            res["log"] = logs[r]
            res["ended_s"] = self.job.ended_s[r]
            res["returncode"] = outputs[r][0]
        return results


def start_scenario(name: str, world: int, timeout: float = 90.0, env: dict | None = None,
                   rank_env: dict | None = None) -> Launch:
    """Start ``scenario_<name>`` on ``world`` ranks (see :class:`Launch`)."""
    return Launch(name, world, timeout, env, rank_env)


def run_scenario(name: str, world: int, timeout: float = 90.0, env: dict | None = None,
                 rank_env: dict | None = None) -> list[dict]:
    """Run ``scenario_<name>`` on ``world`` ranks; kill everything after ``timeout`` seconds."""
    return start_scenario(name, world, timeout, env, rank_env).finish()


# ---------------------------------------------------------------------------------------------
# worker side: scenarios (each runs on every rank; keys of the returned dict are compared by the
# tests in test_distributed*.py)

def _init():
    import torch.distributed as dist

    dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def _catch(fn):
    """Run fn; return {"ok": result} or {"exc": type name, "msg": message}."""
    try:
        return {"ok": fn()}
    except Exception as exc:  # noqa: BLE001 - the tests inspect it
        return {"exc": type(exc).__name__, "msg": str(exc)}


def scenario_shapes(rank, world):
    """check_shapes on 2 ranks: mismatches of every kind, matching nested structures."""
    import torch

    import numguard.distributed as ngd

    res = {}
    op = "torch.distributed.all_reduce"
    res["shape"] = _catch(lambda: ngd.check_shapes(
        torch.zeros(1, 5) if rank == 0 else torch.zeros(1, 2, 5), op=op))
    res["numel"] = _catch(lambda: ngd.check_shapes(
        torch.zeros(2, 5) if rank == 0 else torch.zeros(1, 10), op=op))
    res["dtype"] = _catch(lambda: ngd.check_shapes(
        torch.zeros(1, 5) if rank == 0 else torch.zeros(1, 5, dtype=torch.bfloat16), op=op))
    nested = {"ids": torch.zeros(4, 7, dtype=torch.int64), "extra": None,
              "pair": (torch.zeros(3), [torch.zeros(2, 2, dtype=torch.float16), 1.5]),
              "step": 3}
    # Scalar values may differ; only their types are compared.
    nested_here = dict(nested, step=3 + rank)
    res["nested_match"] = _catch(lambda: ngd.check_shapes(nested_here, op="nested"))
    deep = dict(nested, pair=(torch.zeros(3), [torch.zeros(2, 2 + rank, dtype=torch.float16), 1.5]))
    res["nested_leaf"] = _catch(lambda: ngd.check_shapes(deep, op="nested"))
    extra = dict(nested)
    if rank == 1:
        extra["mask"] = torch.zeros(4, 7)
    res["nested_structure"] = _catch(lambda: ngd.check_shapes(extra, op="nested"))
    res["tuple_vs_list"] = _catch(lambda: ngd.check_shapes(
        (torch.zeros(2),) if rank == 0 else [torch.zeros(2)], op="containers"))
    res["op_differs"] = _catch(lambda: ngd.check_shapes(
        torch.zeros(3), op="torch.distributed.all_reduce" if rank == 0 else
        "torch.distributed.broadcast"))
    # structure: dict keys (and their order), nested dicts, list lengths, leaf types
    res["keys_differ"] = _catch(lambda: ngd.check_shapes(
        {"a": torch.zeros(2), ("b" if rank == 0 else "c"): torch.zeros(2)}, op="keys"))
    ab = {"a": torch.zeros(2), "b": torch.zeros(2)}
    reordered = ab if rank == 0 else {"b": ab["b"], "a": ab["a"]}
    res["key_order"] = _catch(lambda: ngd.check_shapes(reordered, op="keys"))
    res["key_order_off"] = _catch(lambda: ngd.check_shapes(reordered, op="keys", key_order=False))
    res["nested_keys"] = _catch(lambda: ngd.check_shapes(
        {"out": {"logits": torch.zeros(2), ("loss" if rank == 0 else "aux"): torch.zeros(())}},
        op="keys"))
    res["list_length"] = _catch(lambda: ngd.check_shapes(
        {"xs": [torch.zeros(2)] * (2 + rank)}, op="lists"))
    res["tensor_vs_scalar"] = _catch(lambda: ngd.check_shapes(
        {"x": torch.zeros(2) if rank == 0 else 2.0}, op="leaves"))
    many = [torch.zeros(3, 4) for _ in range(200)]  # more tokens than fit in the record
    res["large_match"] = _catch(lambda: ngd.check_shapes(many, op="many"))
    many_late = [torch.zeros(3, 4) for _ in range(199)] + [torch.zeros(3, 4 + rank)]
    res["large_late_mismatch"] = _catch(lambda: ngd.check_shapes(many_late, op="many"))
    res["after_mismatches"] = _catch(lambda: ngd.check_shapes(torch.ones(2), op="again"))
    return res


def scenario_guard(rank, world):
    """guard_collectives on 2 ranks: every collective matching (results correct), mismatching
    (raises before the collective), idempotent install, undo."""
    import torch
    import torch.distributed as dist

    import numguard.distributed as ngd

    originals = {n: getattr(dist, n) for n in ("all_reduce", "broadcast", "all_gather")}
    g1 = ngd.guard_collectives(timeout=20)
    g2 = ngd.guard_collectives()
    res = {"same_handle": g1 is g2, "names": g1.names,
           "wrapped": dist.all_reduce is not originals["all_reduce"]}
    ok = {}

    def matching():
        t = torch.full((3,), float(rank + 1))
        dist.all_reduce(t)
        ok["all_reduce"] = t.tolist()
        b = torch.full((2,), float(rank))
        dist.broadcast(b, src=1)
        ok["broadcast"] = b.tolist()
        rd = torch.full((2,), float(rank + 1))
        dist.reduce(rd, dst=0)
        ok["reduce"] = rd.tolist() if rank == 0 else None
        outs = [torch.zeros(2) for _ in range(world)]
        dist.all_gather(outs, torch.full((2,), float(rank)))
        ok["all_gather"] = [o.tolist() for o in outs]
        flat = torch.zeros(world * 2)
        dist.all_gather_into_tensor(flat, torch.full((2,), float(rank)))
        ok["all_gather_into_tensor"] = flat.tolist()
        rs = torch.zeros(2)
        dist.reduce_scatter_tensor(rs, torch.arange(world * 2, dtype=torch.float32))
        ok["reduce_scatter_tensor"] = rs.tolist()
        gl = [torch.zeros(2) for _ in range(world)] if rank == 0 else None
        dist.gather(torch.full((2,), float(rank)), gather_list=gl, dst=0)
        ok["gather"] = [x.tolist() for x in gl] if gl else None
        sc = torch.zeros(2)
        sl = [torch.full((2,), float(i)) for i in range(world)] if rank == 0 else None
        dist.scatter(sc, scatter_list=sl, src=0)
        ok["scatter"] = sc.tolist()
        # all_to_all_single with uneven split sizes: first dims differ between ranks.
        in_splits = [1, 2] if rank == 0 else [3, 1]
        out_splits = [1, 3] if rank == 0 else [2, 1]
        inp = torch.full((sum(in_splits), 2), float(rank))
        out = torch.zeros(sum(out_splits), 2)
        dist.all_to_all_single(out, inp, out_splits, in_splits)
        ok["all_to_all_single"] = out[:, 0].tolist()
        w = dist.all_reduce(torch.ones(1), async_op=True)
        w.wait()
        return True

    res["matching"] = _catch(matching)
    res["results"] = ok

    def bad(name):
        def f():
            if name == "all_reduce":
                dist.all_reduce(torch.zeros(1, 5) if rank == 0 else torch.zeros(1, 2, 5))
            elif name == "broadcast":
                dist.broadcast(torch.zeros(3) if rank == 0 else torch.zeros(4), src=0)
            elif name == "reduce":
                dist.reduce(torch.zeros(3, dtype=torch.float32 if rank == 0 else torch.float64), dst=0)
            elif name == "all_gather":
                dist.all_gather([torch.zeros(2, 5) for _ in range(world)],
                                torch.zeros(2, 5) if rank == 0 else torch.zeros(1, 10))
            elif name == "all_gather_into_tensor":
                dist.all_gather_into_tensor(torch.zeros(world * 2), torch.zeros(2 + rank))
            elif name == "reduce_scatter_tensor":
                dist.reduce_scatter_tensor(torch.zeros(2), torch.zeros(world * 2 + rank))
            elif name == "gather":
                dist.gather(torch.zeros(2, dtype=torch.bfloat16 if rank else torch.float32),
                            gather_list=[torch.zeros(2) for _ in range(world)] if rank == 0 else None)
            elif name == "scatter":
                dist.scatter(torch.zeros(2 + rank),
                             scatter_list=[torch.zeros(2) for _ in range(world)] if rank == 0 else None)
            elif name == "all_to_all_single":
                dist.all_to_all_single(torch.zeros(4, 3 + rank), torch.zeros(4, 3 + rank),
                                       [2, 2], [2, 2])
            elif name == "all_gather_own_entry":
                # uneven output list (as NCCL allows); rank 1 contributes the wrong size
                outs = [torch.zeros(2), torch.zeros(3)]
                dist.all_gather(outs, torch.zeros(2 if rank == 0 else 4))
            elif name == "broadcast_src":
                dist.broadcast(torch.zeros(3), src=rank)
            elif name == "all_reduce_op":
                dist.all_reduce(torch.zeros(3), op=dist.ReduceOp.SUM if rank == 0 else dist.ReduceOp.MAX)
        return f

    res["bad"] = {n: _catch(bad(n)) for n in ("all_reduce", "broadcast", "reduce", "all_gather",
                                               "all_gather_into_tensor", "reduce_scatter_tensor",
                                               "gather", "scatter", "all_to_all_single",
                                               "broadcast_src", "all_reduce_op",
                                               "all_gather_own_entry")}
    g1.remove()
    g1.remove()
    res["restored"] = all(getattr(dist, n) is f for n, f in originals.items())
    with ngd.guard_collectives() as g3:
        res["context_wrapped"] = dist.all_reduce is not originals["all_reduce"]
        res["new_handle"] = g3 is not g1
    res["context_restored"] = dist.all_reduce is originals["all_reduce"]
    t = torch.ones(2)
    dist.all_reduce(t)
    res["unguarded_after"] = t.tolist()
    return res


def scenario_shapes_and_guard(rank, world):
    """Both 2-rank groups in one launch."""
    return {"shapes": scenario_shapes(rank, world), "guard": scenario_guard(rank, world)}


def scenario_missing(rank, world):
    """The last rank never reaches the check; the others must name it within the timeout."""
    import torch

    import numguard.distributed as ngd

    last = world - 1
    if rank == last:
        # Stays alive, never joins the collective, until the other ranks have left (an event, not
        # a time: their start-up can take many seconds on a loaded machine), at most 45 s.
        return {"skipped": True, "linger_until_others_leave": 45}
    import torch.distributed as dist

    ngd.guard_collectives()  # timeout from NUMGUARD_DIST_TIMEOUT
    t0 = time.monotonic()
    r = _catch(lambda: dist.all_reduce(torch.zeros(3)))
    r["elapsed"] = time.monotonic() - t0
    return {"check": r, "exit_normally": True}


def scenario_world4(rank, world):
    """4 ranks: one rank deviates; in-order logging with different levels; triggers."""
    import logging

    import torch

    import numguard.distributed as ngd

    res = {}
    res["one_dtype_differs"] = _catch(lambda: ngd.check_shapes(
        {"x": torch.zeros(2, 3, dtype=torch.bfloat16 if rank == 2 else torch.float32)},
        op="torch.distributed.all_reduce"))

    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    levels = {0: "INFO", 1: "WARNING", 2: "debug", 3: logging.ERROR}
    log = ngd.get_logger("numguard.test.ordered", log_level=levels[rank])
    log.logger.addHandler(Keep())
    log.logger.propagate = False
    log.info("info from rank %d", rank, in_order=True)
    log.warning("warning from rank %d", rank, in_order=True)
    log.debug("debug from rank %d", rank, in_order=True)
    log.info("main only from rank %d", rank)
    log.error("every rank %d", rank, main_process_only=False)
    res["records"] = list(records)
    # NUMGUARD_LOG_LEVEL=WARNING is set for this scenario: a logger without log_level uses it.
    env_log = ngd.get_logger("numguard.test.env")
    res["env_level"] = env_log.logger.level

    res["trigger_none"] = ngd.check_trigger()
    if rank == 3:
        ngd.set_trigger()
    res["trigger_seen"] = ngd.check_trigger()
    res["trigger_reset"] = ngd.check_trigger()
    if rank == 1:
        ngd.set_trigger()
    res["nb_first"] = ngd.check_trigger(blocking=False)
    res["nb_second"] = ngd.check_trigger(blocking=False)
    res["nb_third"] = ngd.check_trigger(blocking=False)
    res["nb_drain"] = ngd.check_trigger()
    # Coordination helpers the inspector uses.
    flags = ngd.exchange_trip(torch.tensor(1 if rank in (1, 3) else 0))
    res["trip_flags"] = flags.tolist()
    res["trip_flags_nb"] = ngd.exchange_trip(torch.tensor(rank == 0), blocking=False).tolist()
    res["trip_details"] = ngd.gather_trip_details(
        f"model.layers.{rank}.mlp" if rank in (1, 3) else None, 2)
    res["long_name"] = ngd.gather_trip_details("m" * 1000 if rank == 0 else None, 0)
    # Subgroups: every rank creates both; ranks 0,1 agree, ranks 2,3 do not.
    import torch.distributed as dist

    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = groups[rank // 2]
    res["subgroup"] = _catch(lambda: ngd.check_shapes(
        torch.zeros(5 if rank != 3 else 6), op="sub", group=mine))
    return res


def scenario_trip(rank, world):
    """numguard.watch on every rank; rank 1 plants a NaN in batch 2. Every rank must raise
    NonFiniteError in batch 2, naming rank 1 and its module; rank 1 carries the full report."""
    import io

    import torch

    import numguard

    torch.manual_seed(0)
    from collections import OrderedDict

    model = torch.nn.Sequential(OrderedDict(
        proj=torch.nn.Linear(4, 8), act=torch.nn.ReLU(), head=torch.nn.Linear(8, 2)))
    report_stream = io.StringIO()
    insp = numguard.watch(model, report_to=report_stream)
    res = {"batches_done": []}
    try:
        for batch in range(4):
            x = torch.randn(3, 4)
            if rank == 1 and batch == 2:
                x[0, 0] = float("nan")
            try:
                model(x)
            except numguard.NonFiniteError as exc:
                res["raised_in_batch"] = batch
                res["message"] = str(exc)
                res["batch_number"] = exc.batch_number
                res["module"] = exc.module
                res["ranks"] = list(exc.ranks)
                res["rank"] = exc.rank
                res["report"] = exc.report
                break
            res["batches_done"].append(batch)
    finally:
        insp.close()
    res["printed"] = report_stream.getvalue()
    return res


def scenario_eval_on_rank0(rank, world):
    """Rank 0 alone evaluates (no_grad) before training; then both ranks train and rank 1 plants a
    NaN in its second training batch. The evaluation must not join the cross-rank exchange, so
    both ranks still raise in the same training step."""
    import torch

    import numguard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    insp = numguard.watch(model, report_to=None)
    res = {"train_steps_done": []}
    try:
        if rank == 0:
            with torch.no_grad():
                for _ in range(2):
                    model(torch.randn(3, 4))
        for step in range(3):
            x = torch.randn(3, 4)
            if rank == 1 and step == 1:
                x[0, 0] = float("nan")
            try:
                model(x).sum().backward()
            except numguard.NonFiniteError as exc:
                res["raised_in_step"] = step
                res["ranks"] = list(exc.ranks)
                break
            res["train_steps_done"].append(step)
    finally:
        insp.close()
    return res


# ---------------------------------------------------------------------------------------------
# Robustness scenarios (tests/test_distributed_robustness.py)

EXIT_VARIANTS = ("dist", "c10d", "imported_early", "subgroup_first", "no_destroy")


def scenario_exit_after_destroy(rank, world):
    """Use everything numguard keeps per group (its own group, a subgroup's state, a pending
    non-blocking trigger check, a trip exchange), then destroy the process group the way
    NG_EXIT_VARIANT says and leave through normal interpreter shutdown: the exit status must
    be 0."""
    import torch
    import torch.distributed as dist
    from torch.distributed import destroy_process_group as destroy_imported_early
    from torch.distributed import distributed_c10d

    variant = os.environ["NG_EXIT_VARIANT"]
    import numguard.distributed as ngd

    if os.environ.get("NUMGUARD_DIST_CHECK") != "1":
        ngd.guard_collectives(timeout=30)
    t = torch.ones(3)
    for _ in range(3):
        dist.all_reduce(t)
    sub = dist.new_group([0, 1])
    dist.all_reduce(t, group=sub)
    ngd.check_shapes({"x": t, "y": [t, None]}, op="exit-test")
    ngd.check_trigger()
    ngd.check_trigger(blocking=False)  # left pending on purpose
    flags = ngd.exchange_trip(torch.tensor(0)).tolist()
    dist.barrier()
    if variant == "dist":
        dist.destroy_process_group()
    elif variant == "c10d":
        distributed_c10d.destroy_process_group()
    elif variant == "imported_early":
        destroy_imported_early()
    elif variant == "subgroup_first":
        dist.destroy_process_group(sub)
        dist.destroy_process_group()
    return {"variant": variant, "flags": flags, "sum": t.tolist(), "exit_normally": True}


def _timed(fn):
    t0 = time.monotonic()
    res = _catch(fn)
    res["elapsed"] = time.monotonic() - t0
    return res


def scenario_uneven(rank, world):
    """NUMGUARD_DIST_CHECK=1: one rank (``extra``) runs one collective more than the other, which
    is already in a barrier. Each case runs on a fresh subgroup with a short timeout of its own,
    so a rank stuck in an unchecked collective gives up and the next case can start."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    import numguard.distributed as ngd

    res = {"guard_installed": ngd.guard.installed_guard() is not None}
    kinds = ("all_reduce", "broadcast", "all_gather_into_tensor", "broadcast_object_list",
             "ddp_step", "unchecked_all_reduce")
    for kind in kinds:
        for extra in (0, 1):
            group = dist.new_group([0, 1], timeout=timedelta(seconds=5))
            t = torch.ones(4)
            dist.all_reduce(t, group=group)  # both ranks: in step before the uneven part
            if kind == "ddp_step":  # every rank builds the model and trains one step
                model = torch.nn.parallel.DistributedDataParallel(
                    torch.nn.Linear(4, 2), process_group=group)
                model(torch.randn(3, 4)).sum().backward()

            def uneven():
                if rank != extra:
                    dist.barrier(group=group)
                    return "barrier passed"
                if kind == "all_reduce":
                    dist.all_reduce(t, group=group)
                elif kind == "broadcast":
                    dist.broadcast(t, src=0, group=group)
                elif kind == "all_gather_into_tensor":
                    dist.all_gather_into_tensor(torch.zeros(8), t, group=group)
                elif kind == "broadcast_object_list":
                    dist.broadcast_object_list([{"step": 1}], src=0, group=group)
                elif kind == "ddp_step":  # one step more than the other rank
                    model(torch.randn(3, 4)).sum().backward()
                elif kind == "unchecked_all_reduce":
                    distributed_c10d.all_reduce(t, group=group)  # not through torch.distributed
                return "extra passed"

            r = _timed(uneven)
            r["extra"] = extra
            res[f"{kind}/extra{extra}"] = r
            # Meet before the next case, unchecked: a rank stuck in the case's subgroup comes
            # only when the subgroup's own timeout has passed.
            distributed_c10d.barrier()
    return res


def _watched_model(seed=0):
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _train(model, rank, steps, nan_rank=None, nan_step=None):
    """Train ``steps`` steps; return (steps done, (step, ranks) of a NonFiniteError or None)."""
    import torch

    import numguard

    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    done = []
    for step in range(steps):
        x = torch.randn(3, 4)
        if rank == nan_rank and step == nan_step:
            x[0, 0] = float("nan")
        try:
            model(x).sum().backward()
        except numguard.NonFiniteError as exc:
            return done, [step, list(exc.ranks)]
        opt.step()
        opt.zero_grad()
        done.append(step)
    return done, None


def _warnings_of(fn):
    import warnings

    from numguard.distributed import DistributedWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = _catch(fn)
    out["warnings"] = [str(w.message) for w in caught if issubclass(w.category, DistributedWarning)]
    return out


def scenario_partial_exchange(rank, world):
    """The trip exchange reached by some ranks only: a grad-enabled evaluation on one rank, and
    watch() on one rank. DDP training follows each case. No rank may crash or hang; a NaN
    planted on rank 1 after the evaluation must still make every rank raise in the same step."""
    import torch
    import torch.distributed as dist

    import numguard

    res = {}
    cases = [("eval", 0, 1), ("eval", 0, 3), ("eval", 1, 2), ("watch_one", 0, 0),
             ("watch_one", 1, 0)]
    for kind, who, batches in cases:
        net = _watched_model()
        model = torch.nn.parallel.DistributedDataParallel(net)
        watching = kind != "watch_one" or rank == who
        insp = numguard.watch(net, report_to=None) if watching else None

        def case():
            if kind == "eval" and rank == who:
                for _ in range(batches):
                    model(torch.randn(3, 4))  # gradients enabled, no backward: not a train step
            if kind == "eval":
                return _train(model, rank, 4, nan_rank=1, nan_step=2)
            return _train(model, rank, 3)

        try:
            res[f"{kind}/{who}/{batches}"] = _warnings_of(case)
        finally:
            if insp is not None:
                insp.close()
        dist.barrier()
    return res


def scenario_exchange_details(rank, world):
    """Batch numbers in the trip exchange, the call site named by its warnings, huge timeouts,
    dicts built in different orders, threads sharing a group's checks."""
    import threading

    import torch
    import torch.distributed as dist

    import numguard.distributed as ngd
    from numguard.distributed import trip_exchange as co

    res = {}
    # Ranks checking different batches (check_every 1 on rank 0, 2 on rank 1).
    pairs = []
    for k in range(3):
        mine = k if rank == 0 else 2 * k + 1
        out = _warnings_of(lambda: ngd.exchange_trip(torch.tensor(0), batch_number=mine).tolist())
        out["last"] = co.last_exchange()
        pairs.append(out)
    res["batches"] = pairs
    same = _warnings_of(lambda: ngd.exchange_trip(torch.tensor(1 - rank), batch_number=7).tolist())
    same["last"] = co.last_exchange()
    res["same_batch"] = same
    res["details"] = [list(d) + [d.batch] for d in ngd.gather_trip_details(
        "mlp" if rank == 0 else None, 7)]
    # Huge timeouts, from the argument and from the variable.
    huge = {}
    for value in (1e3, 86400, 1e7, 1e10, 1e300):
        huge[f"arg {value:g}"] = _catch(lambda: ngd.check_shapes(torch.zeros(3), op="huge",
                                                                 timeout=value))
        os.environ["NUMGUARD_DIST_TIMEOUT"] = repr(value)
        try:
            huge[f"env {value:g}"] = _catch(lambda: ngd.check_shapes(torch.zeros(3), op="huge"))
            huge[f"trigger env {value:g}"] = _catch(lambda: ngd.check_trigger())
        finally:
            del os.environ["NUMGUARD_DIST_TIMEOUT"]
    huge["guard 1e10"] = _catch(lambda: ngd.guard_collectives(timeout=1e10))
    guard = ngd.guard_collectives(timeout=86400)
    try:
        t = torch.ones(2)
        huge["guard 86400"] = _catch(lambda: dist.all_reduce(t) or t.tolist())
    finally:
        guard.remove()
    res["huge"] = huge
    # Equal dicts built in different orders, nested, with keys of several types.
    keys = ["b", "a", 3, ("t", 1), "c"]
    order = keys if rank == 0 else list(reversed(keys))
    d = {k: torch.zeros(len(str(k))) for k in order}
    d["nested"] = {k: [torch.ones(2), None] for k in (keys[:3] if rank else keys[2::-1])}
    # Compared by key (key_order=False) they are equal; by default their order must agree too.
    res["dict_order"] = _catch(lambda: ngd.check_shapes(d, op="dicts", key_order=False))
    res["dict_order_default"] = _catch(lambda: ngd.check_shapes(d, op="dicts"))
    # Different values under the same keys are still caught, whatever the order.
    d2 = dict(d)
    d2["a"] = torch.zeros(5 + rank)
    res["dict_value_differs"] = _catch(lambda: ngd.check_shapes(d2, op="dicts", key_order=False))
    # Threads sharing a group's checks, from the group's first numguard call on.
    fresh = dist.new_group([0, 1])
    outcomes = {"A": [], "B": []}
    start = threading.Barrier(2)

    def worker(name, n):
        start.wait(30)
        for _ in range(20):
            try:
                ngd.check_shapes(torch.zeros(n), op="thread", group=fresh, timeout=30)
                outcomes[name].append("ok")
            except Exception as exc:  # noqa: BLE001 - the test inspects it
                outcomes[name].append(type(exc).__name__)

    def run_threads():
        threads = [threading.Thread(target=worker, args=("A", 3), name="A"),
                   threading.Thread(target=worker, args=("B", 4), name="B")]
        for th in threads:
            th.start()
        for th in threads:
            th.join(120)
        return {k: v for k, v in outcomes.items()}

    res["threads"] = _warnings_of(run_threads)
    res["after_threads"] = _catch(lambda: ngd.check_shapes(torch.ones(2), op="after threads",
                                                           group=fresh))
    # The inspector passes its batch numbers: check_every 1 on rank 0 and 2 on rank 1, a NaN on
    # rank 1 in batch 1. Rank 0's batch 0 pairs rank 1's batch 1: both are named.
    import numguard

    net = _watched_model()
    insp = numguard.watch(net, report_to=None, check_every=1 if rank == 0 else 2)

    def two_batches():
        for batch in range(2):
            x = torch.randn(3, 4)
            if rank == 1 and batch == 1:
                x[0, 0] = float("nan")
            net(x).sum()
    res["check_every"] = _warnings_of(two_batches)
    insp.close(check=False)
    return res


def _linger_until_others_leave(out, cap_s):
    """Wait until every other rank's process has exited (their pid files, written at start), at most
    `cap_s` seconds; whether they all left first."""
    here = os.path.dirname(out)
    mine = os.environ.get("RANK")
    pids = []
    deadline = time.monotonic() + cap_s
    for r in range(int(os.environ["WORLD_SIZE"])):
        path = os.path.join(here, f"pid{r}")
        while str(r) != mine and not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.05)
        if str(r) != mine and os.path.exists(path):
            pids.append(int(open(path).read()))

    def alive(pid):
        try:
            os.kill(pid, 0)   # the launcher reaps its children as they end (RankProcesses.wait)
            return True
        except OSError:
            return False
    while any(map(alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return len(pids) == int(os.environ["WORLD_SIZE"]) - 1 and not any(map(alive, pids))


def main(argv):
    name, out = argv[1], os.environ["NG_RESULT"]
    with open(os.path.join(os.path.dirname(out), f"pid{os.environ.get('RANK', '0')}"), "w") as f:
        f.write(str(os.getpid()))
    result = {}
    try:
        rank, world = _init()
        result = globals()["scenario_" + name](rank, world) or {}
    except BaseException:  # noqa: BLE001
        result = {"error": traceback.format_exc()}
    with open(out + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(out + ".tmp", out)
    if os.environ.get("RANK") == "0":
        # Rank 0 hosts the store: stay until every rank has written its result (bounded).
        world = int(os.environ["WORLD_SIZE"])
        paths = [os.path.join(os.path.dirname(out), f"r{r}.json") for r in range(world)]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all(os.path.exists(p) for p in paths):
            time.sleep(0.05)
    sys.stdout.flush()
    sys.stderr.flush()
    if result.get("linger_s"):
        time.sleep(result["linger_s"])
    if result.get("linger_until_others_leave"):
        result["others_left_first"] = _linger_until_others_leave(out, result["linger_until_others_leave"])
        with open(out + ".tmp", "w") as f:
            json.dump(result, f)
        os.replace(out + ".tmp", out)
    if result.get("exit_normally"):
        sys.exit(0)  # through interpreter shutdown and the process group's destructors
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv)
