"""Zoom policies: which spans each query head attends at token resolution this step."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch


def budgeted_zoom(score: torch.Tensor, span_len: torch.Tensor, zoom_budget: int, num_kv_heads: int,
                  eligible: torch.Tensor | None = None) -> torch.Tensor:
    """Zoom spans by descending score until the extra rows would pass the budget.

    score:       [H, S] float  higher = more needed
    span_len:    [S] int64
    zoom_budget: extra rows allowed per KV head; zooming span s costs |s| - 1 rows
                 (its tokens replace its summary row)
    eligible:    [H, S] bool or None; a span no head of a group finds eligible is not zoomed
    returns      [H, S] bool, the same for every query head of a KV group
    """
    H, S = score.shape
    G = H // num_kv_heads
    if eligible is not None:
        score = score.masked_fill(~eligible, float("-inf"))
    group_score = score.view(num_kv_heads, G, S).amax(dim=1)  # [Hkv, S]
    order = torch.argsort(group_score, dim=1, descending=True)
    cost = (span_len - 1)[order]  # [Hkv, S]
    take_sorted = torch.cumsum(cost, dim=1) <= zoom_budget
    if eligible is not None:
        take_sorted &= torch.gather(group_score, 1, order) > float("-inf")
    take = torch.zeros_like(take_sorted).scatter(1, order, take_sorted)
    return take.repeat_interleave(G, dim=0)


class ZoomPolicy(ABC):
    """Chooses zoomed spans for one request, one layer, one decode step.

    Shapes: q [H, D] post-RoPE query; summary_k [S, Hkv, D]; span_len [S] int64.
    """

    name: ClassVar[str]

    @abstractmethod
    def select(
        self, layer: int, q: torch.Tensor, summary_k: torch.Tensor, span_len: torch.Tensor, zoom_budget: int,
        scale: float,
    ) -> torch.Tensor:
        """Returns zoom [H, S] bool."""

    def key_gates(self, layer: int, singular: torch.Tensor, summary_k: torch.Tensor) -> torch.Tensor | None:
        """Reconstruction gates [S, Hkv, R] for the keys of `layer`, or None to rebuild them exactly."""
        return None
