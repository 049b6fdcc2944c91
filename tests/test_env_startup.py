"""NUMGUARD=1 on an unmodified script: the start-up hook, root detection, settings, ranks.

Every test runs Python in a subprocess, as a job would start. When numguard is pip-installed here
its start-up hook sits in site-packages and these tests use it as installed; when numguard is only
built in place, a `sitecustomize` on PYTHONPATH adds a folder holding the same hook file with
`site.addsitedir`, which runs it exactly as `site` runs an installed one.
"""
import importlib.metadata
import json
import os
import shutil
import site
import subprocess
import sys

import pytest

from numguard import _startup
from dist_workers import free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "tests", "scripts", "unmodified_train.py")
MODULES_CODE = "import sys; print('torch' in sys.modules, 'numguard' in sys.modules)"


def _installed_hook():
    for folder in site.getsitepackages() + [site.getusersitepackages()]:
        path = os.path.join(folder, _startup.PTH_NAME)
        if os.path.isfile(path):
            return path
    return None


@pytest.fixture(scope="module")
def job_env(tmp_path_factory):
    """A function giving the environment for a subprocess with the start-up hook active."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("NUMGUARD")}
    path = [REPO]
    if _installed_hook() is None:
        shim = tmp_path_factory.mktemp("startup-shim")
        hook_dir = shim / "site"
        hook_dir.mkdir()
        shutil.copy(_startup.pth_path(), hook_dir / _startup.PTH_NAME)
        (shim / "sitecustomize.py").write_text(f"import site\nsite.addsitedir({str(hook_dir)!r})\n")
        path.insert(0, str(shim))
    base["PYTHONPATH"] = os.pathsep.join(path + [p for p in [os.environ.get("PYTHONPATH")] if p])
    base.setdefault("OMP_NUM_THREADS", "1")

    def make(**variables):
        full = dict(base)
        full.update(variables)
        return full
    return make


def run(args, environ, timeout=240):
    return subprocess.run([sys.executable] + args, capture_output=True, text=True, env=environ,
                          cwd=REPO, timeout=timeout)


def test_hook_file_is_one_cheap_line():
    with open(_startup.pth_path(), encoding="utf-8") as f:
        lines = f.read().splitlines()
    assert len(lines) == 1
    # `site` executes lines that start with "import"; the environment is read before anything else.
    assert lines[0].startswith("import os; os.environ.get(\"NUMGUARD\"")


def test_hook_installed_with_the_package():
    try:
        dist = importlib.metadata.distribution("numguard")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("numguard is built in place, not pip-installed: no installed files to check")
    files = [str(f) for f in (dist.files or [])]
    assert _startup.PTH_NAME in files, files
    assert _installed_hook() is not None


@pytest.mark.parametrize("value", [None, "0", ""])
def test_off_imports_nothing_at_startup(job_env, value):
    environ = job_env() if value is None else job_env(NUMGUARD=value)
    out = run(["-c", MODULES_CODE], environ)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]


def test_on_still_imports_nothing_before_the_script_imports_torch(job_env):
    out = run(["-c", MODULES_CODE + "; print(sorted(m for m in sys.modules if 'numguard' in m))"],
              job_env(NUMGUARD="1"))
    assert out.returncode == 0, out.stderr
    first, rest = out.stdout.split("\n", 1)
    assert first.split() == ["False", "False"]
    assert "'numguard._startup'" in rest  # only the torch-free start-up module is loaded


def test_invalid_variable_fails_fast_naming_it(job_env):
    out = run([SCRIPT, "--steps", "1"], job_env(NUMGUARD="1", NUMGUARD_MAX_FRAMES="many"))
    assert out.returncode != 0
    assert "NUMGUARD_MAX_FRAMES" in out.stderr and "'many'" in out.stderr
    assert "whole number" in out.stderr
    assert "step 0" not in out.stdout  # it failed before training


def test_invalid_variable_is_ignored_when_off(job_env):
    out = run([SCRIPT, "--steps", "1"], job_env(NUMGUARD_MAX_FRAMES="many"))
    assert out.returncode == 0, out.stderr


def test_unmodified_script_overflow_is_detected(job_env):
    out = run([SCRIPT, "--steps", "4", "--overflow-at", "2", "--print-modules"],
              job_env(NUMGUARD="1", NUMGUARD_MAX_FRAMES="5"))
    assert out.returncode != 0
    assert "step 1 loss" in out.stdout and "step 2 loss" not in out.stdout
    assert "Detected inf/nan during batch_number=2" in out.stdout
    assert "Last 5 forward frames:" in out.stdout
    assert "NonFiniteError" in out.stderr
    assert "finished" not in out.stdout


def test_unmodified_healthy_script_runs_to_the_end(job_env):
    out = run([SCRIPT, "--steps", "3", "--print-modules"], job_env(NUMGUARD="1"))
    assert out.returncode == 0, out.stderr
    assert "numguard imported: True" in out.stdout
    assert "finished 3 steps" in out.stdout
    assert "could not watch" not in out.stderr


def test_roots_are_watched_once(job_env):
    # The model and the loss module are roots; the model's submodules are not watched again,
    # not even when the script calls one of them on its own.
    code = """
