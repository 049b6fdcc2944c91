"""The GPU check: one call on a lent GPU that says, phase by phase, what is right and what is not.

    bash benchmarks/gpu_check.sh              # on a machine with an NVIDIA GPU
    bash benchmarks/gpu_check.sh --rehearse   # the same script without a GPU (CI runs this)

Phases run in this order, the ones that matter most first: environment and tools -> build ->
import with NUMGUARD_BACKEND=native -> kernel and fingerprint tests (CUDA cases, exact against the
CPU kernels) -> records against the reference and CUDA graph capture -> a watched compiled model
captured in a CUDA graph -> an fp16 GPT-2 training step with numguard on vs off -> a flipped exponent
bit in a matmul output judged transient -> batch finder on a real OOM -> a model spread over devices
-> doctor -> bandwidth table (stats, views, quant_stats per format, fingerprint). Each phase ends PASS, FAIL,
SKIPPED (and why) or CUT (the time budget ran out before it could end), and prints its figures
against their targets ("met" / "NOT met"). A phase that outlives its own limit is a FAIL (it hung
or is far too slow); one stopped because the whole run's budget is spent is CUT.

With --rehearse each phase runs its CPU counterpart where one exists (the CPU build, import, the
CPU kernel tests, the reference check on the CPU, the batch finder on a simulated OOM, the model
spread over stand-in devices, the doctor on gloo, the training step on a tiny model) and prints
"SKIPPED (needs CUDA): <what it would have checked>" where none does.

Exit status: 0 when no phase failed or was cut; 1 when a phase failed; 2 when none failed but one
was cut. A JSON summary goes to benchmarks/results/gpu_check.json, and to $OUT if that is set.

Environment: PYTHON (the interpreter of every phase; default: this one), GPU_CHECK_BUDGET_S
(default 420 on a GPU, four times that in a rehearsal, whose limits are four times longer too),
TORCH_CUDA_ARCH_LIST (default 9.0), MAX_JOBS (default: the CPU count).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
FIGURE_TAG = "GPU_CHECK_FIGURE "  # a line a phase prints for each figure: the tag, then JSON
PHASES_SCRIPT = os.path.join("benchmarks", "gpu_phases.py")
REHEARSAL_SLOWDOWN = 4  # a rehearsal's limits and budget: this many times a GPU run's


@dataclass
class Phase:
    name: str
    gpu: list | None            # argv on a GPU machine (None: nothing to run there)
    rehearse: list | None       # argv of the CPU counterpart (None: skipped in a rehearsal)
    checks: str                 # what it checks, said when it is skipped
    limit_s: int                # its own limit: past it, the phase hung or is far too slow
    needs: tuple = ()           # phases whose failure makes this one pointless
    env: dict = field(default_factory=dict)


@dataclass
class Outcome:
    name: str
    status: str                 # PASS, FAIL, SKIPPED, CUT
    why: str = ""
    seconds: float = 0.0
    figures: list = field(default_factory=list)


def figure(name: str, value: float, target: str, met: bool, unit: str = "") -> None:
    """Prints one figure of a phase for the driver to collect (phases import this)."""
    print(FIGURE_TAG + json.dumps({"name": name, "value": float(value), "unit": unit, "target": target,
                                   "met": bool(met)}), flush=True)


def phase_cmd(py, name, *args):
    return [py, PHASES_SCRIPT, name, *args]


def pytest_cmd(py, *args):
    return [py, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "-rfEs", *args]


def phases(py: str, rehearse: bool) -> list[Phase]:
    arch = "CPU" if rehearse else "CUDA " + os.environ.get("TORCH_CUDA_ARCH_LIST", "9.0")
    build = [py, "setup.py", "-q", "build_ext", "--inplace"]
    kernel_files = ["tests/test_kernels.py", "tests/test_cross_rank_fingerprint.py", "tests/test_cuda_streams.py",
                    "tests/test_quant_stats.py"]
    # On the GPU every CUDA case runs even after a failure (one call must show them all), the slowest
    # are listed for sizing the next run, and the host emulations (CPU work CI runs) are left out; the
    # CUDA-only files are selected whole by `-k cuda` (their names hold it). Rehearsed: the CPU cases,
    # the CPU parameters of those files, and the host emulation of the CUDA kernels' logic.
    gpu_kernel_tests = pytest_cmd(py, *kernel_files, "tests/test_cuda_views.py", "tests/test_cuda_build.py",
                                  "-k", "cuda and not on_the_host", "--maxfail=25", "--durations=10")
    gpu_kernel_tests.remove("-x")
    torchrun = [py, "-m", "torch.distributed.run", "--standalone"]
    doctor = ["-m", "numguard", "doctor", "--timeout", "60", "--json", os.path.join(RESULTS, "doctor.json")]
    return [
        Phase("environment", phase_cmd(py, "environment"), phase_cmd(py, "environment", "--rehearse"),
              "python, torch, CUDA, nvcc, ninja, setuptools, pytest, transformers", 60),
        Phase(f"build ({arch})", build, build, "numguard built in place with its CUDA kernels", 300,
              needs=("environment",), env={"NUMGUARD_BUILD_CUDA": "1"}),
        Phase("import (native backend)", phase_cmd(py, "import"), phase_cmd(py, "import", "--rehearse"),
              "numguard imports on its native kernels, a CUDA kernel registered for every op", 60,
              needs=("build",)),
        Phase("kernel + fingerprint tests", gpu_kernel_tests,
              pytest_cmd(py, *kernel_files, "tests/test_cuda_build.py", "-k", "not cuda or cpu or on_the_host"),
              "the CUDA cases of the kernel, view, stream and fingerprint tests, exact against the CPU "
              "kernels, no host sync", 200, needs=("import",)),
        Phase("reference + CUDA graphs", [py, "benchmarks/cuda_graph_check.py"],
              [py, "benchmarks/cuda_graph_check.py", "--device", "cpu"],
              "records of every dtype and layout against the float64 reference; ops and the recorder "
              "captured in CUDA graphs and replayed", 120, needs=("import",)),
        Phase("compiled model in a CUDA graph", [py, "benchmarks/cuda_graph_check.py", "--compiled"], None,
              "a watched torch.compile'd model's call captured in a CUDA graph, a NaN planted between "
              "replays reported at its submodule", 150, needs=("import",)),
        Phase("fp16 training step", phase_cmd(py, "training"), phase_cmd(py, "training", "--rehearse"),
              "GPT-2 small, every module watched, fp16: step time on vs off and host syncs per step", 120,
              needs=("import",)),
        Phase("exponent flip judged transient", phase_cmd(py, "fault"), phase_cmd(py, "fault", "--rehearse"),
              "a flipped exponent bit in a matmul output on the GPU (numguard.testing.faults), under "
              "spikes=True and rerun=True: found at its module and judged transient", 60, needs=("import",)),
        Phase("batch finder on OOM", phase_cmd(py, "batch_finder"), phase_cmd(py, "batch_finder", "--rehearse"),
              "find_executable_batch_size on real CUDA out-of-memory errors", 60, needs=("import",)),
        Phase("spread over devices", phase_cmd(py, "spread"),
              pytest_cmd(py, "tests/test_multi_device.py"),
              "cuda:0 -> cuda:1 -> CPU offload, each part recorded on its own device", 90, needs=("import",)),
        Phase("doctor", torchrun + ["--nproc_per_node", "gpu"] + doctor,
              torchrun + ["--nproc_per_node", "2"] + doctor,
              "numguard doctor with one rank per GPU on NCCL", 120, needs=("import",)),
        Phase("bandwidth table", [py, "benchmarks/bench_cuda_bandwidth.py", "--figures"], None,
              "stats and fingerprint kernels' bandwidth against a device copy", 120, needs=("import",)),
    ]


def run_phase(phase: Phase, argv: list, limit: int, budget_cut: bool, env: dict) -> Outcome:
    """Runs argv in its own process group, echoing its output and collecting its figures."""
    print(f"\n+++ gpu_check [{phase.name}] (limit {limit}s): {' '.join(argv)}", flush=True)
    start = time.monotonic()
    figures = []
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, bufsize=1, start_new_session=True)
    deadline = start + limit
    timed_out = False
    import selectors
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        if not sel.select(timeout=min(left, 1.0)):
            if proc.poll() is not None:
                break
            continue
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith(FIGURE_TAG):
            try:
                figures.append(json.loads(line[len(FIGURE_TAG):]))
            except ValueError:
                print(f"    (unreadable figure line: {line.strip()})")
        print("    " + line, end="", flush=True)
    if timed_out:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    rc = proc.wait()
    took = time.monotonic() - start
    for f in figures:
        print(f"    figure {f['name']}: {f['value']:.4g}{f.get('unit', '')} (target {f['target']}: "
              f"{'met' if f['met'] else 'NOT met'})")
    if timed_out and budget_cut:
        return Outcome(phase.name, "CUT", f"the run's time budget ran out after {took:.0f}s", took, figures)
    if timed_out:
        return Outcome(phase.name, "FAIL", f"no end within its {limit}s limit (hung or far too slow)", took, figures)
    if rc != 0:
        return Outcome(phase.name, "FAIL", f"exit {rc}", took, figures)
    return Outcome(phase.name, "PASS", "", took, figures)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rehearse", action="store_true", help="run without a GPU: CPU counterparts only")
    parser.add_argument("--budget", type=int, default=None,
                        help="seconds for the whole run (default GPU_CHECK_BUDGET_S, else 420 on a GPU and "
                             f"{REHEARSAL_SLOWDOWN} times that in a rehearsal)")
    parser.add_argument("--only", nargs="*", help="run only the phases whose names start with these words")
    args = parser.parse_args(argv)
    # A rehearsal runs on a small CPU machine (CI: 2 cores), where builds and tests take longer.
    slowdown = REHEARSAL_SLOWDOWN if args.rehearse else 1
    if args.budget is None:
        args.budget = int(os.environ.get("GPU_CHECK_BUDGET_S", 420 * slowdown))
    py = os.environ.get("PYTHON") or sys.executable
    env = dict(os.environ)
    env.update(PYTHONPATH=ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""),
               PYTHONUNBUFFERED="1", NUMGUARD_REQUIRE_NATIVE="1", NUMGUARD_BACKEND="native")
    env.pop("NUMGUARD", None)  # the checks watch models themselves; nothing is switched on at start-up
    if not args.rehearse:
        env.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
        env["NUMGUARD_EXPECT_CUDA_KERNELS"] = "1"
    env.setdefault("MAX_JOBS", str(os.cpu_count() or 1))
    os.makedirs(RESULTS, exist_ok=True)
    mode = "rehearsal (no GPU)" if args.rehearse else "GPU"
    print(f"gpu_check: {mode}, budget {args.budget}s, python {py}", flush=True)
    start = time.monotonic()
    outcomes: list[Outcome] = []
    status_of: dict[str, str] = {}
    for phase in phases(py, args.rehearse):
        key = phase.name.split(" (")[0]
        if args.only and not any(phase.name.startswith(w) for w in args.only):
            continue
        argv_ = phase.rehearse if args.rehearse else phase.gpu
        failed_needs = [n for n in phase.needs if status_of.get(n) in ("FAIL", "CUT", "SKIPPED")
                        and not (args.only and n not in status_of)]
        if argv_ is None:
            out = Outcome(phase.name, "SKIPPED", f"needs CUDA: {phase.checks}")
        elif failed_needs:
            out = Outcome(phase.name, "SKIPPED", f"{failed_needs[0]} did not pass")
        else:
            left = int(args.budget - (time.monotonic() - start))
            if left < 5:
                out = Outcome(phase.name, "CUT", f"not started: the {args.budget}s budget is spent")
            else:
                phase_env = dict(env)
                if not args.rehearse:
                    phase_env.update(phase.env)
                argv_ = [str(max(1, gpu_count(py, env))) if a == "gpu" else a for a in argv_]
                limit = phase.limit_s * slowdown
                out = run_phase(phase, argv_, min(limit, left), limit > left, phase_env)
        if out.status in ("SKIPPED", "CUT") and not out.seconds:
            print(f"\n+++ gpu_check [{phase.name}] {out.status} ({out.why})", flush=True)
        else:
            print(f"+++ gpu_check [{phase.name}] {out.status}{' (' + out.why + ')' if out.why else ''} "
                  f"after {out.seconds:.0f}s", flush=True)
        outcomes.append(out)
        status_of[key] = out.status
    return summarize(outcomes, mode, time.monotonic() - start)


def gpu_count(py, env) -> int:
    try:
        out = subprocess.run([py, "-c", "import torch; print(torch.cuda.device_count())"], env=env,
                             capture_output=True, text=True, timeout=60)
        return int(out.stdout.strip() or 0)
    except (OSError, ValueError, subprocess.SubprocessError):
        return 1


def summarize(outcomes: list[Outcome], mode: str, total: float) -> int:
    print(f"\n+++ gpu_check summary ({mode}, {total:.0f}s)")
    not_met = 0
    for o in outcomes:
        why = f" ({o.why})" if o.why else ""
        print(f"    {o.name:<32} {o.status:<8} {o.seconds:5.0f}s{why}")
        for f in o.figures:
            not_met += not f["met"]
            print(f"        {f['name']}: {f['value']:.4g}{f.get('unit', '')}  target {f['target']}: "
                  f"{'met' if f['met'] else 'NOT met'}")
    counts = {s: sum(o.status == s for o in outcomes) for s in ("PASS", "FAIL", "SKIPPED", "CUT")}
    line = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
    print(f"gpu_check: {line}; {not_met} target(s) NOT met")
    summary = {"mode": mode, "seconds": round(total, 1), "counts": counts, "targets_not_met": not_met,
               "phases": [o.__dict__ for o in outcomes]}
    for folder in filter(None, (RESULTS, os.environ.get("OUT"))):
        try:
            with open(os.path.join(folder, "gpu_check.json"), "w") as fh:
                json.dump(summary, fh, indent=1)
        except OSError as exc:
            print(f"gpu_check: could not write the summary to {folder}: {exc}")
    if counts["FAIL"]:
        return 1
    return 2 if counts["CUT"] else 0


if __name__ == "__main__":
    sys.exit(main())
