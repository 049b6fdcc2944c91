"""python -m numguard report FILE [--plot OUT.png], and install-hook."""
import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import numguard
from numguard import _startup, cli, dump, plot

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def dump_file(tmp_path):
    """A dump written by a real fp16 overflow with on_trip="dump"."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).half()
    with torch.no_grad():
        model[2].weight.fill_(3e4)
    with pytest.warns(numguard.errors.NonFiniteWarning):
        with numguard.watch(model, on_trip="dump", dump_dir=tmp_path, report_to=None,
                            headroom=0):
            model(torch.randn(4, 8, dtype=torch.float16))
    files = sorted(p for p in os.listdir(tmp_path) if p.endswith(".json"))
    assert len(files) == 1
    return tmp_path / files[0]


def run_cli(*args):
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMGUARD")}
    env["PYTHONPATH"] = os.pathsep.join([REPO] + [p for p in [env.get("PYTHONPATH")] if p])
    return subprocess.run([sys.executable, "-m", "numguard"] + list(args), capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=240)


def test_report_and_plot_round_trip(dump_file, tmp_path):
    out_png = tmp_path / "frames.png"
    out = run_cli("report", str(dump_file), "--plot", str(out_png))
    assert out.returncode == 0, out.stderr
    text = dump.render_file(dump_file)
    assert out.stdout.startswith(text)
    assert "Detected inf/nan during batch_number=0" in out.stdout
    assert "2 Linear" in out.stdout
    data = out_png.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    from PIL import Image
    with Image.open(out_png) as image:
        image.load()
        width, height = image.size
    assert width > 100 and height > 100


def test_plot_draws_each_frame_and_the_dtype_limits(dump_file):
    data = dump.load(dump_file)
    series = plot.frame_series(data)
    shown = [f for f in data["frames"] if f.get("in_report", True)]
    assert len(series) == len(shown)
    assert series[-1][3]                     # the offending frame holds Inf/NaN
    assert "float16" in series[-1][4]
    assert plot.dtype_limits("torch.float16") == (65504.0, torch.finfo(torch.float16).tiny)
    assert plot.dtype_limits("torch.bfloat16") == (torch.finfo(torch.bfloat16).max,
                                                   torch.finfo(torch.bfloat16).tiny)
    assert plot.dtype_limits("torch.int64") is None
    finite_max = [s[1] for s in series if s[1] is not None]
    assert finite_max and all(0 < v <= 65504.0 for v in finite_max)


def test_plot_reads_back_with_matplotlib(dump_file, tmp_path):
    import matplotlib.image
    out_png = tmp_path / "plot.png"
    assert cli.main(["report", str(dump_file), "--plot", str(out_png)]) == 0
    pixels = matplotlib.image.imread(out_png)
    assert pixels.ndim == 3 and pixels.shape[0] > 0 and pixels.shape[1] > 0


def test_missing_file_is_a_clear_error(tmp_path, capsys):
    assert cli.main(["report", str(tmp_path / "nope.json")]) == 2
    err = capsys.readouterr().err
    assert "nope.json" in err and "not a file" in err


@pytest.mark.parametrize("content", ["{not json", json.dumps({"format": "something-else"}),
                                     json.dumps([1, 2])])
def test_unreadable_file_is_a_clear_error(tmp_path, capsys, content):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    assert cli.main(["report", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "cannot read" in err and "bad.json" in err


def test_bad_file_exit_status_from_the_command_line(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    out = run_cli("report", str(bad))
    assert out.returncode == 2
    assert "bad.json" in out.stderr and "Traceback" not in out.stderr


def test_plot_without_matplotlib_says_how_to_install_it(dump_file, tmp_path):
    code = ("import sys; sys.modules['matplotlib'] = None;"
            "from numguard.cli import main; sys.exit(main(sys.argv[1:]))")
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMGUARD")}
    env["PYTHONPATH"] = REPO
    out = subprocess.run([sys.executable, "-c", code, "report", str(dump_file), "--plot",
                          str(tmp_path / "x.png")], capture_output=True, text=True, env=env,
                         timeout=240)
    assert out.returncode == 2
    assert "pip install matplotlib" in out.stderr
    assert "Detected inf/nan" in out.stdout  # the text report still came out
    assert not (tmp_path / "x.png").exists()


def test_no_command_prints_usage(capsys):
    assert cli.main([]) == 2
    assert "report" in capsys.readouterr().err


def test_install_hook_into_a_folder_and_remove_it(tmp_path, capsys):
    assert cli.main(["install-hook", "--target", str(tmp_path)]) == 0
    installed = tmp_path / _startup.PTH_NAME
    with open(_startup.pth_path()) as f:
        assert installed.read_text() == f.read()
    assert cli.main(["install-hook", "--target", str(tmp_path), "--remove"]) == 0
    assert not installed.exists()
    assert cli.main(["install-hook", "--target", str(tmp_path / "missing")]) == 2
