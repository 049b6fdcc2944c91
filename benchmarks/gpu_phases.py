"""The phases of benchmarks/gpu_check.py that are not a test file or a benchmark of their own.

    python benchmarks/gpu_phases.py PHASE [--rehearse]

PHASE: environment, import, training, batch_finder, spread, fault. With --rehearse each runs its CPU
counterpart. Exit status 0 when the phase passed; figures are printed for gpu_check.py to collect.
"""
from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the checkout, numguard built in place, comes first
sys.path.insert(0, HERE)
from gpu_check import figure  # noqa: E402


def environment(rehearse: bool) -> int:
    """A line for each tool the later phases need; fails when one that a GPU run needs is missing."""
    missing = []

    def have(what, ok, detail, needed=True):
        print(f"  {'ok     ' if ok else 'MISSING' if needed else 'absent '} {what}: {detail}")
        if not ok and needed:
            missing.append(what)

    have("python", True, sys.version.split()[0])
    try:
        torch = importlib.import_module("torch")
        have("torch", True, f"{torch.__version__} (CUDA {torch.version.cuda})")
    except ImportError as exc:
        have("torch", False, f"cannot import: {exc}")
        torch = None
    if torch is not None:
        cuda = torch.cuda.is_available()
        detail = (f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}" if cuda
                  else "no CUDA device visible" + (" (expected in a rehearsal)" if rehearse else ""))
        have("CUDA device", cuda, detail, needed=not rehearse)
        have("CUDA build of torch", bool(torch.version.cuda), str(torch.version.cuda), needed=not rehearse)
    nvcc = shutil.which("nvcc")
    version = ""
    if nvcc:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
        version = out.strip().splitlines()[-1] if out.strip() else "?"
    have("nvcc", bool(nvcc), version or "not on PATH", needed=not rehearse)
    have("ninja", bool(shutil.which("ninja")) or _importable("ninja"),
         shutil.which("ninja") or "not found: the build compiles one file at a time", needed=False)
    for module, needed in (("setuptools", True), ("pytest", True), ("transformers", False)):
        ok = _importable(module)
        have(module, ok, _version(module) if ok else "not installed" +
             ("" if needed else " (the training-step phase is skipped)"), needed=needed)
    if missing:
        print(f"environment: missing {', '.join(missing)}: the phases that need them cannot pass")
        return 1
    return 0


def _importable(name):
    try:
        importlib.import_module(name)
        return True
    except ImportError:
        return False


def _version(name):
    return getattr(importlib.import_module(name), "__version__", "?")


def import_check(rehearse: bool) -> int:
    import torch

    import numguard
    from numguard import ops
    native = ops.native_module()
    archs = native.cuda_architectures() if native is not None else []
    print(f"  numguard {numguard.__version__} from {os.path.dirname(numguard.__file__)}: backend "
          f"{numguard.backend()}, CUDA archs {archs}")
    assert numguard.backend() == "native", ops.fallback_reason()
    keys = ["CPU"] if rehearse else ["CPU", "CUDA"]
    for op in ("tensor_stats", "multi_tensor_stats", "record_", "record_at_cursor_", "multi_tensor_fingerprint"):
        for key in keys:
            assert torch._C._dispatch_has_kernel_for_dispatch_key("numguard::" + op, key), (op, key)
    if rehearse:
        print("  CUDA kernels: not checked in a rehearsal (the CUDA build check of .ci/run covers them)")
    else:
        assert archs, "built without CUDA kernels"
        major, minor = torch.cuda.get_device_capability()
        assert f"sm_{major}{minor}" in archs, f"no kernels for this GPU's sm_{major}{minor}: {archs}"
    return 0


