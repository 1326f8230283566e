"""`sekv-vllm generate`: the shell entry for offline generation prints answers and figures."""
import json
import subprocess
import sys

import pytest

from sekv_vllm.tasks.ruler import make_sample

pytestmark = pytest.mark.vllm


def test_generate_prints_the_answer_and_compression_figures(model_dir, count_tokens, tmp_path):
    sample = make_sample("needle", 1200, 0.5, 5, count_tokens)
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(sample.prompt)
    proc = subprocess.run(
        [sys.executable, "-m", "sekv_vllm.entrypoints.cli", "generate", "--model", model_dir,
         "--prompt-file", str(prompt), "--sekv-config", '{"budget_ratio": 0.5}', "--max-tokens", "24",
         "--max-model-len", "2048"],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout[proc.stdout.index("{\n"):])
    (out,) = result["results"]
    assert out["answer"].strip() and out["prompt_tokens"] > 1200
    assert out["sekv"]["budget_rows"] == -(-out["prompt_tokens"] // 2) and out["sekv"]["spans"] > 0
