"""One summary row per span and KV head: the surprisal-weighted mean of its rows."""
from __future__ import annotations

import torch


def span_token_index(span_start: torch.Tensor, span_len: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded token positions of each span.

    span_start, span_len: [S] int64
    returns (index [S, L] int64 clamped into each span, valid [S, L] bool), L = max span_len
    """
    L = int(span_len.max()) if span_len.numel() else 0
    o_l = torch.arange(L, dtype=torch.int64, device=span_len.device)
    valid = o_l[None, :] < span_len[:, None]
    index = span_start[:, None] + torch.minimum(o_l[None, :], (span_len - 1).clamp(min=0)[:, None])
    return index, valid


def summarize_spans(
    x: torch.Tensor, weights: torch.Tensor, span_start: torch.Tensor, span_len: torch.Tensor
) -> torch.Tensor:
    """Weighted mean of each span's rows.

    x:       [T, Hkv, D]  keys or values
    weights: [T] float    surprisal; normalised inside each span, uniform where it sums to 0
    returns  [S, Hkv, D]  in x.dtype (accumulated in float32)
    """
    T, Hkv, D = x.shape
    S = span_start.numel()
    if S == 0:
        return x.new_zeros(0, Hkv, D)
    index, valid = span_token_index(span_start, span_len)
    w = weights.float()[index].clamp(min=0) * valid  # [S, L]
    total = w.sum(dim=1, keepdim=True)
    uniform = valid.float() / span_len[:, None].float()
    w = torch.where(total > 0, w / total.clamp(min=1e-30), uniform)
    return torch.einsum("sl,slhd->shd", w, x.float()[index]).to(x.dtype)
