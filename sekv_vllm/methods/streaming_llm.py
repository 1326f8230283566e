"""StreamingLLM (Xiao et al., 2023): the first tokens (attention sinks) and the most recent ones.

Same positions for every layer and KV head: `sink_tokens` first, then the last
n_keep - sink_tokens of the prompt (kvpress's StreamingLLMPress keeps the same set).
"""
from __future__ import annotations

from typing import ClassVar

import torch
from pydantic import Field

from sekv_vllm.methods.base import PromptRows, RowKeepingMethod


class StreamingLLM(RowKeepingMethod):
    name: ClassVar[str] = "streaming_llm"

    sink_tokens: int = Field(4, ge=0, description="first prompt tokens always kept (attention sinks)")

    def keep(self, rows: PromptRows, n_keep: int) -> torch.Tensor:
        T, Hkv = rows.k.shape[:2]
        sinks = min(self.sink_tokens, n_keep)
        device = rows.k.device
        pos = torch.cat([torch.arange(sinks, device=device), torch.arange(T - (n_keep - sinks), T, device=device)])
        return pos.expand(Hkv, n_keep)
