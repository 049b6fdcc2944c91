"""Which implementation serves the ops, and how numguard behaves when the extension cannot load."""
import os
import subprocess
import sys

import pytest

import numguard

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_python(code, **env):
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("NUMGUARD")}
    full_env.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env,
                          cwd=REPO, timeout=300)


def test_native_backend_when_required():
    # scripts/test.sh sets NUMGUARD_REQUIRE_NATIVE=1 so that a broken build cannot pass on the fallback.
    if os.environ.get("NUMGUARD_REQUIRE_NATIVE") != "1":
        pytest.skip("NUMGUARD_REQUIRE_NATIVE is not 1: the suite may run on either backend")
    assert numguard.backend() == "native", numguard.ops.fallback_reason()


def test_forced_torch_backend_is_quiet():
    out = run_python("import warnings; warnings.simplefilter('error');"
                     "import numguard; print(numguard.backend())", NUMGUARD_BACKEND="torch")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "torch"


def test_failed_extension_load_warns_once_and_falls_back():
    code = (
        "import sys, warnings\n"
        "sys.modules['numguard._C'] = None  # makes `from . import _C` raise ImportError\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    import numguard, torch\n"
        "    import importlib; importlib.import_module('numguard.ops')\n"
        "mine = [w for w in caught if 'native kernels unavailable' in str(w.message)]\n"
        "print(numguard.backend(), len(mine))\n"
        "x = torch.tensor([1.0, float('nan')])\n"
        "print(numguard.tensor_stats(x)[3].item())\n"
    )
    out = run_python(code)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.split()
    assert lines[:2] == ["torch", "1"]
    assert float(lines[2]) == 1.0


def test_invalid_backend_setting_names_the_variable():
    out = run_python("import numguard", NUMGUARD_BACKEND="cuda")
    assert out.returncode != 0
    assert "NUMGUARD_BACKEND='cuda'" in out.stderr and "auto, native or torch" in out.stderr


# ---------------------------------------------------------------------------------------------
# numguard.schema: the one statement of the layout, torch-free, agreeing with torch and the extension