import torch
from torch import nn
model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
loss_fn = nn.MSELoss()
for _ in range(2):
    loss = loss_fn(model(torch.randn(3, 4)), torch.zeros(3, 2))
    model[0](torch.randn(3, 4))
from numguard import _startup
w = _startup.auto_watcher()
print([type(m).__name__ for m in w.roots()])
def watchers_of(module):  # the distinct objects whose methods hook `module`
    found = set()
    for hook in list(module._forward_hooks.values()) + list(module._forward_pre_hooks.values()):
        for _ in range(4):
            if hasattr(hook, "__self__"):
                found.add(id(hook.__self__))
                break
            hook = getattr(hook, "__wrapped__", None) or getattr(hook, "func", None)
            if hook is None:
                break
    return len(found)
print(watchers_of(model[0]) == watchers_of(model[2]) == 1)
"""
    out = run(["-c", code], job_env(NUMGUARD="1"))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.split("\n")
    assert lines[0] == "['Sequential', 'MSELoss']"
    assert lines[1] == "True"


def test_a_new_root_above_an_earlier_root_takes_it_over(job_env):
    code = """
import torch
from torch import nn
inner = nn.Linear(4, 4)
outer = nn.Sequential(inner, nn.ReLU())
inner(torch.randn(2, 4))
n_inner = len(inner._forward_hooks)
outer(torch.randn(2, 4))
from numguard import _startup
print([type(m).__name__ for m in _startup.auto_watcher().roots()], len(inner._forward_hooks) <= n_inner)
"""
    out = run(["-c", code], job_env(NUMGUARD="1"))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['Sequential'] True"


def test_script_that_watches_itself_is_not_watched_twice(job_env):
    code = """
import torch, numguard
from torch import nn
model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
insp = numguard.watch(model)
model(torch.randn(2, 4)); model(torch.randn(2, 4))
from numguard import _startup
print([type(m).__name__ for m in _startup.auto_watcher().roots()])
"""
    out = run(["-c", code], job_env(NUMGUARD="1"))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_keyword_inputs_of_the_first_root_call_reach_the_model(job_env):
    code = """
import torch
from torch import nn
class M(nn.Module):
    def __init__(self):
        super().__init__(); self.lin = nn.Linear(4, 4)
    def forward(self, x, *, scale=1.0):
        return self.lin(x) * scale
