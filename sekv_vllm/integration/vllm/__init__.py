"""The vLLM adapter: the only package that imports vLLM.

`register()` is the `vllm.general_plugins` entry point; vLLM calls it in every process
(front end, engine core, workers) before building the model.
"""
from __future__ import annotations

import logging


def _setup_logging() -> None:
    log = logging.getLogger("sekv_vllm")
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [sekv] %(message)s", "%m-%d %H:%M:%S"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


def register() -> None:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from sekv_vllm.integration.vllm import shims_v032

    _setup_logging()
    shims_v032.install()
    # Replaces CPU_ATTN in this process; it runs vLLM's own kernel unchanged unless the
    # engine's config carries `sekv` and a request is compressed.
    register_backend(AttentionBackendEnum.CPU_ATTN, "sekv_vllm.integration.vllm.backend.SeKVAttentionBackend")
