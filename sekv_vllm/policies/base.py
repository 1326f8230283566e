"""Zoom policies: which spans each query head attends at token resolution this step."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from sekv_vllm.core import SpanKeys


def segment_budgeted_zoom(score: torch.Tensor, seg: torch.Tensor, span_len: torch.Tensor, budgets: torch.Tensor,
                          num_kv_heads: int, eligible: torch.Tensor | None = None,
                          min_shares: torch.Tensor | None = None) -> torch.Tensor:
    """Per request, zoom spans by descending score until the extra rows would pass its budget, or a span's
    share of its request's span scores (a softmax over its eligible spans, per KV head) is below its min_share.

    score:    [S, H] float  higher = more needed; the spans of all requests, request by request
    seg:      [S] int64     request of each span, non-decreasing
    span_len: [S] int64
    budgets:  [B] int64     extra rows allowed per KV head of each request; zooming span s costs
                            |s| - 1 rows (its tokens replace its summary row)
    eligible: [S, H] bool or None; a span no head of a group finds eligible is not zoomed
    min_shares: [B] float in [0, 1] or None; 0 (None: every request) zooms by score and budget alone
    returns   [S, H] bool, the same for every query head of a KV group
    """
    S, H = score.shape
    G = H // num_kv_heads
    if eligible is not None:
        score = score.masked_fill(~eligible, float("-inf"))
    group = score.view(S, num_kv_heads, G).amax(dim=2)  # [S, Hkv]
    # Sort by descending score, then (stably) by request: each request's spans best first.
    by_score = torch.argsort(group, dim=0, descending=True, stable=True)
    order = by_score.gather(0, torch.argsort(seg[by_score], dim=0, stable=True))
    cost = (span_len - 1)[order]  # [S, Hkv]
    total = torch.cumsum(cost, dim=0)
    first = torch.searchsorted(seg, seg, right=False)  # first row of each span's request
    before = torch.cat([total.new_zeros(1, num_kv_heads), total])[first]  # cost of earlier requests
    take_sorted = (total - before) <= budgets[seg][:, None]
    if min_shares is not None and bool((min_shares > 0).any()):
        share = group - segment_logsumexp(group, seg, budgets.numel())[seg]  # log of each span's share
        take_sorted &= share.gather(0, order) >= torch.log(min_shares.to(share.dtype))[seg][:, None]
    if eligible is not None:
        take_sorted &= group.gather(0, order) > float("-inf")
    take = torch.zeros_like(take_sorted).scatter(0, order, take_sorted)
    return take.repeat_interleave(G, dim=1)


def segment_logsumexp(x: torch.Tensor, seg: torch.Tensor, num_segments: int) -> torch.Tensor:
    """x [S, K] float, seg [S] int64 -> [num_segments, K]: the logsumexp of each segment's rows (-inf: none
    finite)."""
    top = torch.full((num_segments, x.shape[1]), float("-inf"), dtype=x.dtype, device=x.device)
    top = top.scatter_reduce(0, seg[:, None].expand_as(x), x, "amax")
    shift = top.masked_fill(top == float("-inf"), 0.0)
    sums = torch.zeros_like(top).index_add_(0, seg, torch.exp(x - shift[seg]))
    return torch.log(sums) + shift


def segment_key_recall(key_score: torch.Tensor, seg: torch.Tensor, span_len: torch.Tensor, zoom: torch.Tensor,
                       budgets: torch.Tensor, num_kv_heads: int, eligible: torch.Tensor | None,
                       per_key: torch.Tensor) -> torch.Tensor:
    """Per request and KV head, the zoom rows whole spans leave over, spent on the best single keys of
    the spans not zoomed (one row each), by descending score (ties: earlier span, then earlier key).

    key_score: [S, H, C] float  each key's share of its span's score (`ZoomPolicy.key_scores`)
    seg, span_len: [S] int64; zoom [S, H] bool (`segment_budgeted_zoom`); budgets [B] int64
    eligible:  [S, H] bool or None: a key counts for the heads its span is eligible for
    per_key:   [S] bool  spans whose centroids are their keys (others recall none)
    returns    read [S, Hkv, C] bool: keys read at full resolution (the same for a KV group's heads)
    """
    S, H, C = key_score.shape
    Hkv, G = num_kv_heads, H // num_kv_heads
    if eligible is not None:
        key_score = key_score.masked_fill(~eligible[..., None], float("-inf"))
    group = key_score.view(S, Hkv, G, C).amax(dim=2)  # [S, Hkv, C]
    whole = zoom.view(S, Hkv, G)[:, :, 0]
    present = torch.arange(C, device=seg.device)[None, :] < span_len[:, None]  # [S, C]
    group = group.masked_fill(~(present[:, None, :] & ~whole[..., None] & per_key[:, None, None]), float("-inf"))
    used = torch.zeros(budgets.numel(), Hkv, dtype=torch.int64, device=seg.device).index_add_(
        0, seg, whole.long() * (span_len - 1)[:, None])
    left = budgets[:, None] - used  # [B, Hkv]
    flat = group.permute(0, 2, 1).reshape(S * C, Hkv)  # key (s, c) at s * C + c
    key_seg = seg.repeat_interleave(C)
    by_score = torch.argsort(flat, dim=0, descending=True, stable=True)
    order = by_score.gather(0, torch.argsort(key_seg[by_score], dim=0, stable=True))
    first = torch.searchsorted(key_seg, key_seg, right=False)  # each key's request's first key
    rank = torch.arange(S * C, device=seg.device)[:, None] - first[:, None]
    take = (rank < left[key_seg]) & (flat.gather(0, order) > float("-inf"))
    read = torch.zeros_like(take).scatter(0, order, take)
    return read.view(S, C, Hkv).permute(0, 2, 1)


def budgeted_zoom(score: torch.Tensor, span_len: torch.Tensor, zoom_budget: int, num_kv_heads: int,
                  eligible: torch.Tensor | None = None) -> torch.Tensor:
    """`segment_budgeted_zoom` for one request: score, eligible [H, S] -> zoom [H, S] bool."""
    S = span_len.numel()
    zoom = segment_budgeted_zoom(score.T, torch.zeros(S, dtype=torch.int64, device=score.device), span_len,
                                 torch.tensor([zoom_budget], device=score.device), num_kv_heads,
                                 None if eligible is None else eligible.T)
    return zoom.T


@dataclass(frozen=True)
class QueryTerms:
    """What the C++ decode kernel needs of a policy for one layer and step (`ops.span_decode`).

    A span's score for head h is logsumexp_c(q_h . c * score_scale + log n_c)
    + (features[b, h] . summary_k[s, h // G]) * key_features[s, h] + bias[h] (G query heads per KV head);
    it is eligible when above threshold[h].
    features: [B, H, D] float32 or None (no learned term); bias, threshold: [H] float32.
    """

    features: torch.Tensor | None
    bias: torch.Tensor
    threshold: torch.Tensor
    score_scale: float


class ZoomPolicy(ABC):
    """Chooses zoomed spans for one layer and decode step, for one request or many at once.

    Shapes: keys: a layer's summary keys, span lengths and scoring centroids (`SpanKeys`, S spans,
    of one request or of several one after another); q [B, H, D]: the requests' post-RoPE
    queries; seg [S] int64: the request of each span.
    """

    name: ClassVar[str]

    @abstractmethod
    def span_scores(self, layer: int, q: torch.Tensor, seg: torch.Tensor, keys: SpanKeys,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(score [S, H] float, eligible [S, H] bool or None): spans go by descending score, and only
        eligible ones."""

    def select(self, layer: int, q: torch.Tensor, keys: SpanKeys, zoom_budget: int, scale: float) -> torch.Tensor:
        """One request: q [H, D] -> zoom [H, S] bool."""
        seg = torch.zeros(keys.num_spans, dtype=torch.int64, device=q.device)
        score, eligible = self.span_scores(layer, q[None], seg, keys, scale)
        return budgeted_zoom(score.T, keys.span_len, zoom_budget, keys.summary_k.shape[1],
                             None if eligible is None else eligible.T)

    def key_features(self, layer: int, keys: SpanKeys) -> torch.Tensor | None:
        """[S, H] float16 span-side scales of a learned score term (`QueryTerms`; computed once per
        request and layer, kept in the fast tier), or None when the score has none."""
        return None

    def span_feature_nbytes(self, layer: int) -> int:
        """Fast-tier bytes of one span's `key_features` in `layer` (0: none), known before any span is made."""
        return 0

    def key_scores(self, layer: int, q: torch.Tensor, seg: torch.Tensor, keys: SpanKeys, score: torch.Tensor,
                   scale: float) -> torch.Tensor:
        """Each centroid's share of its span's score: [S, H, C], its logit (`SpanKeys.centroid_logits_rows`)
        plus the terms the span's score adds to their logsumexp (the learned term, the bias). score: this
        step's `span_scores`."""
        logits = keys.centroid_logits_rows(q[seg], self.centroid_scale(scale))
        return logits + (score - torch.logsumexp(logits, dim=-1))[..., None]

    def centroid_scale(self, scale: float) -> float:
        """The factor of q . c in a span's score (`QueryTerms.score_scale`); scale: the attention's."""
        return scale

    def query_terms(self, layer: int, q: torch.Tensor, scale: float) -> QueryTerms:
        """The query side of `span_scores` for the C++ kernel: q [B, H, D]. Must score exactly as
        `span_scores` does (tests compare the two paths)."""
        H = q.shape[1]
        return QueryTerms(None, torch.zeros(H, device=q.device), torch.full((H,), float("-inf"), device=q.device),
                          self.centroid_scale(scale))

    # Whether `key_gates` gates anything: compression decomposes the spans' keys only for a policy that does.
    has_key_gates: ClassVar[bool] = False

    def key_gates(self, layer: int, singular: torch.Tensor, summary_k: torch.Tensor) -> torch.Tensor | None:
        """Reconstruction gates [S, Hkv, R] for the keys of `layer`, or None to rebuild them exactly."""
        return None
