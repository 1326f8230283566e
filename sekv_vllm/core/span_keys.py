"""What a zoom policy reads of one layer's spans: summary keys and key centroids (fast tier).

The method's untrained score q . k_bar / sqrt(D) + log|S| reads a span through the mean of its
keys, which washes out the one token a query needs (a needle among 30 filler tokens). Each span
therefore also keeps C key centroids (k-means of its keys) with the number of tokens each stands
for, and is scored as
    score[h, s] = logsumexp_c(q_h . c_sc / sqrt(D) + log n_sc),
an estimate of log sum_{t in s} exp(q_h . k_t / sqrt(D)): the span's true share of attention.
With C >= |S| every token is its own centroid and the estimate is exact; with C = 0 the span
is scored through its summary key alone (C = 1 centroid k_bar standing for |S| tokens), which
is the method doc's score.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from sekv_vllm.core.span_summary import span_token_index

_LLOYD_ITERATIONS = 6


@dataclass(frozen=True)
class SpanKeys:
    """summary_k:  [S, Hkv, D]     the spans' summary keys (also attended)
    span_len:   [S] int64
    centroid_k: [S, C, Hkv, D]  key centroids of each span, C >= 1 (float16; the summary keys' dtype when C = 0)
    log_count:  [S, C, Hkv] float16  log of the tokens each centroid stands for (-inf: none)
    """

    summary_k: torch.Tensor
    span_len: torch.Tensor
    centroid_k: torch.Tensor
    log_count: torch.Tensor

    @classmethod
    def of_summaries(cls, summary_k: torch.Tensor, span_len: torch.Tensor) -> "SpanKeys":
        """No centroids: each span scored through its summary key standing for |S| tokens."""
        S, Hkv, _ = summary_k.shape
        log_len = torch.log(span_len.float()).half()[:, None, None].expand(S, 1, Hkv).contiguous()
        return cls(summary_k, span_len, summary_k[:, None], log_len)

    @property
    def num_spans(self) -> int:
        return int(self.span_len.numel())

    @property
    def centroid_nbytes(self) -> int:
        """Fast-tier bytes of the scoring centroids (the summary rows are counted with the summaries)."""
        return sum(t.numel() * t.element_size() for t in (self.centroid_k, self.log_count))

    def score(self, q: torch.Tensor, scale: float) -> torch.Tensor:
        """Estimated log attention mass of each span: q [..., H, D] -> [..., H, S] float32."""
        *lead, H, D = q.shape
        S, C, Hkv, _ = self.centroid_k.shape
        qg = q.float().reshape(*lead, Hkv, H // Hkv, D)
        logits = torch.einsum("...kgd,sckd->...kgsc", qg, self.centroid_k.float()) * scale
        logits = logits + self.log_count.float().permute(2, 0, 1)[:, None]  # [Hkv, 1, S, C]
        return torch.logsumexp(logits, dim=-1).reshape(*lead, H, S)

    def score_rows(self, q: torch.Tensor, scale: float) -> torch.Tensor:
        """`score` with one query per span (the query of the request the span belongs to):
        q [S, H, D] -> [S, H] float32."""
        S, C, Hkv, D = self.centroid_k.shape
        qg = q.float().view(S, Hkv, -1, D)
        logits = torch.einsum("skgd,sckd->skgc", qg, self.centroid_k.float()) * scale
        logits = logits + self.log_count.float().permute(0, 2, 1)[:, :, None, :]  # [S, Hkv, 1, C]
        return torch.logsumexp(logits, dim=-1).reshape(S, -1)


def concat_span_keys(parts: list[SpanKeys]) -> SpanKeys:
    """The spans of several requests, one after another; fewer centroids are padded (count 0)."""
    C = max(p.centroid_k.shape[1] for p in parts)

    def pad(p: SpanKeys) -> tuple[torch.Tensor, torch.Tensor]:
        extra = C - p.centroid_k.shape[1]
        if extra == 0:
            return p.centroid_k, p.log_count
        S, _, Hkv, D = p.centroid_k.shape
        return (torch.cat([p.centroid_k, p.centroid_k.new_zeros(S, extra, Hkv, D)], dim=1),
                torch.cat([p.log_count, p.log_count.new_full((S, extra, Hkv), float("-inf"))], dim=1))

    padded = [pad(p) for p in parts]
    return SpanKeys(torch.cat([p.summary_k for p in parts]), torch.cat([p.span_len for p in parts]),
                    torch.cat([c for c, _ in padded]), torch.cat([n for _, n in padded]))


def span_keys(k: torch.Tensor, summary_k: torch.Tensor, span_start: torch.Tensor, span_len: torch.Tensor,
              num_centroids: int) -> SpanKeys:
    """k: [T, Hkv, D] prompt keys; summary_k: [S, Hkv, D]; num_centroids: C (0: the summary only).

    Lloyd's k-means per span and KV head, a fixed number of iterations, started from farthest
    points (deterministic): an outlier key, the needle a query may look for, gets a centroid of its
    own instead of being averaged into its neighbours. Centroids are stored in float16 (they only
    rank spans; half the fast-tier bytes of float32 keys).
    """
    S = span_len.numel()
    if num_centroids == 0 or S == 0:
        return SpanKeys.of_summaries(summary_k, span_len)
    C = num_centroids
    index, valid = span_token_index(span_start, span_len)  # [S, L]
    x = k.float()[index].permute(0, 2, 1, 3)  # [S, Hkv, L, D]
    cent = _farthest_points(x, valid, C)
    member = valid[:, None, :, None]  # [S, 1, L, 1]
    for _ in range(_LLOYD_ITERATIONS):
        near = torch.cdist(x, cent).argmin(dim=-1)  # [S, Hkv, L]
        one_hot = torch.nn.functional.one_hot(near, C).float() * member  # [S, Hkv, L, C]
        count = one_hot.sum(dim=2)  # [S, Hkv, C]
        sums = torch.einsum("shlc,shld->shcd", one_hot, x)
        cent = torch.where(count[..., None] > 0, sums / count.clamp(min=1)[..., None], cent)
    return SpanKeys(summary_k, span_len, cent.permute(0, 2, 1, 3).half().contiguous(),
                    torch.log(count).half().permute(0, 2, 1).contiguous())


def _farthest_points(x: torch.Tensor, valid: torch.Tensor, C: int) -> torch.Tensor:
    """x: [S, Hkv, L, D]; valid: [S, L] -> [S, Hkv, C, D]: the token farthest from the span's mean,
    then repeatedly the token farthest from those already taken (every token when C >= |S|)."""
    S, Hkv, L, D = x.shape
    mask = valid[:, None, :]  # [S, 1, L]
    mean = (x * mask[..., None]).sum(2, keepdim=True) / mask.sum(-1, keepdim=True)[..., None]
    score = torch.cdist(x, mean).squeeze(-1)  # [S, Hkv, L]: distance to the mean, then to the nearest pick
    nearest = torch.full_like(score, float("inf"))
    picks = []
    for _ in range(C):
        pick = score.masked_fill(~mask, -1.0).argmax(dim=-1)  # [S, Hkv]
        picks.append(torch.gather(x, 2, pick[..., None, None].expand(S, Hkv, 1, D)))
        nearest = torch.minimum(nearest, torch.cdist(x, picks[-1]).squeeze(-1))
        score = nearest
    return torch.cat(picks, dim=2)
