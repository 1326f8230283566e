"""Per-request SeKV settings checked when vLLM admits a request.

vLLM runs every installed logits processor's `validate_params` at admission: a ValueError
there becomes an HTTP 400 (server) or an exception from `LLM.generate`, before the request
reaches the engine. This processor exists for that check; it never changes logits.
"""
from __future__ import annotations

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

from sekv_vllm.config import RequestOverrides


class SeKVRequestParams(LogitsProcessor):
    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        RequestOverrides.from_extra_args(sampling_params.extra_args)

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        pass

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        pass

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits
