"""Exact fallback: a KV head whose zoom misses most of a query's attention reads every row for that step.

The rows a step reads (full rows, zoomed spans, recalled keys) stand for the whole prompt only where they
hold most of the attention; the summaries of the rest carry little of it (a mean key's logit sits far below
its tokens' logsumexp). Where the scores do not separate (a list of repeated words, a query matching many
places) the zoom cannot hold the mass within its rows, and the head reads every row instead, for that step.
"""
from __future__ import annotations

import torch

from sekv_vllm.policies.base import segment_logsumexp


def segment_read_coverage(key_logits: torch.Tensor, seg: torch.Tensor, read: torch.Tensor,
                          full_lse: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Per request and KV head, the least share over its query heads of the estimated attention on rows read.

    key_logits: [S, H, C] float  each key's estimated logit (`SpanKeys.centroid_logits_rows`, every key a
                                 centroid; -inf: no key)
    seg:        [S] int64        request of each span, non-decreasing
    read:       [S, Hkv, C] bool keys read at full resolution (every key of a zoomed span)
    full_lse:   [B, H] float     logsumexp of each request's full-resolution rows' logits
    returns     [B, Hkv] float in [0, 1]
    """
    S, H, C = key_logits.shape
    B, G = full_lse.shape[0], H // num_kv_heads
    read_q = read.repeat_interleave(G, dim=1)  # [S, H, C]
    every = segment_logsumexp(torch.logsumexp(key_logits, dim=2), seg, B)  # [B, H]
    missed = segment_logsumexp(torch.logsumexp(key_logits.masked_fill(read_q, float("-inf")), dim=2), seg, B)
    total = torch.logaddexp(full_lse, every)
    # 1 - (unread mass) / total, computed from the unread side: a head that reads nearly everything is near 1
    cover = -torch.expm1(missed - total)
    return cover.view(B, num_kv_heads, G).amin(dim=2)