def test_schema_imports_without_torch(monkeypatch):
    import importlib.util

    monkeypatch.setitem(sys.modules, "torch", None)  # any `import torch` now raises ImportError
    spec = importlib.util.spec_from_file_location("schema_without_torch",
                                                  os.path.join(REPO, "numguard", "schema.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.STAT_FIELDS == numguard.STAT_FIELDS and module.STATE_SIZE == 4


def test_schema_agrees_with_torch_and_the_modules_that_alias_it():
    import torch

    from numguard import _torch_ops, ops, report, schema

    assert numguard.STAT_FIELDS is ops.STAT_FIELDS is schema.STAT_FIELDS
    assert [schema.STAT_FIELDS[i] for i in (schema.ABS_MIN, schema.SUBNORMAL)] == ["abs_min", "subnormal"]
    assert _torch_ops.NUM_STATS == ops.NUM_STATS == len(schema.STAT_FIELDS) == 8
    assert _torch_ops.STATE_SIZE == ops.STATE_SIZE == len(schema.STATE_INITIAL) == 4
    assert schema.STATE_FIELDS[schema.FIRST_HEADROOM_POSITION] == "first_headroom_position"
    assert (report.KIND_TENSOR, report.KIND_NONE, report.KIND_NOT_A_TENSOR) == schema.LINE_KINDS
    for name, info in schema.DTYPES.items():
        dtype = getattr(torch, name, None)
        if dtype is None or info.max is None:
            continue
        limits = torch.finfo(dtype) if info.tiny is not None else torch.iinfo(dtype) if dtype != torch.bool else None
        assert info.max == (limits.max if limits is not None else 1), name
        assert info.tiny == (getattr(limits, "tiny", None)), name
        assert ops.dtype_entry(dtype) is info
    assert schema.LOW_PRECISION_DTYPES == ("float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")
    assert ops.dtype_entry(torch.complex64).recordable is False and ops.dtype_entry(torch.qint8) is None
    ring, state = ops.new_ring(3)
    assert ring.shape == (3, schema.NUM_STATS) and state.tolist() == list(schema.STATE_INITIAL)


@pytest.mark.skipif(numguard.ops.native_module() is None, reason="native extension not loaded")
def test_extension_layout_matches_schema():
    native = numguard.ops.native_module()
    assert tuple(native.stat_fields()) == numguard.schema.STAT_FIELDS
    assert tuple(native.state_layout()) == numguard.schema.STATE_FIELDS
    assert [row[0] for row in native.dtypes()] == list(numguard.schema.RECORDABLE_DTYPES)
    assert numguard.ops.schema_mismatch(native.stat_fields(), native.state_layout(), native.dtypes()) is None


def test_forged_layout_disagreements_are_named():
    from numguard import ops, schema

    fields, state = list(schema.STAT_FIELDS), list(schema.STATE_FIELDS)
    rows = ops._native_dtype_rows()
    assert ops.schema_mismatch(fields, state, rows) is None
    swapped = fields[:3] + [fields[4], fields[3]] + fields[5:]
    reason = ops.schema_mismatch(swapped, state, rows)
    assert "stats record fields" in reason and "'pos_inf', 'nan'" in reason and "rebuild" in reason
    assert "recording state fields" in ops.schema_mismatch(fields, state[:3], rows)
    wrong_max = [(n, 65505.0 if n == "float16" else m, t, h) for n, m, t, h in rows]
    assert "('float16', 65505.0" in ops.schema_mismatch(fields, state, wrong_max)
    no_headroom = [(n, m, t, 0.0) for n, m, t, _ in rows]
    assert "bfloat16" in ops.schema_mismatch(fields, state, no_headroom)
    extra = rows + [("float8_e4m3fnuz", 240.0, 0.0078125, 0.0)]
    assert "float8_e4m3fnuz" in ops.schema_mismatch(fields, state, extra)


FORGED_SCHEMA = r"""
import importlib.util, os, sys
spec = importlib.util.spec_from_file_location("numguard.schema", os.path.join("numguard", "schema.py"))
forged = importlib.util.module_from_spec(spec)
spec.loader.exec_module(forged)
forged.STATE_FIELDS = ("tripped", "headroom_hit", "first_trip_position", "first_headroom_position")
sys.modules["numguard.schema"] = forged  # what a stale or edited schema.py would be
import warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import numguard
print(numguard.backend())
print(numguard.ops.fallback_reason())
os.environ["NUMGUARD_BACKEND"] = "native"
try:
    numguard.ops._load_native()
except ImportError as exc:
    print("native:", exc)
"""


@pytest.mark.skipif(numguard.ops.native_module() is None, reason="native extension not loaded")
def test_layout_mismatch_falls_back_and_fails_under_native_backend():
    out = run_python(FORGED_SCHEMA)
    assert out.returncode == 0, out.stderr
    backend, reason, native = out.stdout.splitlines()
    assert backend == "torch"
    assert "does not match numguard.schema" in reason and "recording state fields" in reason
    assert native.startswith("native: NUMGUARD_BACKEND=native but") and "recording state fields" in native


# ---------------------------------------------------------------------------------------------
# Build info: the extension is loaded only under the torch it was built for

def test_build_mismatch_names_both_versions_and_the_fix():
    from numguard import ops

    assert ops.build_mismatch("2.13.0+cpu", None, "2.13.0+cpu", None) is None
    reason = ops.build_mismatch("2.12.1+cpu", None, "2.13.0+cpu", None)
    assert "built for torch 2.12.1+cpu, running torch 2.13.0+cpu" in reason
    assert "pip install --no-build-isolation -e ." in reason
    reason = ops.build_mismatch("2.14.1+cu130", "13.0", "2.14.1+cu130", "12.8")
    assert "CUDA 13.0" in reason and "CUDA 12.8" in reason and "rebuild" in reason


def _fake_module(name, **attrs):
    import importlib.machinery
    import types

    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    module.__dict__.update(attrs)
    return module


def test_build_info_is_checked_before_the_extension_is_imported(monkeypatch):
    """A forged build-info file: the loader falls back (or raises under NUMGUARD_BACKEND=native)
    without touching `_C`, here a stand-in that would fail on any use."""
    from numguard import ops

    monkeypatch.setitem(sys.modules, "numguard._C", _fake_module("numguard._C"))
    monkeypatch.setitem(sys.modules, "numguard._build_info",
                        _fake_module("numguard._build_info", TORCH_VERSION="1.13.0", CUDA_VERSION=None))
    monkeypatch.setenv("NUMGUARD_BACKEND", "auto")
    native, reason = ops._load_native()
    assert native is None and "built for torch 1.13.0, running torch" in reason
    monkeypatch.setenv("NUMGUARD_BACKEND", "native")
    with pytest.raises(ImportError, match="NUMGUARD_BACKEND=native but .*built for torch 1.13.0"):
        ops._load_native()
    monkeypatch.setitem(sys.modules, "numguard._build_info", None)  # the file is missing
    monkeypatch.setenv("NUMGUARD_BACKEND", "auto")
    native, reason = ops._load_native()
    assert native is None and "numguard/_build_info.py" in reason and "is missing" in reason


@pytest.mark.skipif(numguard.ops.native_module() is None, reason="native extension not loaded")
def test_build_info_was_written_beside_the_extension():
    import torch

    from numguard import _build_info

    native = numguard.ops.native_module()
    assert os.path.dirname(_build_info.__file__) == os.path.dirname(native.__file__)
    assert (_build_info.TORCH_VERSION, _build_info.CUDA_VERSION) == (torch.__version__, torch.version.cuda)


# ---------------------------------------------------------------------------------------------
# NUMGUARD_CPU_ISA: validated like every NUMGUARD_* variable, in Python and in the extension

def test_cpu_isa_choices_cover_the_built_levels():
    assert numguard.ops.CPU_ISA_CHOICES == ("avx512", "avx2", "baseline")
    native = numguard.ops.native_module()
    if native is not None:
        built = native.cpu_capabilities()[0].split("=")[1].split(",")
        assert set(built) <= set(numguard.ops.CPU_ISA_CHOICES)


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_bad_cpu_isa_fails_at_import(backend):
    out = run_python("import numguard", NUMGUARD_CPU_ISA="avx9", NUMGUARD_BACKEND=backend)
    assert out.returncode != 0
    assert "NUMGUARD_CPU_ISA='avx9' is not valid: accepted values are avx512, avx2 or baseline" in out.stderr


NATIVE_ISA_CHECK = r"""
import glob, importlib.util, os, torch
# The extension alone, without numguard.ops (which checks the variable first).
path = glob.glob(os.path.join("numguard", "_C*.so"))[0]
spec = importlib.util.spec_from_file_location("numguard._C", path)
native = importlib.util.module_from_spec(spec)
spec.loader.exec_module(native)
for call in (native.cpu_capabilities, lambda: torch.ops.numguard.tensor_stats.default(torch.ones(3))):
    try:
        call()
        print("accepted")
    except ValueError as exc:
        print(str(exc).splitlines()[0])
"""


@pytest.mark.skipif(numguard.ops.native_module() is None, reason="native extension not loaded")
def test_extension_itself_rejects_a_bad_cpu_isa():
    out = run_python(NATIVE_ISA_CHECK, NUMGUARD_CPU_ISA="avx-512")
    assert out.returncode == 0, out.stderr
    expected = "NUMGUARD_CPU_ISA='avx-512' is not valid: use one of avx512, avx2, baseline"
    assert out.stdout.splitlines() == [expected, expected]
    out = run_python(NATIVE_ISA_CHECK, NUMGUARD_CPU_ISA=" AVX2 ")  # trimmed, any case: like in Python
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["accepted", "accepted"]
