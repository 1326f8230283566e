"""The in-engine row-keeping methods with a kvpress press keep the rows it keeps (kvpress in its own venv)."""
import json
import subprocess
import sys

import pytest

from benchmarks.peers.kvpress_agreement import PRESSES
from sekv_vllm.methods import ROW_METHODS


@pytest.mark.kvpress
def test_every_row_keeping_method_keeps_what_its_kvpress_press_keeps_on_real_prompts(tmp_path):
    out = tmp_path / "agreement.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.peers.kvpress_agreement", "--budgets", "0.25",
                           "--out", str(out)], capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    assert sorted(r["method"] for r in results) == sorted(PRESSES)
    assert set(ROW_METHODS) - set(PRESSES) == {"h2o"}  # kvpress has no H2O press (its own reference tests it)
    for r in results:  # 4 prompts x 30 layers x 3 KV heads
        assert r["layer_heads"] == 360 and r["identical_layer_heads"] == 360, r
