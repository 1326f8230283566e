"""The untrained zoom score: each span's estimated log attention mass from its key centroids
(`SpanKeys.score`; with no centroids, the method doc's q . k_bar / sqrt(D) + log|S|), top spans
until the budget.

The baseline the trained router is measured against (same interface, no weights).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from sekv_vllm.core import SpanKeys
from sekv_vllm.policies.base import ZoomPolicy


@dataclass(frozen=True)
class SpanScorePolicy(ZoomPolicy):
    name: ClassVar[str] = "span_score"

    def span_scores(self, layer: int, q: torch.Tensor, seg: torch.Tensor, keys: SpanKeys,
                    scale: float) -> tuple[torch.Tensor, None]:
        return keys.score_rows(q[seg], scale), None