m = M()
print(float(m(torch.ones(1, 4), scale=0.0).abs().sum()))
"""
    out = run(["-c", code], job_env(NUMGUARD="1"))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "0.0"


def test_on_trip_variable_dump_writes_a_file_and_training_goes_on(job_env, tmp_path):
    out = run([SCRIPT, "--steps", "4", "--overflow-at", "2"],
              job_env(NUMGUARD="1", NUMGUARD_ON_TRIP="dump", NUMGUARD_DUMP_DIR=str(tmp_path)))
    assert out.returncode == 0, out.stderr
    assert "finished 4 steps" in out.stdout
    dumps = sorted(p for p in os.listdir(tmp_path) if p.endswith(".json"))
    assert dumps, (out.stdout, out.stderr)
    with open(tmp_path / dumps[0]) as f:
        data = json.load(f)
    assert data["frames"]


def test_backward_variable_catches_a_backward_only_nan_before_the_step(job_env):
    out = run([SCRIPT, "--steps", "3", "--nan-grad-at", "1"],
              job_env(NUMGUARD="1", NUMGUARD_BACKWARD="1"))
    assert out.returncode != 0
    assert "step 0 loss" in out.stdout and "step 1 loss" not in out.stdout
    assert "NonFiniteError" in out.stderr
    assert "grad" in out.stdout


# Healthy batches precede the bad one in both scenarios: every rank's checks pair up until then.
@pytest.mark.parametrize("scenario", ["overflow", "backward-nan"])
def test_two_ranks_unmodified_script(job_env, scenario):
    from dist_workers import rank_environ, run_rank_processes

    extra = {"overflow": ["--overflow-at", "1"], "backward-nan": ["--nan-grad-at", "1"]}
    variables = {"NUMGUARD_BACKWARD": "1"} if scenario == "backward-nan" else {}
    port = free_port()
    environs = [rank_environ(job_env(NUMGUARD="1", **variables), rank, 2, port) for rank in range(2)]
    results = run_rank_processes([sys.executable, SCRIPT, "--steps", "3"] + extra[scenario], environs, REPO)
    for code, stdout, stderr in results:
        assert "step 0 loss" in stdout, stderr
        if scenario == "overflow":
            assert code != 0
            assert "Detected inf/nan during batch_number=1" in stdout, (stdout, stderr)
            assert "NonFiniteError" in stderr
        else:  # every rank names its own module's gradient, before the step of batch 1
            assert code != 0
            assert "step 1 loss" not in stdout
            assert "module.2 (Gate) [grad_input[0]]" in stderr, stderr[-2000:]


def test_dist_check_and_log_level_variables_take_effect(job_env):
    code = """
import logging, sys
import torch
guard = sys.modules["numguard.distributed.guard"]._installed
print(guard is not None and guard.active, logging.getLogger("numguard").level)
"""
    out = run(["-c", code], job_env(NUMGUARD="1", NUMGUARD_DIST_CHECK="1", NUMGUARD_LOG_LEVEL="debug"))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", str(10)]


def test_numguard_off_ignores_dist_check(job_env):
    out = run(["-c", "import sys, torch; print('numguard' in sys.modules)"],
              job_env(NUMGUARD_DIST_CHECK="1"))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_dist_check_takes_effect_when_the_script_imports_numguard(job_env):
    # Without NUMGUARD=1, a script that imports numguard had no collective check until something
    # imported numguard.distributed: Accelerate's gathers of mismatched dicts before it were not
    # checked (rank 0 got rank 1's "c" under "b").
    code = """
import sys
import numguard
guard = sys.modules.get("numguard.distributed.guard")
print(guard is not None and guard.installed_guard() is not None and guard.installed_guard().active)
"""
    out = run(["-c", code], job_env(NUMGUARD_DIST_CHECK="1"))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"
    # unset or 0: numguard.distributed stays unloaded until used
    for value in (None, "0"):
        environ = job_env() if value is None else job_env(NUMGUARD_DIST_CHECK=value)
        out = run(["-c", "import sys, numguard; print('numguard.distributed' in sys.modules)"], environ)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == "False"
    out = run(["-c", "import numguard"], job_env(NUMGUARD_DIST_CHECK="2"))
    assert out.returncode != 0 and "NUMGUARD_DIST_CHECK" in out.stderr, out.stderr


def test_import_reads_only_the_dist_check_variable(job_env):
    # NOTE: [collective check at import]: a plain import reads NUMGUARD_DIST_CHECK alone. It read
    # NUMGUARD_DIST_TIMEOUT too, so a bad timeout failed the import of a script that never uses
    # torch.distributed (no other variable fails a plain import); numguard.distributed still names it.
    out = run(["-c", "import numguard; print('imported')"], job_env(NUMGUARD_DIST_TIMEOUT="abc"))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "imported"
    out = run(["-c", "import numguard"], job_env(NUMGUARD_DIST_CHECK="1", NUMGUARD_DIST_TIMEOUT="abc"))
    assert "NUMGUARD_DIST_TIMEOUT" in out.stderr, out.stderr


def test_compiled_model_in_an_unmodified_script(job_env):
    code = """
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
compiled = torch.compile(model)
x = torch.randn(4, 8)
for step in range(4):
    if step == 2:
        with torch.no_grad():
            model[2].weight[0, 0] = float("nan")
    compiled(x).sum().backward()
    print("step", step, flush=True)
