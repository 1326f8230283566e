"""SnapKV (Li et al., 2024): keep the rows the prompt's last queries attend to.

The last `observation_window` queries of the prompt attend (causally, softmax over every prompt
row) to the rows before the window; their attention, averaged over the window's queries, smoothed
along positions by an average pool of `pooling_kernel`, and averaged over the query heads that
share a KV head, scores each row per KV head. Kept: the window itself and the top-scoring rows
(as kvpress's SnapKVPress with the same window, kernel and count).
"""
from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from pydantic import Field, field_validator

from sekv_vllm.methods.base import PromptRows, RowKeepingMethod


class SnapKV(RowKeepingMethod):
    name: ClassVar[str] = "snapkv"

    observation_window: int = Field(64, ge=1, description="last prompt tokens whose queries vote, all kept")
    pooling_kernel: int = Field(5, ge=1, description="width (odd) of the average pool over row scores")

    @field_validator("pooling_kernel")
    @classmethod
    def _odd(cls, kernel: int) -> int:
        if kernel % 2 == 0:
            raise ValueError("must be odd: the pool keeps one score per row")
        return kernel

    @property
    def query_window(self) -> int:
        return self.observation_window

    def scores(self, rows: PromptRows) -> torch.Tensor:
        """Votes for the rows before the window: [Hkv, T - W] float32."""
        k, q = rows.k.float(), rows.queries.float()
        T, Hkv, D = k.shape
        W, H = q.shape[:2]
        group = H // Hkv
        # [Hkv, group, W, T]: query head h uses KV head h // group
        logits = torch.einsum("wkgd,tkd->kgwt", q.view(W, Hkv, group, D), k) / math.sqrt(D)
        later = torch.arange(T, device=k.device)[None, :] > torch.arange(T - W, T, device=k.device)[:, None]
        attn = torch.softmax(logits.masked_fill(later, float("-inf")), dim=-1)[..., : T - W]
        votes = attn.mean(dim=2).reshape(Hkv * group, 1, T - W)
        pooled = F.avg_pool1d(votes, self.pooling_kernel, stride=1, padding=self.pooling_kernel // 2)
        return pooled.view(Hkv, group, T - W).mean(dim=1)

    def keep(self, rows: PromptRows, n_keep: int) -> torch.Tensor:
        T, Hkv = rows.k.shape[:2]
        W = rows.queries.shape[0]
        window = torch.arange(T - min(W, n_keep), T, device=rows.k.device).expand(Hkv, -1)
        if n_keep <= W:
            return window
        top = self.scores(rows).topk(n_keep - W, dim=-1).indices
        return torch.cat([top, window], dim=1).sort(dim=-1).values
