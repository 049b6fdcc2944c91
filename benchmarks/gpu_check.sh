#!/usr/bin/env bash
# The GPU check in one call (see benchmarks/gpu_check.py for the phases, their order and targets):
#   bash benchmarks/gpu_check.sh              on a machine with an NVIDIA GPU: builds numguard in
#                                             place with its CUDA kernels, then checks and measures
#   bash benchmarks/gpu_check.sh --rehearse   the same script without a GPU: each phase's CPU
#                                             counterpart, "SKIPPED (needs CUDA)" where there is none
# Ends within GPU_CHECK_BUDGET_S (default 420) seconds; prints PASS / FAIL / SKIPPED / CUT per phase
# and each figure against its target; exit 0 all passed, 1 a phase failed, 2 a phase was cut.
# Environment: PYTHON (default python3), GPU_CHECK_BUDGET_S, TORCH_CUDA_ARCH_LIST (default 9.0),
# MAX_JOBS, OUT (if set, the JSON summary is written there too).
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if ! command -v "$PY" >/dev/null 2>&1; then
  echo "gpu_check: no Python interpreter '$PY' (set PYTHON to one that has torch installed)"
  exit 1
fi
export PYTHON="$PY"
exec "$PY" benchmarks/gpu_check.py "$@"
