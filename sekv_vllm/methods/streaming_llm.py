"""StreamingLLM (Xiao et al., 2023): the first tokens (attention sinks) and the most recent ones.

Same positions for every layer and KV head: `sink_tokens` first, then the last
n_keep - sink_tokens of the prompt (kvpress's StreamingLLMPress keeps the same set). While decoding
(`evict_while_decoding`) the window rolls: each new row evicts the oldest one but the sinks.
"""
from __future__ import annotations

from typing import ClassVar

import torch
from pydantic import Field

from sekv_vllm.methods.base import DecodeEviction, PromptRows, RowKeepingMethod, protect


class StreamingLLM(DecodeEviction, RowKeepingMethod):
    name: ClassVar[str] = "streaming_llm"

    sink_tokens: int = Field(4, ge=0, description="first prompt tokens always kept (attention sinks)")

    def keep(self, rows: PromptRows, n_keep: int) -> torch.Tensor:
        T, Hkv = rows.k.shape[:2]
        sinks = min(self.sink_tokens, n_keep)
        device = rows.k.device
        pos = torch.cat([torch.arange(sinks, device=device), torch.arange(T - (n_keep - sinks), T, device=device)])
        return pos.expand(Hkv, n_keep)

    def decode_scores(self, attn: torch.Tensor, acc: torch.Tensor, positions: torch.Tensor,
                      n_keep: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not self.evict_while_decoding:
            return None
        age = positions.to(torch.float32)
        return acc, protect(age, positions < self.sink_tokens, positions)
