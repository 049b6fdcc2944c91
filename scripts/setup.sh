#!/usr/bin/env bash
# One-time set-up, safe to re-run: a virtual environment in .venv with the CPU build of torch,
# the test and demo dependencies, and numguard built in place (its native CPU kernels).
#   NUMGUARD_VENV   where the environment lives (default: .venv in the repository)
#   NUMGUARD_TORCH  the torch requirement (default: torch==2.13.0, the CPU build)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${NUMGUARD_VENV:-.venv}"
TORCH_REQ="${NUMGUARD_TORCH:-torch==2.13.0}"
PYTHON="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
  echo "numguard setup: creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
pip_install() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }

if ! "$PY" -c "import torch" 2>/dev/null; then
  echo "numguard setup: installing $TORCH_REQ"
  pip_install "$TORCH_REQ"
fi
pip_install setuptools wheel ninja numpy pytest pytest-timeout \
  "transformers==5.24.0" "accelerate==1.15.0" "pytorch-lightning==2.6.6" matplotlib
echo "numguard setup: building the native kernels"
# --no-build-isolation: build against the torch installed above, not a fresh one pip would fetch.
pip_install --no-build-isolation -e .
"$PY" -c "import numguard; print('numguard', numguard.__version__, 'backend:', numguard.backend())"
