"""The order of a doctor run, and the exit status.

Exit status (the same on every rank that gets this far): 0 healthy (warnings allowed), 1 when a
check gave a wrong result, a rank never joined, a step timed out or failed, or a finding is an
error (two ranks on one GPU); 2 for a usage error (bad option or environment).
"""
from __future__ import annotations

import dataclasses
import os
import sys
import time

import torch

from . import checks, facts as _facts, findings as _findings, performance, report
from .launcher import (CENSUS, CollectiveError, DoctorError, SettingError, StepTimeout,
                       describe_census, gather_json, start)

__all__ = ["Options", "run"]

_NCCL_LOG_CAP = 2 * 1024 ** 2  # bytes of each rank's NCCL log carried to rank 0
SCHEMA_ID = report.SCHEMA


@dataclasses.dataclass
class Options:
    json: str | None = None
    timeout: float = 30.0
    sizes: list | None = None  # bytes; None: performance.DEFAULT_SIZES for the device
    iters: int | None = None   # timed iterations per size; None: 20 on CUDA, 5 on CPU
    pairs: bool = False
    plot: str | None = None
    nccl_debug: bool = False


def _nccl_dir(options):
    if options.json:
        base = os.path.splitext(os.path.abspath(options.json))[0]
        return base + ".nccl"
    return os.path.abspath("numguard-doctor-nccl")


def _setup_nccl_debug(ctx, options):
    # NCCL reads these when its first communicator starts, i.e. after init_process_group.
    folder = _nccl_dir(options)
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        raise SettingError(f"--nccl-debug: cannot create {folder!r} for the NCCL logs "
                           f"({exc.strerror or exc}); give --json a path in a folder you can "
                           "write to (the logs go next to it)") from None
    path = os.path.join(folder, f"rank{ctx.rank}.{ctx.host}.log")
    os.environ["NCCL_DEBUG"] = "INFO"
    os.environ["NCCL_DEBUG_FILE"] = path
    return {"folder": folder, "file": path}


def _read_log(path):
    try:
        with open(path, "rb") as f:
            data = f.read(_NCCL_LOG_CAP + 1)
    except OSError:
        return None
    text = data[:_NCCL_LOG_CAP].decode("utf-8", "replace")
    return text + ("\n[numguard: cut at 2 MiB]\n" if len(data) > _NCCL_LOG_CAP else "")


def _bundle_nccl(result, logs, folder):
    """Rank 0 writes every rank's NCCL log into ``folder`` (other hosts' files are not local)."""
    paths = []
    for r, text in enumerate(logs):
        if text is None:
            continue
        path = os.path.join(folder, f"rank{r}.{result['facts'][r]['host']}.log")
        if not os.path.exists(path):
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
        paths.append(path)
    return paths


def _output(ctx, result, options):
    """Rank 0 prints the report and writes the JSON (and plot); other ranks print one line."""
    code = 1 if result["status"] != "healthy" else 0
    result["exit_status"] = code
    if ctx.rank != 0:
        for t in result["failures"]:
            sys.stderr.write(f"numguard doctor: rank {ctx.rank}: {t['message']}\n")
        if code and not result["failures"] and not result["missing_ranks"]:
            errors = [f["title"] for f in result["findings"] if f["severity"] == "error"]
            sys.stderr.write(f"numguard doctor: rank {ctx.rank}: failed ({'; '.join(errors)}); "
                             "rank 0 prints the report\n")
        return code
    sys.stdout.write(report.render(result))
    if options.json:
        try:
            report.write_json(result, options.json)
            sys.stdout.write(f"numguard doctor: JSON written to {options.json}\n")
        except OSError as exc:
            # Checked before the run, so this is new (a full disk, a folder removed): the
            # report above is all there is; say so, and do not call the run a success.
            sys.stdout.flush()
            sys.stderr.write(f"numguard doctor --json: cannot write {options.json!r} "
                             f"({exc.strerror or exc}); the report above on stdout is complete, "
                             "the JSON file was not written\n")
            code = max(code, 1)
    if options.plot and result["performance"]:
        try:
            report.write_plot(result, options.plot)
            sys.stdout.write(f"numguard doctor: plot written to {options.plot}\n")
        except (RuntimeError, OSError, ValueError) as exc:
            sys.stderr.write(f"numguard doctor --plot: cannot draw {options.plot!r} ({exc})\n")
    sys.stdout.flush()
    return code


def _hard_exit(code):
    # A collective abandoned on a timeout cannot be cancelled; leaving through the interpreter
    # would wait on it at shutdown, so flush and leave at once.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _fail(ctx, result, options, kind, step, message, census):
    """Record the failure, print it, wait for the others (rank 0 hosts the store) and leave."""
    result["status"] = "failed"
    failure = {"rank": ctx.rank, "kind": kind, "step": step, "message": message}
    failure.update({key: census.get(key, []) for key, _ in CENSUS})
    result["failures"].append(failure)
    result["findings"].append(_findings.failed_step(failure, result["facts"]))
    code = _output(ctx, result, options)
    ctx.leave()
    _hard_exit(code)


