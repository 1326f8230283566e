#!/usr/bin/env bash
# The main job: set-up (idempotent), then sekv answers a needle question in a ~2K-token essay
# haystack on the default model, next to stock vLLM, with the compression figures.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. "${SEKV_VENV:-.venv}/bin/activate"
exec python -m benchmarks.demo "$@"
