import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sekv_vllm.entrypoints.default_model import default_model_dir

JOB = Path(__file__).with_name("llm_job.py")
PAGES_JOB = Path(__file__).with_name("pages_job.py")


@pytest.fixture(scope="session")
def model_dir() -> str:
    path = default_model_dir()
    if not (path / "model.safetensors").exists():
        pytest.fail(f"default model missing at {path}: run `sekv-vllm prepare-model` (the README's set-up does)")
    return str(path)


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="session")
def count_tokens(tokenizer):
    return lambda text: len(tokenizer(text, add_special_tokens=False).input_ids)


def run_job(spec: dict, tmp_path: Path, timeout: int = 900, job: Path = JOB) -> dict:
    """Run `job` (llm_job.py unless told) on `spec` in a fresh process; returns its RESULT."""
    path = tmp_path / f"spec-{os.getpid()}-{len(list(tmp_path.iterdir()))}.json"
    path.write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, str(job), str(path)], capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise AssertionError(f"llm job failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
    result = json.loads(lines[-1][len("RESULT "):])
    result["stderr"] = proc.stderr
    return result
