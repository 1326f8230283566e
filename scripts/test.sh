#!/usr/bin/env bash
# The test command: set-up (idempotent), then every test (unit, Triton interpreter, vLLM).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. "${SEKV_VENV:-.venv}/bin/activate"
export TRITON_INTERPRET=1
exec python -m pytest -q -ra --durations=25 "$@"
