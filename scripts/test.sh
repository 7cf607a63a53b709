#!/usr/bin/env bash
# The test command: install (idempotent), then run the whole suite on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
VENV="${DISAGG_VENV:-.venv}"
[ -n "${VIRTUAL_ENV:-}" ] || . "$VENV/bin/activate"
export OMP_NUM_THREADS=1
python -m pytest -q "$@"
