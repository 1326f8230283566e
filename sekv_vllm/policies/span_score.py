"""The untrained SeKV zoom score: q . k_bar / sqrt(D) + log|S|, top spans until the budget.

The baseline the trained router is measured against (same interface, no weights).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from sekv_vllm.policies.base import ZoomPolicy, budgeted_zoom


@dataclass(frozen=True)
class SpanScorePolicy(ZoomPolicy):
    name: ClassVar[str] = "span_score"

    def select(
        self, layer: int, q: torch.Tensor, summary_k: torch.Tensor, span_len: torch.Tensor, zoom_budget: int,
        scale: float,
    ) -> torch.Tensor:
        H, D = q.shape
        S, Hkv, _ = summary_k.shape
        qg = q.float().view(Hkv, H // Hkv, D)
        score = torch.matmul(qg, summary_k.float().permute(1, 2, 0)).reshape(H, S) * scale
        score = score + torch.log(span_len.float())
        return budgeted_zoom(score, span_len, zoom_budget, Hkv)
