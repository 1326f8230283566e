"""NVIDIA kvpress as a suite peer, run in its own virtual environment (it needs transformers < 5.3).

    bash scripts/setup_kvpress.sh            # once: .venv-kvpress with torch, transformers, kvpress
    python -m benchmarks.suite.run --backends vllm kvpress:snapkv --tasks needle --lengths 2000

The suite makes the samples (same seeds, same chat prompt text as the vLLM backends) and hands
them to `worker` in the kvpress environment: the prompt is cut where the user's turn ends, that
part (instructions, haystack and question, as sekv compresses them) is prefilled under the press
(its KV cache shrinks to the kept share), then the end of the turn, the assistant header and
greedy decoding run on the compressed cache, as kvpress's own pipeline runs its question.
kvpress's pipeline itself keeps the question out of the compressed part (question-agnostic);
in a first quick run that way SnapKV and ExpectedAttention found almost nothing on these tasks
(SnapKV 0.07 of full KV's 0.70 at a 0.5 budget), so the suite gives them the question, as
sekv has it. This module imports neither vLLM nor sekv_vllm, so it runs in that environment.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.peers.presses import PRESSES
from benchmarks.suite.records import make_record

REPO = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("SEKV_KVPRESS_VENV", REPO / ".venv-kvpress"))


def run(spec: dict) -> None:
    """Run `worker(spec)` in the kvpress environment (created by scripts/setup_kvpress.sh)."""
    subprocess.run(["bash", str(REPO / "scripts" / "setup_kvpress.sh")], check=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "PYTHONPATH": str(REPO)}
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="sekv-kvpress-") as spec_file:
        json.dump(spec, spec_file)  # the samples' text is too long for a command line
        spec_file.flush()
        proc = subprocess.run([str(VENV / "bin" / "python"), "-m", "benchmarks.peers.kvpress_run", spec_file.name],
                              cwd=REPO, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"kvpress worker failed (rc={proc.returncode}); its log is above")


def _generate(model, context_ids, question_ids, press, max_tokens: int, eos: set[int]):
    """Greedy answer after `question_ids`, with `context_ids` compressed by `press`; returns
    (token ids, kept KV entries)."""
    import torch
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.inference_mode():
        with press(model):
            model.model(input_ids=context_ids, past_key_values=cache)
        kept = cache.get_seq_length()
        # Positions continue from the uncompressed context, as in kvpress's pipeline.
        pos = torch.arange(context_ids.shape[1], context_ids.shape[1] + question_ids.shape[1]).unsqueeze(0)
        logits = model(input_ids=question_ids, past_key_values=cache, position_ids=pos, logits_to_keep=1).logits
        out = [int(logits[0, -1].argmax())]
        nxt = pos[:, -1:] + 1
        while len(out) < max_tokens and out[-1] not in eos:
            logits = model(input_ids=torch.tensor([[out[-1]]]), past_key_values=cache, position_ids=nxt).logits
            out.append(int(logits[0, -1].argmax()))
            nxt = nxt + 1
    return out, kept


def worker(spec: dict) -> None:
    """spec: {model, press, press_settings, records, items: [{job, compressed, rest, answers}]}."""
    import kvpress
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32).eval()
    cfg = model.config
    bytes_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    press_cls = getattr(kvpress, PRESSES[spec["press"]])
    with open(spec["records"], "a") as out_file:
        for item in tqdm(spec["items"], desc=f"kvpress:{spec['press']}", unit="sample", file=sys.stderr):
            job = item["job"]
            context_ids = tok(item["compressed"], return_tensors="pt", add_special_tokens=False).input_ids
            question_ids = tok(item["rest"], return_tensors="pt", add_special_tokens=False).input_ids
            press = press_cls(compression_ratio=1.0 - job["budget"], **spec.get("press_settings", {}))
            t0 = time.perf_counter()
            ids, kept = _generate(model, context_ids, question_ids, press, job["max_tokens"], eos)
            seconds = time.perf_counter() - t0
            n = context_ids.shape[1] + question_ids.shape[1]
            fast = (kept + question_ids.shape[1]) * bytes_per_token
            figures = {"fast_tier_bytes": fast, "full_kv_bytes": n * bytes_per_token,
                       "fast_tier_fraction": fast / (n * bytes_per_token)}
            text = tok.decode(ids, skip_special_tokens=True)
            out_file.write(json.dumps(make_record(job, item["answers"], text, n, seconds, 1, figures)) + "\n")
            out_file.flush()


if __name__ == "__main__":
    worker(json.loads(Path(sys.argv[1]).read_text()))