def training(rehearse: bool) -> int:
    """GPT-2 (small on a GPU, tiny on the CPU) trained with every module watched against unwatched,
    conditions interleaved: the step-time ratio and numguard's host syncs per step."""
    import torch

    import numguard
    from numguard.testing import SyncCounter
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        print("training: transformers is not installed; skipped")
        return 0
    device = "cpu" if rehearse else "cuda"
    torch.manual_seed(0)
    if rehearse:
        cfg = GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=64)
        batch, seq, steps, reps = 4, 32, 3, 3
    else:
        cfg = GPT2Config()  # GPT-2 small, 124M parameters
        batch, seq, steps, reps = 8, 512, 5, 3
    model = GPT2LMHeadModel(cfg).to(device)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    amp = not rehearse
    scaler = torch.amp.GradScaler("cuda", enabled=amp)

    def step():
        with torch.autocast(device, dtype=torch.float16, enabled=amp):
            loss = model(ids, labels=ids).loss
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)

    def timed():
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        if device == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) / steps

    def counted():
        with SyncCounter()() as counter:
            step()
        return counter

    step()  # warm-up: allocator, autotuning
    off_syncs = counted()
    insp = numguard.watch(model, report_to=None)
    step()
    on_syncs = counted()
    insp.close()
    off, on = [], []
    for _ in range(reps):  # interleaved, so drift on the machine hits both alike
        off.append(timed())
        insp = numguard.watch(model, report_to=None)
        step()
        on.append(timed())
        insp.close()
    ratio = sorted(on)[len(on) // 2] / sorted(off)[len(off) // 2]
    print(f"  {'tiny GPT-2 fp32 on the CPU' if rehearse else 'GPT-2 small fp16 on ' + torch.cuda.get_device_name()}"
          f": unwatched {min(off) * 1e3:.1f} ms/step, watched {min(on) * 1e3:.1f} ms/step (medians ratio "
          f"{ratio:.3f}); host syncs per step: unwatched {off_syncs.total}, watched {on_syncs.total} "
          f"(numguard's own {on_syncs.numguard}, in hooks {on_syncs.in_hooks})")
    figure("watched / unwatched step time", ratio, "<= 1.10", ratio <= 1.10, "x")
    figure("numguard host syncs per step", on_syncs.numguard, "<= 1", on_syncs.numguard <= 1)
    return 0 if on_syncs.in_hooks == 0 else 1


def batch_finder(rehearse: bool) -> int:
    """A step that needs 2 x batch x 64 MiB under a memory cap: the search must end on a size that
    ran whose next size up failed with an out-of-memory error, every try starting with the previous
    tries' activations freed. On a GPU the cap is a real memory fraction; rehearsed, a simulated one."""
    import torch

    import numguard
    per = 64 << 20
    if rehearse:
        cap = 40 * per
        state = {"live": 0}

        def alloc(batch_size):
            need = 2 * batch_size * per
            if need > cap:
                raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {need >> 20} MiB (simulated)")
            state["live"] = need
            return need

        def allocated():
            return 0
    else:
        frac = 0.02
        torch.cuda.set_per_process_memory_fraction(frac)
        cap = int(frac * torch.cuda.get_device_properties(0).total_memory)
        try:
            torch.empty(2 * cap, dtype=torch.uint8, device="cuda")
            print("allocating twice the cap did not fail")
            return 1
        except torch.OutOfMemoryError as exc:
            assert numguard.is_out_of_memory(exc), exc

        def alloc(batch_size):
            x = torch.ones(batch_size, per // 4, device="cuda")
            y = x * 2
            return y[:, :8].sum().item()

        def allocated():
            return torch.cuda.memory_allocated()
    at_start = []

    @numguard.find_executable_batch_size(starting_batch_size=4096, search="binary")
    def step(batch_size):
        at_start.append(allocated())
        alloc(batch_size)
        return batch_size

    size = step()
    tried = step.finder.tried
    print(f"  cap {cap >> 20} MiB; found {size}; tried {tried}")
    assert 2 * size * per <= cap, "the size found does not fit the cap"
    assert (size + 1, "out of memory") in tried, "the next size up was not shown to fail"
    assert max(at_start) < (1 << 20), f"a try started with earlier activations alive: {at_start}"
    assert step() == size and step.finder.tried == [(size, "ok")], "the size found was not remembered"
    return 0


def spread(rehearse: bool) -> int:
    """cuda:0 -> cuda:1 (with 2+ GPUs) -> a CPU-offloaded part: each stage records on its own device
    (NOTE: [one ring per device]) and a NaN planted in the second stage is reported naming it."""
    import torch

    import numguard
    two = torch.cuda.device_count() > 1
    mid = "cuda:1" if two else "cuda:0"

    class Spread(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(64, 64).to("cuda:0")
            self.b = torch.nn.Linear(64, 64).to(mid)
            self.c = torch.nn.Linear(64, 64)  # offloaded to the CPU

        def forward(self, x):
            return self.c(self.b(self.a(x).to(mid)).cpu())

    model = Spread()
    insp = numguard.watch(model, report_to=None)
    copied = []
    sanitize = insp._ring.sanitize
    insp._ring.sanitize = lambda xs: copied.append(len(xs)) or sanitize(xs)
    x = torch.ones(4, 64, device="cuda:0")
    with torch.no_grad():
        model(x)
        model(x)
        sides = sorted(str(s.device) for s in insp._ring.sides)
        assert sides == (["cpu", "cuda:1"] if two else ["cpu"]), sides
        assert copied == [], copied
        model.b.bias[0] = float("nan")
        try:
            model(x)
            print("  no trip")
            return 1
        except numguard.NonFiniteError as exc:
            assert exc.module == "b", exc.module
            print(exc.report)
    insp.close()
    print(f"  spread over devices: ok (side rings on {sides})")
    return 0


def fault(rehearse: bool) -> int:
    """A flipped exponent bit in a matrix product's output (numguard.testing.faults.inject_matmul),
    once, under watch(spikes=True, rerun=True): silent on the healthy batches that arm the spike
    test, then the flip is found at the module that ran the product, in its batch, the rerun on the
    same device judges it transient and its output replaces the corrupted one. On the GPU a CUDA
    model; rehearsed, the same on the CPU."""
    import warnings

    import torch

    import numguard
    from numguard.testing import faults
    device = "cpu" if rehearse else "cuda"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 8)).to(device)
    with torch.no_grad():  # outputs of model[2] in +-[1, 2): the flip of the exponent's top bit makes a NaN
        model[2].weight.mul_(0.01)
        model[2].bias.copy_(torch.where(torch.rand(256, device=device) < 0.5, -1.5, 1.5))
    x = torch.randn(32, 64, device=device)
    insp = numguard.watch(model, spikes=True, rerun=True, report_to=None, on_trip="warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(24):  # arms the spike test (16 batches)
            model(x)
        healthy = [str(w.message) for w in caught if "numguard" in type(w.message).__module__]
        caught.clear()
        with faults.inject_matmul(model[2], "exponent", bit=30, seed=1) as flip:  # float32: the exponent's top bit
            out = model(x)
        model(x)
    if device == "cuda":
        torch.cuda.synchronize()
    found = [w.message for w in caught if isinstance(w.message, numguard.errors.NonFiniteWarning)]
    others = [str(w.message) for w in caught if "numguard" in type(w.message).__module__ and
              not isinstance(w.message, numguard.errors.NonFiniteWarning)]
    report = insp.last_report or {}
    insp.close(check=False)
    flipped = flip.records()
    verdict = found[0].attribution.verdict if found and found[0].attribution is not None else None
    print(f"  {device}: flipped {flipped}; healthy batches warned {len(healthy)} time(s); after the flip: "
          f"{len(found)} NonFiniteWarning(s), module {report.get('module')!r}, verdict {verdict!r}, "
          f"output finite: {bool(torch.isfinite(out).all())}; other warnings: {others}")
    ok = (flip.fired == 1 and not healthy and len(found) == 1 and report.get("module") == "2"
          and verdict == "transient" and bool(torch.isfinite(out).all()))
    figure("exponent flip in a matmul output found and judged transient", ok, "1", ok)
    return 0 if ok else 1


PHASES = {"environment": environment, "import": import_check, "training": training,
          "batch_finder": batch_finder, "spread": spread, "fault": fault}

if __name__ == "__main__":
    name = sys.argv[1] if len(sys.argv) > 1 else ""
    if name not in PHASES:
        sys.exit(f"gpu_phases: unknown phase {name!r}; one of {', '.join(PHASES)}")
    sys.exit(PHASES[name]("--rehearse" in sys.argv[2:]))
