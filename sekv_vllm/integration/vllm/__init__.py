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
    from sekv_vllm.integration.vllm.version import check_version, install

    _setup_logging()
    check_version()
    install()
