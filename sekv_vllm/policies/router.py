"""The trained router as a zoom policy: spans whose score passes the head's learned threshold,
by descending score until the budget is spent; keys rebuilt through the learned gates."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from sekv_vllm.core import SpanKeys
from sekv_vllm.policies.base import QueryTerms, ZoomPolicy
from sekv_vllm.router import ZoomRouter


@dataclass(frozen=True)
class RouterPolicy(ZoomPolicy):
    router: ZoomRouter
    name: ClassVar[str] = "router"
    has_key_gates: ClassVar[bool] = True
    # Per layer, the last spans scored and their key scales: reused while a batch decodes.
    _scales: dict = field(default_factory=dict, compare=False, repr=False)

    @torch.no_grad()
    def span_scores(self, layer: int, q: torch.Tensor, seg: torch.Tensor, keys: SpanKeys,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        hit = self._scales.get(layer)
        if hit is None or hit[0] is not keys:
            # float16 like the fast tier's copy the C++ kernel reads (`key_features`): both paths score alike
            hit = self._scales[layer] = (keys, self.key_features(layer, keys).float())
        score = self.router.score_rows(layer, q, seg, keys, hit[1])  # [S, H]
        return score, score > self.router.threshold_logit(layer)[None, :]

    @torch.no_grad()
    def key_features(self, layer: int, keys: SpanKeys) -> torch.Tensor:
        """[S, H] float16: each span's scale of the learned term (`ZoomRouter.key_scales`); the rest of
        the term reads the span's summary key."""
        return self.router.key_scales(layer, keys).half().contiguous()

    def span_feature_nbytes(self, layer: int) -> int:
        return self.router.shape.num_heads * 2  # [H] float16

    def centroid_scale(self, scale: float) -> float:
        return 1 / math.sqrt(self.router.shape.head_dim)

    @torch.no_grad()
    def query_terms(self, layer: int, q: torch.Tensor, scale: float) -> QueryTerms:
        r = self.router
        return QueryTerms(r.query_features(layer, q).contiguous(), r.bias[layer].float().contiguous(),
                          r.threshold_logit(layer).float().contiguous(), self.centroid_scale(scale))

    @torch.no_grad()
    def key_gates(self, layer: int, singular: torch.Tensor, summary_k: torch.Tensor) -> torch.Tensor:
        return self.router.gates(layer, singular, summary_k)