def run(options):
    """Run the doctor on this rank; returns the exit status (or leaves the process on a timeout)."""
    ctx = start(options.timeout)
    # Rank 0 writes the files: find a path it cannot write before the run, not after it.
    refusal = None
    if ctx.rank == 0:
        refusal = next(filter(None, (report.unwritable(path, option) for option, path in
                                     (("--json", options.json), ("--plot", options.plot))
                                     if path)), None)
    if refusal and ctx.world == 1:
        raise SettingError(refusal)
    result = {"schema": SCHEMA_ID, "status": "healthy", "world_size": ctx.world,
              "backend": None, "options": dataclasses.asdict(options), "missing_ranks": [],
              "arrived": {}, "failures": [], "facts": [], "findings": [], "checks": [],
              "performance": None, "nccl_debug": None, "nccl_logs": [], "started_unix": time.time()}
    if options.nccl_debug:
        result["nccl_debug"] = _setup_nccl_debug(ctx, options)
    missing = ctx.connect(refusal)
    result["arrived"] = {str(r): h for r, h in ctx.arrived.items()}
    if missing:
        result["missing_ranks"] = missing
        result["status"] = "failed"
        result["findings"] = [_findings.missing_ranks(missing, result["arrived"],
                                                      options.timeout)]
        if ctx.rank in missing:
            raise DoctorError(f"rank {ctx.rank} arrived after the {options.timeout:g} s start-up "
                              f"timeout; the other ranks gave up on ranks {missing}")
        if ctx.rank != 0:
            sys.stderr.write(f"numguard doctor: rank {ctx.rank}: ranks that never joined within "
                             f"{options.timeout:g} s: {missing}\n")
        return _output(ctx, result, options)
    try:
        ctx.init_process_group()
        result["backend"] = ctx.backend
        _examine(ctx, result, options)
    except (StepTimeout, CollectiveError) as exc:
        _fail(ctx, result, options, "timeout" if isinstance(exc, StepTimeout) else "error",
              exc.step, str(exc), exc.census)
    except DoctorError:
        raise
    except RuntimeError as exc:  # raised outside a step's wait (a backend error when issued)
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        census = ctx.census(mark="failed")
        _fail(ctx, result, options, "error", None,
              f"a collective failed on rank {ctx.rank} ({first}); {describe_census(census)}",
              census)
    code = _output(ctx, result, options)
    torch.distributed.destroy_process_group()
    return code


def _examine(ctx, result, options):
    device_kind = "cuda" if ctx.device.type == "cuda" else "cpu"
    all_facts = gather_json(ctx, _facts.collect(ctx), "gather facts")
    result["facts"] = all_facts
    findings = _findings.from_facts(all_facts)
    result["findings"] = findings  # kept if a later step fails
    collision = any(f["code"] == "device_collision" for f in findings)
    local = {"checks": [], "perf": None, "nccl_log": None}
    if not collision:  # NCCL refuses two ranks on one GPU; the checks would only fail
        local["checks"] = checks.run_checks(ctx)
        sizes = options.sizes or performance.DEFAULT_SIZES[device_kind]
        iters = options.iters or (20 if device_kind == "cuda" else 5)
        pair_bytes = min(max(sizes), (64 if device_kind == "cuda" else 1) * 1024 ** 2)
        local["perf"] = performance.measure(ctx, sizes, iters, options.pairs, pair_bytes)
    if result["nccl_debug"]:
        local["nccl_log"] = _read_log(result["nccl_debug"]["file"])
    gathered = gather_json(ctx, local, "gather results")
    if not collision:
        wrong, result["checks"] = _findings.correctness(all_facts, [g["checks"] for g in gathered])
        perf = [g["perf"] for g in gathered]
        straggle = performance.stragglers(perf)
        pairs = performance.pair_table(perf, ctx.world)
        result["performance"] = {
            "bandwidth": performance.bandwidth_table(perf, ctx.world),
            "latency_s": [p["latency_s"] for p in perf], "stragglers": straggle,
            "pairs": pairs, "pair_bytes": pair_bytes if pairs else None,
            "iterations": iters, "sizes": sizes}
        findings = wrong + findings + _findings.performance(all_facts, straggle, pairs)
    result["findings"] = findings
    if any(f["severity"] == "error" for f in findings):
        result["status"] = "failed"
    if result["nccl_debug"] and ctx.rank == 0:
        result["nccl_logs"] = _bundle_nccl(result, [g["nccl_log"] for g in gathered],
                                           result["nccl_debug"]["folder"])
    # Nobody leaves (and rank 0 does not take the store down) before everyone has everything.
    ctx.exchange("final barrier", b"")

