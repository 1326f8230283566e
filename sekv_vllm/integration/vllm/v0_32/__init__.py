"""sekv on vLLM 0.32: the wraps of its functions (shims.py), the attention backend (backend.py), the
page-returning KV cache manager (kv_pages.py) and what the runner bridge reads of its runner
(runner_view.py). Only integration/vllm/version.py imports this package."""
from __future__ import annotations

from sekv_vllm.integration.vllm.v0_32 import kv_pages
from sekv_vllm.integration.vllm.v0_32.kv_pages import PageRange
from sekv_vllm.integration.vllm.v0_32.runner_view import RunnerView, StepSchedule


def install() -> None:
    """Wrap vLLM's functions and put sekv's attention backend in place of the CPU one (once per process)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from sekv_vllm.integration.vllm.v0_32 import shims

    shims.install()
    # Replaces CPU_ATTN in this process; it runs vLLM's own kernel unchanged unless the
    # engine's config carries `sekv` and a request is compressed.
    register_backend(AttentionBackendEnum.CPU_ATTN, "sekv_vllm.integration.vllm.v0_32.backend.SeKVAttentionBackend")


__all__ = ["PageRange", "RunnerView", "StepSchedule", "install", "kv_pages"]
