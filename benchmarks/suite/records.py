"""One suite record per sample, the same fields for every backend."""
from __future__ import annotations

from sekv_vllm.tasks.ruler import score


def prompt_id(job: dict) -> str:
    """Names the sample: the same prompt for every backend and budget."""
    return f"{job['task']}:{job['length']}:{job['depth']}:{job['seed']}"


def make_record(job: dict, answers, output: str, prompt_tokens: int, seconds: float, batch_size: int,
                figures: dict | None = None, via: str = "offline") -> dict:
    """job: a Grid.jobs() cell; seconds: the wall time of the sample's batch offline, of its own
    request through the server (batch_size is then the concurrency)."""
    fig = figures or {}
    return {
        "prompt_id": prompt_id(job), **job, "via": via, "prompt_tokens": prompt_tokens, "answers": list(answers),
        "output": output,
        "score": score(tuple(answers), output), "batch_seconds": round(seconds, 3), "batch_size": batch_size,
        "fast_tier_fraction": fig.get("fast_tier_fraction"), "fast_tier_bytes": fig.get("fast_tier_bytes"),
        "host_pool_bytes": fig.get("host_pool_bytes"), "full_kv_bytes": fig.get("full_kv_bytes"),
        "spans": fig.get("spans"), "mean_zoomed_spans": fig.get("mean_zoomed_spans"),
        "mean_recalled_keys": fig.get("mean_recalled_keys"), "mean_exact_heads": fig.get("mean_exact_heads"),
    }
