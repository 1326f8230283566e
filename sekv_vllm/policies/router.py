"""The trained router as a zoom policy: spans whose score passes the head's learned threshold,
by descending score until the budget is spent; keys rebuilt through the learned gates."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from sekv_vllm.policies.base import ZoomPolicy, budgeted_zoom
from sekv_vllm.router import ZoomRouter


@dataclass(frozen=True)
class RouterPolicy(ZoomPolicy):
    router: ZoomRouter
    name: ClassVar[str] = "router"

    @torch.no_grad()
    def select(
        self, layer: int, q: torch.Tensor, summary_k: torch.Tensor, span_len: torch.Tensor, zoom_budget: int,
        scale: float,
    ) -> torch.Tensor:
        logits = self.router.score_logits(layer, q, summary_k, span_len)  # [H, S]
        eligible = logits > self.router.threshold_logit(layer)[:, None]
        return budgeted_zoom(logits, span_len, zoom_budget, summary_k.shape[1], eligible)

    @torch.no_grad()
    def key_gates(self, layer: int, singular: torch.Tensor, summary_k: torch.Tensor) -> torch.Tensor:
        return self.router.gates(layer, singular, summary_k)
