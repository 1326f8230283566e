#!/usr/bin/env bash
# The kvpress peer's own environment (kvpress needs transformers < 5.3; vLLM's needs newer).
# Idempotent: does nothing when the stamp matches this file.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${SEKV_KVPRESS_VENV:-.venv-kvpress}"
STAMP="$VENV/.sekv-stamp"
WANT="$(sha256sum scripts/setup_kvpress.sh | cut -c1-16)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]]; then
  exit 0
fi
echo "setup_kvpress: creating $VENV (torch 2.13 CPU, kvpress 0.5.5, transformers < 5.3)" >&2
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q --disable-pip-version-check torch==2.13.0 kvpress==0.5.5 'transformers>=4.56,<5.3' tqdm
echo "$WANT" > "$STAMP"
