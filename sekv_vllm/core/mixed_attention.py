"""Decode attention over a mixed-resolution memory, in one softmax.

Rows attended by query head h:
  - full-resolution rows (anchors, short runs, window, generated tokens),
  - one summary row per span h did not zoom into, with logit bias + log|S| (it stands for
    |S| tokens whose keys it averages),
  - rebuilt token rows of the spans h zoomed into.
In GQA a span is rebuilt once per KV head if any query head of its group zooms; the heads
of the group that did not zoom mask those rows out and see the summary instead.
"""
from __future__ import annotations

import torch


def exact_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Float32 reference: one query token over every row.

    q: [H, D]; k, v: [N, Hkv, D]; returns [H, D] float32
    """
    H, D = q.shape
    N, Hkv, _ = k.shape
    qg = q.float().view(Hkv, H // Hkv, D)
    p = torch.softmax(torch.einsum("kgd,nkd->kgn", qg, k.float()) * scale, dim=-1)
    return torch.einsum("kgn,nkd->kgd", p, v.float()).reshape(H, D)


def mixed_attention(
    q: torch.Tensor,
    full_k: torch.Tensor,
    full_v: torch.Tensor,
    summary_k: torch.Tensor,
    summary_v: torch.Tensor,
    span_len: torch.Tensor,
    zoom: torch.Tensor,
    zoom_k: torch.Tensor,
    zoom_v: torch.Tensor,
    zoom_span: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query token over full rows, span summaries and zoomed rows.

    q:                  [H, D]
    full_k, full_v:     [N, Hkv, D]
    summary_k/v:        [S, Hkv, D]
    span_len:           [S] int64
    zoom:               [H, S] bool   query head h attends span s at token resolution
    zoom_k, zoom_v:     [M, Hkv, D]   rebuilt rows of the spans zoomed by any head
    zoom_span:          [M] int64     span of each rebuilt row
    returns             [H, D] float32
    """
    H, D = q.shape
    N, Hkv, _ = full_k.shape
    G = H // Hkv
    # One key/value table and one softmax: fewer, larger ops than one einsum per row kind.
    k = torch.cat([full_k.float(), summary_k.float(), zoom_k.float()])  # [N + S + M, Hkv, D]
    v = torch.cat([full_v.float(), summary_v.float(), zoom_v.float()])
    logits = torch.matmul(q.float().view(Hkv, G, D), k.permute(1, 2, 0)) * scale  # [Hkv, G, N + S + M]
    bias = torch.cat([k.new_zeros(N), torch.log(span_len.float()), k.new_zeros(zoom_k.shape[0])])
    zoom_g = zoom.view(Hkv, G, -1)  # [Hkv, G, S]
    hide = torch.cat([zoom_g.new_zeros(Hkv, G, N), zoom_g, ~zoom_g[:, :, zoom_span]], dim=-1)
    p = torch.softmax((logits + bias).masked_fill(hide, float("-inf")), dim=-1)
    return torch.matmul(p, v.permute(1, 0, 2)).reshape(H, D)
