#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run numguard's test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV="${NUMGUARD_VENV:-.venv}"
# The suite asserts that the native kernels are in use, not the fallback, unless told otherwise.
export NUMGUARD_REQUIRE_NATIVE="${NUMGUARD_REQUIRE_NATIVE:-1}"
exec "$VENV/bin/python" -m pytest -q "$@"
