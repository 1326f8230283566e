"""H2O (Zhang et al., 2023): heavy hitters and recent rows, kept at a fixed count while decoding.

Every prompt row's score is the attention it received from every prompt query (summed over the
queries, averaged over the query heads of its KV head; prefill accumulates it chunk by chunk,
`accumulate_attention`). Kept per KV head: the last `recent_share` of the kept rows and, before
them, the rows of highest score. While decoding each step's attention adds to the scores, and each
KV head evicts its lowest-scoring row outside the most recent ones, so the kept rows stay at their
count (the paper's cache of heavy hitters plus a recent window).
"""
from __future__ import annotations

import math
from typing import ClassVar

import torch
from pydantic import Field

from sekv_vllm.methods.base import DecodeEviction, PromptRows, RowKeepingMethod, head_mean, protect, recent

# queries per block when prefill's attention is summed (bounds the [H, block, S] logits)
_QUERY_BLOCK = 256


def accumulate_attention(acc: torch.Tensor, q: torch.Tensor, k: torch.Tensor, start: int) -> None:
    """Add the attention of queries at positions [start, start + n) to every row before them (causal).

    acc: [Hkv, >= start + n] float32, updated in place; q: [n, H, D]; k: [start + n, Hkv, D] the rows so far."""
    n, H, D = q.shape
    Hkv = k.shape[1]
    kf = k.float()
    for lo in range(0, n, _QUERY_BLOCK):
        hi = min(lo + _QUERY_BLOCK, n)
        S = start + hi
        qb = q[lo:hi].float().view(hi - lo, Hkv, H // Hkv, D)
        logits = torch.einsum("wkgd,skd->kgws", qb, kf[:S]) / math.sqrt(D)
        later = torch.arange(S, device=k.device)[None, :] > torch.arange(start + lo, S, device=k.device)[:, None]
        attn = torch.softmax(logits.masked_fill(later, float("-inf")), dim=-1)
        acc[:, :S] += attn.sum(dim=2).mean(dim=1)


class H2O(DecodeEviction, RowKeepingMethod):
    name: ClassVar[str] = "h2o"
    accumulates_prompt_attention: ClassVar[bool] = True

    recent_share: float = Field(0.5, ge=0.0, le=1.0, description="share of the kept rows that are the most recent "
                                "ones (the rest: the heavy hitters)")

    def n_recent(self, n_keep: int) -> int:
        return min(round(n_keep * self.recent_share), n_keep)

    def keep(self, rows: PromptRows, n_keep: int) -> torch.Tensor:
        if rows.attention is None:
            raise ValueError("h2o needs the prompt's accumulated attention (PromptRows.attention)")
        T, Hkv = rows.k.shape[:2]
        recent = self.n_recent(n_keep)
        window = torch.arange(T - recent, T, device=rows.k.device).expand(Hkv, -1)
        heavy = rows.attention[:, : T - recent].topk(n_keep - recent, dim=-1).indices
        return torch.cat([heavy, window], dim=1).sort(dim=-1).values

    def decode_scores(self, attn: torch.Tensor, acc: torch.Tensor, positions: torch.Tensor,
                      n_keep: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not self.evict_while_decoding:
            return None
        acc = acc + head_mean(attn, acc.shape[0])
        return acc, protect(acc, recent(positions, self.n_recent(n_keep)), positions)
