"""numguard as users install it: a wheel built from this checkout, installed into a fresh virtual
environment and used from a folder outside the source tree, so nothing is imported from the
checkout. What a wheel leaves out (a subpackage, the start-up hook, the extension) fails here.

The fresh environment borrows torch from the test's own environment through a path file (one
`.pth` line naming that site-packages folder): path files in a folder added that way are not run,
so the checkout's editable install and its start-up hook stay out of it.
"""
import glob
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile

import pytest

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "tests", "scripts", "unmodified_train.py")

pytestmark = pytest.mark.slow


def _run(args, **kwargs):
    kwargs.setdefault("timeout", 900)
    return subprocess.run(args, capture_output=True, text=True, **kwargs)


def _clean_env(**variables):
    environ = {k: v for k, v in os.environ.items()
               if not k.startswith("NUMGUARD") and k not in ("PYTHONPATH", "PYTHONHOME")}
    environ.setdefault("OMP_NUM_THREADS", "1")
    environ.update(variables)
    return environ


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    # A copy without build outputs: a stale build/ folder would hide a package the build leaves out.
    source = tmp_path_factory.mktemp("source") / "numguard-src"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(
        ".git", ".venv*", "build", "dist", "*.egg-info", "__pycache__", "*.so", ".pytest_cache"))
    # --no-build-isolation: build against the torch the tests run on (as the README's set-up does).
    built = _run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps",
                  "--disable-pip-version-check", "-q", "-w", str(out), str(source)], env=_clean_env())
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    wheels = glob.glob(str(out / "numguard-*.whl"))
    assert len(wheels) == 1, os.listdir(out)
    return wheels[0]


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory):
    """A fresh virtual environment with the wheel installed; returns its python."""
    root = tmp_path_factory.mktemp("venv")
    made = _run([sys.executable, "-m", "venv", "--without-pip", str(root / "env")], env=_clean_env())
    assert made.returncode == 0, made.stderr
    python = str(root / "env" / "bin" / "python")
    site_dir = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                    env=_clean_env()).stdout.strip()
    torch_site = os.path.dirname(os.path.dirname(torch.__file__))
    with open(os.path.join(site_dir, "borrowed_torch.pth"), "w", encoding="utf-8") as f:
        f.write(torch_site + "\n")
    installed = _run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps",
                      "--no-index", "--disable-pip-version-check", "-q", wheel], env=_clean_env())
    assert installed.returncode == 0, installed.stdout[-3000:] + installed.stderr[-3000:]
    return python


def _source_packages():
    found = []
    for folder, dirs, files in os.walk(os.path.join(REPO, "numguard")):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        if "__init__.py" in files:
            found.append(os.path.relpath(folder, REPO).replace(os.sep, "/"))
    return sorted(found)


def test_wheel_ships_every_package_the_hook_and_the_extension(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    for package in _source_packages():
        assert f"{package}/__init__.py" in names, f"{package} is missing from the wheel"
    assert "numguard-startup.pth" in names
    assert "numguard/_startup.pth" in names
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    assert f"numguard/_C{suffix}" in names, [n for n in names if "_C" in n]


def test_installed_wheel_imports_outside_the_source_tree(venv, tmp_path):
    code = ("import numguard, numguard.distributed, numguard.distributed.channel, os; "
            "print(os.path.dirname(numguard.__file__)); print(numguard.backend())")
    out = _run([venv, "-c", code], cwd=tmp_path, env=_clean_env())
    assert out.returncode == 0, out.stderr
    folder, backend = out.stdout.split()
    assert not os.path.realpath(folder).startswith(os.path.realpath(REPO) + os.sep), folder
    assert backend == "native", out.stderr


def test_installed_start_up_hook_stops_both_ranks_naming_the_rank_that_tripped(venv, tmp_path):
    """NUMGUARD=1 on an unmodified two-rank gloo script; only rank 1 overflows."""
    script = tmp_path / "train.py"
    script.write_text(open(SCRIPT, encoding="utf-8").read())
    from dist_workers import free_port, rank_environ, run_rank_processes

    port = free_port()
    environs = [rank_environ(_clean_env(NUMGUARD="1"), rank, 2, port) for rank in range(2)]
    results = run_rank_processes([venv, str(script), "--steps", "3", "--overflow-at", "1", "--overflow-rank", "1"],
                                 environs, str(tmp_path), timeout=300)
    for rank, (code, stdout, stderr) in enumerate(results):
        assert "step 0 loss" in stdout, stderr[-3000:]
        assert "step 1 loss" not in stdout, stdout
        assert code != 0
        assert "NonFiniteError" in stderr, stderr[-3000:]
        assert "rank 1" in stderr.splitlines()[-1], (rank, stderr[-3000:])
    # Only the rank that tripped prints the frames.
    assert "Detected inf/nan during batch_number=1" in results[1][1]
    assert "Detected inf/nan" not in results[0][1]


def test_installed_report_command_renders_a_dump(venv, tmp_path):
    dump_dir = tmp_path / "dumps"
    environ = _clean_env(NUMGUARD="1", NUMGUARD_ON_TRIP="dump", NUMGUARD_DUMP_DIR=str(dump_dir))
    trained = _run([venv, SCRIPT, "--steps", "3", "--overflow-at", "1"], cwd=tmp_path, env=environ)
    assert trained.returncode == 0, trained.stderr[-3000:]
    dumps = sorted(dump_dir.glob("*.json"))
    assert dumps, trained.stderr[-3000:]
    # The model and the loss function are separate roots: each trip writes a dump of its own.
    rendered = []
    for dump in dumps:
        shown = _run([venv, "-m", "numguard", "report", str(dump)], cwd=tmp_path, env=_clean_env())
        assert shown.returncode == 0, shown.stderr
        assert "abs min  abs max  metadata" in shown.stdout
        rendered.append(shown.stdout)
    assert any("Detected inf/nan during batch_number=1" in text and "                  3 Linear\n" in text
               for text in rendered), rendered