"""
    out = run(["-c", code], job_env(NUMGUARD="1"))
    assert out.returncode != 0
    assert "step 1" in out.stdout and "step 2" not in out.stdout
    # The compiled module is the root; its submodules' frames are recorded inside the graph, so the
    # report names the first module that used the NaN weight, as eager mode does.
    assert "Detected inf/nan during batch_number=2" in out.stdout
    assert "first non-finite value in 2 (Linear) weight, output, forward pass, batch_number=2" in out.stdout
    assert "_orig_mod" not in out.stdout
    assert "NonFiniteError" in out.stderr and "batch_number=2" in out.stderr


@pytest.mark.parametrize("how", ["model.compile()", "model.compile(backend='eager')", "watched loss too"])
def test_model_compiled_in_place_in_an_unmodified_script(job_env, how):
    compile_call = {"model.compile()": "model.compile()",
                    "model.compile(backend='eager')": "model.compile(backend='eager')",
                    "watched loss too": "model.compile(); loss_fn = nn.MSELoss()"}[how]
    code = f"""
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
loss_fn = lambda out: out.pow(2).mean()
{compile_call}
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(4, 8)
for step in range(4):
    if step == 2:
        with torch.no_grad():
            model[2].weight.fill_(float("nan"))
    out = model(x)
    loss = loss_fn(out, torch.zeros_like(out)) if isinstance(loss_fn, nn.Module) else loss_fn(out)
    opt.zero_grad(); loss.backward(); opt.step()
    print("step", step, flush=True)
"""
    out = run(["-c", code], job_env(NUMGUARD="1"))
    assert out.returncode != 0, out.stdout
    assert "step 1" in out.stdout and "step 2" not in out.stdout
    assert "Detected inf/nan during batch_number=" in out.stdout
    assert "NonFiniteError" in out.stderr and "batch_number=2" in out.stderr


def test_settings_reach_the_watched_roots(job_env):
    out = run([SCRIPT, "--steps", "4"],
              job_env(NUMGUARD="1", NUMGUARD_TRACE_BATCHES="1", NUMGUARD_ABORT_AFTER="1"))
    assert out.returncode != 0
    assert "*** Starting batch number=1 ***" in out.stdout
    assert "*** Starting batch number=0 ***" not in out.stdout
    assert "abort_after_batch_num=1" in out.stderr
    assert "step 1 loss" not in out.stdout  # stopped after the forward of batch 1


def test_roots_made_anew_every_step_do_not_pile_up(job_env):
    code = """
import gc
import torch
from torch import nn
model = nn.Linear(4, 2)
for _ in range(30):
    loss = nn.MSELoss()(model(torch.randn(3, 4)), torch.zeros(3, 2))  # a new loss module per step
    loss.backward()
gc.collect()
from numguard import _startup
print(len(_startup.auto_watcher().inspectors))
"""
    out = run(["-c", code], job_env(NUMGUARD="1"))
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.strip()) <= 2


def test_torchrun_two_ranks(job_env):
    # The launcher itself starts with NUMGUARD=1 too (it imports torch); it must not get in the way.
    args = ["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
            "--master_port", str(free_port()), SCRIPT, "--steps", "3", "--overflow-at", "1"]
    out = run(args, job_env(NUMGUARD="1"))
    assert out.returncode != 0
    text = out.stdout + out.stderr
    assert text.count("Detected inf/nan during batch_number=1") == 2
    for rank in range(2):
        assert text.count(f"numguard.errors.NonFiniteError: numguard: inf/nan detected on rank {rank} "
                          "during batch_number=1 in module.3 (Linear) [output]") == 1


def test_trainer_debug_option_is_served_by_numguard_alone(job_env):
    code = """
