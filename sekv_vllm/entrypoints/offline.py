"""Offline generation through vLLM's `LLM`, with or without sekv."""
from __future__ import annotations

import time
from typing import Any


def llm_kwargs(backend: str, sekv: dict | None) -> dict[str, Any]:
    """Keyword arguments that select the KV-cache backend for `vllm.LLM`."""
    from sekv_vllm.integration.vllm.backend_flags import apply_kv_cache_backend

    return {"additional_config": apply_kv_cache_backend({}, backend, sekv)}


def generate(
    model: str,
    prompts: list[str],
    *,
    backend: str = "sekv",
    sekv: dict | None = None,
    max_tokens: int = 48,
    max_model_len: int = 8192,
    chat: bool = True,
) -> dict:
    """Greedy answers to `prompts` plus the compression figures of each compressed request."""
    from vllm import LLM, SamplingParams

    from sekv_vllm.integration.vllm.runner_bridge import figures_by_request_id

    llm = LLM(model, dtype="float32", enforce_eager=True, max_model_len=max_model_len, **llm_kwargs(backend, sekv))
    if chat:
        tok = llm.get_tokenizer()
        prompts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
                   for p in prompts]
    start = time.perf_counter()
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    seconds = time.perf_counter() - start
    figures = figures_by_request_id()
    results = []
    for out in outputs:
        fig = figures.get(out.request_id)
        results.append({
            "prompt_tokens": len(out.prompt_token_ids),
            "answer": out.outputs[0].text,
            "sekv": fig,
        })
    return {"backend": backend, "seconds": round(seconds, 2), "results": results}
