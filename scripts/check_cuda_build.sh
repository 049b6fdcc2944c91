#!/usr/bin/env bash
# CUDA build check (no GPU needed): in a virtual environment with a CUDA build of torch, build
# numguard with its CUDA kernels, import it, and assert that every op has a CUDA kernel registered
# (tests/test_cuda_build.py with NUMGUARD_EXPECT_CUDA_KERNELS=1).
#
# The build happens in a copy of the source tree (build/cuda-check/src), so the numguard/_C*.so of
# the CPU build in the repository (an ABI-incompatible torch) is left alone.
#
# Environment:
#   NUMGUARD_CUDA_VENV   virtual environment to use or create (default: .venv-cuda in the repo)
#   NUMGUARD_CUDA_TORCH  torch requirement for it (default: torch==2.14.1, a CUDA 13.0 build)
#   TORCH_CUDA_ARCH_LIST architectures to build (default: 8.0;9.0)
#   MAX_JOBS             parallel compile jobs (default: 2)
#   PYTHON               interpreter that creates the venv (default: python3)
#
# Never skips silently: when the check cannot run it says why and exits non-zero.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
VENV="${NUMGUARD_CUDA_VENV:-$ROOT/.venv-cuda}"
TORCH_REQ="${NUMGUARD_CUDA_TORCH:-torch==2.14.1}"
PYTHON="${PYTHON:-python3}"
WORK="$ROOT/build/cuda-check"
SRC="$WORK/src"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-8.0;9.0}"
export MAX_JOBS="${MAX_JOBS:-2}"

say() { echo "check_cuda_build: $*"; }
cannot_run() {
  say "CANNOT RUN the CUDA build check: $*"
  exit 2
}
elapsed() { echo $(( $(date +%s) - $1 ))s; }

# --- preconditions -----------------------------------------------------------------------------
command -v nvcc >/dev/null 2>&1 || cannot_run "nvcc is not on PATH (install the CUDA toolkit, 13.0 to match $TORCH_REQ)"
say "nvcc: $(nvcc --version | grep -i release || echo unknown)"
if [ ! -x "$VENV/bin/python" ]; then
  command -v "$PYTHON" >/dev/null 2>&1 || cannot_run "no Python interpreter '$PYTHON' to create $VENV"
  # A CUDA build of torch needs about 5.5 GB; leave room for the build too.
  mkdir -p "$(dirname "$VENV")"
  free_kb=$(df -Pk "$(dirname "$VENV")" | awk 'NR==2 {print $4}')
  if [ "${free_kb:-0}" -lt $((7 * 1024 * 1024)) ]; then
    cannot_run "only $((free_kb / 1024)) MB free under $(dirname "$VENV"); the CUDA build of torch needs about 7 GB"
  fi
fi

# --- environment -------------------------------------------------------------------------------
t0=$(date +%s)
if [ ! -x "$VENV/bin/python" ]; then
  say "creating $VENV"
  "$PYTHON" -m venv "$VENV" || cannot_run "'$PYTHON -m venv $VENV' failed"
fi
PY="$VENV/bin/python"
pip_install() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)" 2>/dev/null; then
  say "installing $TORCH_REQ (a CUDA build, about 5 GB)"
  pip_install "$TORCH_REQ" || cannot_run "pip could not install $TORCH_REQ into $VENV"
fi
"$PY" -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)" 2>/dev/null \
  || cannot_run "torch in $VENV is not a CUDA build ($("$PY" -c 'import torch; print(torch.__version__)'))"
for mod in setuptools wheel ninja numpy pytest pytest_timeout; do
  if ! "$PY" -c "import $mod" 2>/dev/null; then
    pip_install setuptools wheel ninja numpy pytest pytest-timeout || cannot_run "pip could not install the build/test tools"
    break
  fi
done
say "environment ready in $(elapsed "$t0"): $("$PY" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda)')"

# --- source copy -------------------------------------------------------------------------------
rm -rf "$SRC"
mkdir -p "$SRC"
if git -C "$ROOT" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  # Tracked and untracked-but-not-ignored files: exactly the sources, no build outputs or venvs.
  git -C "$ROOT" ls-files -z --cached --others --exclude-standard \
    | (cd "$ROOT" && xargs -0 -r sh -c 'for f; do [ -f "$f" ] && printf "%s\0" "$f"; done' sh) \
    | tar -C "$ROOT" --null -T - -cf - | tar -C "$SRC" -xf -
else
  tar -C "$ROOT" --exclude='./.venv*' --exclude='./build' --exclude='./.git' --exclude='*.so' -cf - . \
    | tar -C "$SRC" -xf -
fi

# --- build -------------------------------------------------------------------------------------
t1=$(date +%s)
say "building with CUDA kernels (TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST, MAX_JOBS=$MAX_JOBS) in $SRC"
if ! (cd "$SRC" && NUMGUARD_BUILD_CUDA=1 "$PY" setup.py -q build_ext --inplace > "$WORK/build.log" 2>&1); then
  tail -n 60 "$WORK/build.log"
  say "FAILED: the extension did not build with its CUDA kernels (full log: $WORK/build.log)"
  exit 1
fi
grep -E "^numguard:" "$WORK/build.log" || true
say "built in $(elapsed "$t1")"

# --- import and registration -------------------------------------------------------------------
cd "$SRC"
export PYTHONPATH="$SRC${PYTHONPATH:+:$PYTHONPATH}"
export NUMGUARD_BACKEND=native NUMGUARD_EXPECT_CUDA_KERNELS=1
unset NUMGUARD
"$PY" - <<'EOF'
import torch
import numguard
from numguard import ops

archs = ops.native_module().cuda_architectures()
print(f"check_cuda_build: numguard imported from {numguard.__file__}; backend={numguard.backend()}; "
      f"CUDA architectures={archs}; GPU visible: {torch.cuda.is_available()}")
expected = ("tensor_stats", "multi_tensor_stats", "record_", "quant_stats", "quant_watch_")
missing = [op for op in expected if not torch._C._dispatch_has_kernel_for_dispatch_key(f"numguard::{op}", "CUDA")]
assert archs, "the extension reports no CUDA architectures"
assert not missing, f"no CUDA kernel registered for: {missing}"
print(f"check_cuda_build: CUDA kernels registered for {', '.join(expected)}")
EOF
"$PY" -m pytest -q -p no:cacheprovider tests/test_cuda_build.py tests/test_quant_cuda.py
say "OK in $(elapsed "$t0")"