import torch
import transformers.trainer as trainer_module
print(getattr(trainer_module.DebugUnderflowOverflow, "__numguard_serves__", False))
"""
    out = run(["-c", code], job_env(NUMGUARD="1"))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"
    off = run(["-c", code], job_env())
    assert off.returncode == 0, off.stderr
    assert off.stdout.strip() == "False"


TRAINER_DEBUG_SCRIPT = """
import sys, tempfile
sys.path.insert(0, "tests")
import torch
from transformers import Trainer, TrainingArguments
from integ_models import TinyNet, samples
torch.manual_seed(0)
args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=4, max_steps=4,
                         logging_steps=1, report_to=[], use_cpu=True, seed=0, save_strategy="no",
                         disable_tqdm=True, debug="underflow_overflow")
Trainer(model=TinyNet(poison_at=2), args=args, train_dataset=samples()).train()
"""


def test_trainer_debug_option_prints_and_raises_what_transformers_does(job_env):
    """An unmodified Trainer script with debug="underflow_overflow": under NUMGUARD=1 numguard's
    drop-in serves the option, and the job's stdout and the exception line of its traceback are
    byte for byte those of Transformers' own DebugUnderflowOverflow."""
    pytest.importorskip("transformers")
    theirs = run(["-c", TRAINER_DEBUG_SCRIPT], job_env())
    ours = run(["-c", TRAINER_DEBUG_SCRIPT], job_env(NUMGUARD="1"))
    assert theirs.returncode == ours.returncode == 1, ours.stderr
    assert "Detected inf/nan during batch_number=2" in theirs.stdout and "poison Poison" in theirs.stdout
    assert ours.stdout == theirs.stdout
    last = theirs.stderr.strip().splitlines()[-1]
    assert last.startswith("ValueError: DebugUnderflowOverflow: inf/nan detected, aborting")
    assert ours.stderr.strip().splitlines()[-1] == last
    assert "served by numguard's drop-in" in ours.stderr
    assert "NonFiniteError" not in ours.stderr


def test_dist_check_turns_accelerate_debug_mode_off(job_env):
    code = "import os, torch; print(os.environ.get('ACCELERATE_DEBUG_MODE'))"
    out = run(["-c", code], job_env(NUMGUARD="1", NUMGUARD_DIST_CHECK="1", ACCELERATE_DEBUG_MODE="1"))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "0"
    assert "checked by numguard's collective check only" in out.stderr


ACCELERATE_SCRIPT = os.path.join(REPO, "tests", "scripts", "unmodified_accelerate.py")


@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_unmodified_accelerate_script(job_env, precision):
    """NUMGUARD=1 on an Accelerate script that never imports numguard (prepare, accelerator.backward,
    a TransformerEncoder with PyTorch's causal mask): a healthy run prints nothing of numguard's; an
    overflow stops the job at its step, named in the report."""
    pytest.importorskip("accelerate")
    args = [ACCELERATE_SCRIPT, "--steps", "4", "--mixed-precision", precision]
    healthy = run(args, job_env(NUMGUARD="1"))
    assert healthy.returncode == 0, healthy.stderr
    assert "finished 4 steps" in healthy.stdout
    assert "numguard" not in healthy.stdout + healthy.stderr, healthy.stdout + healthy.stderr

    tripped = run(args + ["--overflow-at", "2"], job_env(NUMGUARD="1"))
    assert tripped.returncode != 0
    assert "step 1 loss" in tripped.stdout and "step 2 loss" not in tripped.stdout
    assert "Detected inf/nan during batch_number=2" in tripped.stdout
    assert "NonFiniteError" in tripped.stderr and "encoder.layers.1.linear2" in tripped.stderr
