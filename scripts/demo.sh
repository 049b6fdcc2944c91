#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run numguard's demo: a small transformer trained in fp16 until it
# overflows, and numguard's report of where the numbers went wrong.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${NUMGUARD_VENV:-.venv}/bin/python" -m numguard.demo "$@"
