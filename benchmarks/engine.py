"""Runs one vLLM engine for a benchmark in this process: stock vLLM (plugins off) or sekv.

Each backend gets its own process, so the stock reference never loads the plugin.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
              "VLLM_CPU_OMP_THREADS_BIND": "nobind", "HF_HUB_OFFLINE": "1"}
STOCK_PLUGINS = "none-stock-vllm"  # VLLM_PLUGINS is an allow-list: this name matches no plugin


def run_in_subprocess(module: str, spec: dict, stock: bool, show_progress: bool = False,
                      env: dict[str, str] | None = None) -> dict:
    """Run `python -m module --worker SPEC` and return the JSON it prints after `RESULT `.

    show_progress: let the worker's stderr (progress bars, logs) through instead of keeping it.
    env: variables set over ENGINE_ENV (the KV pool size, say).
    """
    env = {**os.environ, **ENGINE_ENV, **(env or {})}
    if stock:
        env["VLLM_PLUGINS"] = STOCK_PLUGINS
    proc = subprocess.run([sys.executable, "-m", module, "--worker", json.dumps(spec)],
                          stdout=subprocess.PIPE, stderr=None if show_progress else subprocess.PIPE,
                          text=True, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{module} worker failed (rc={proc.returncode}):\n{(proc.stderr or '')[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def worker_or_model(worker_spec: str | None, worker) -> str | None:
    """The worker side of `run_in_subprocess`: given `--worker SPEC`, print worker(spec) after `RESULT `
    and return None; else the default model's folder (converted on first use), for the parent."""
    if worker_spec:
        print("RESULT " + json.dumps(worker(json.loads(worker_spec))))
        return None
    from sekv_vllm.entrypoints.default_model import prepare_default_model

    return str(prepare_default_model())


def machine() -> dict:
    """The CPU a benchmark ran on: timings differ by its cores and the vector instructions torch uses
    (a float32 model's matrix products run ~4x slower with AVX2 than with AVX-512 and AMX)."""
    import torch

    from sekv_vllm.core.surprisal import bfloat16_is_fast

    return {"cores": os.cpu_count(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "bfloat16_dot_products": bfloat16_is_fast(torch.device("cpu"))}


def command_line(module: str, argv: list[str] | None) -> str:
    """The command that ran `module` with these arguments, for a results file."""
    return f"python -m {module} " + " ".join(argv if argv is not None else sys.argv[1:])


def make_llm(model: str, sekv: dict | None, max_model_len: int, max_num_batched_tokens: int | None = None,
             logits_processors: list | None = None):
    """An engine for `model` (a local folder) whose context holds max_model_len tokens, or the model's own
    limit where that is less (an 8K-token grid cell plus its answer room still fits an 8192-token model).
    max_num_batched_tokens: vLLM's tokens per step (its prefill chunk); None: vLLM's default.
    logits_processors: vLLM logits processor classes the engine loads."""
    from vllm import LLM

    kwargs = {"additional_config": {"sekv": sekv}} if sekv is not None else {}
    if max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = max_num_batched_tokens
    if logits_processors:
        kwargs["logits_processors"] = logits_processors
    return LLM(model, dtype="float32", enforce_eager=True, max_model_len=min(max_model_len, model_context(model)),
               enable_prefix_caching=False, **kwargs)


def model_context(model: str) -> int:
    """The longest context the model's config allows (max_position_embeddings of its config.json)."""
    with open(os.path.join(model, "config.json")) as f:
        return int(json.load(f)["max_position_embeddings"])


def timed_generate(llm, prompts, params) -> tuple[list, float]:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return outputs, time.perf_counter() - start
