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
    qg = q.float().view(Hkv, G, D)
    zoom_g = zoom.view(Hkv, G, -1)  # [Hkv, G, S]

    l_full = torch.einsum("kgd,nkd->kgn", qg, full_k.float()) * scale
    l_sum = torch.einsum("kgd,skd->kgs", qg, summary_k.float()) * scale + torch.log(span_len.float())
    l_sum = l_sum.masked_fill(zoom_g, float("-inf"))
    l_zoom = torch.einsum("kgd,mkd->kgm", qg, zoom_k.float()) * scale
    l_zoom = l_zoom.masked_fill(~zoom_g[:, :, zoom_span], float("-inf"))

    p = torch.softmax(torch.cat([l_full, l_sum, l_zoom], dim=-1), dim=-1)
    S = summary_k.shape[0]
    out = torch.einsum("kgn,nkd->kgd", p[..., :N], full_v.float())
    out += torch.einsum("kgs,skd->kgd", p[..., N : N + S], summary_v.float())
    out += torch.einsum("kgm,mkd->kgd", p[..., N + S :], zoom_v.float())
    return out.reshape(H, D)
