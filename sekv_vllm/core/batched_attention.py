"""The mixed attention of many compressed requests' decode tokens at once, without rebuilding rows.

Each request b attends, in one softmax, its full-resolution rows, one summary row per span standing
for the span's tokens not read (logit bias log of their count; none when every token is read) and
the token rows its KV heads read: every token of a zoomed span, single keys recalled from others
(with whole spans only, what `mixed_attention` gives it). Rows are never rebuilt here: with keys
K = C B and values V = C_v B_v (coefficients C [L, R], basis B [R, D]),
    q K^T = (q B^T) C^T        and        p V = (p C_v) B_v,
which costs R (D + L) per head instead of L R D to rebuild and L D to attend, and moves no rows.
Summaries and zoomed spans of all requests are computed in a few batched ops; the softmax is
merged per request from the three parts (a max and a sum per request and head).
"""
from __future__ import annotations

import torch


def batched_mixed_attention(
    q: torch.Tensor,
    full_k: list[torch.Tensor],
    full_v: list[torch.Tensor],
    summary_k: torch.Tensor,
    summary_v: torch.Tensor,
    seg: torch.Tensor,
    summary_count: torch.Tensor,
    pair_span: torch.Tensor,
    pair_head: torch.Tensor,
    coef_k: torch.Tensor,
    basis_k: torch.Tensor,
    coef_v: torch.Tensor,
    basis_v: torch.Tensor,
    read: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """B requests, S spans of all of them (request by request), P (span, KV head) pairs with tokens read.

    q:                  [B, H, D]
    full_k, full_v:     B tensors [N_b, Hkv, D], N_b >= 1
    summary_k/v:        [S, Hkv, D]
    seg:                [S] int64 the request of each span
    summary_count:      [S, Hkv] int64  the tokens each summary stands for (0: not attended)
    pair_span/head:     [P] int64 the (span, KV head) pairs whose tokens are read
    coef_k, coef_v:     [P, L, R] float32, zero past each span's end
    basis_k, basis_v:   [P, R, D] float32
    read:               [P, L] bool  the tokens each pair's heads attend
    returns             [B, H, D] float32
    """
    B, H, D = q.shape
    S, Hkv, _ = summary_k.shape
    G = H // Hkv
    qg = q.float().view(B, Hkv, G, D)
    neg = float("-inf")

    ls = torch.einsum("skgd,skd->skg", qg[seg], summary_k.float()) * scale + torch.log(summary_count.float())[..., None]
    ls = ls.masked_fill((summary_count == 0)[..., None], neg)  # [S, Hkv, G]
    # Pairs read, indexed by (request, KV head) flattened to request * Hkv + head.
    pseg = seg[pair_span] * Hkv + pair_head
    qp = qg.reshape(B * Hkv, G, D)[pseg]  # [P, G, D]
    lz = torch.matmul(torch.matmul(qp, basis_k.mT), coef_k.mT) * scale  # [P, G, L]
    lz = lz.masked_fill(~read[:, None, :], neg)
    lf = [torch.matmul(qg[b], k.float().permute(1, 2, 0)) * scale for b, k in enumerate(full_k)]  # [Hkv, G, N_b]

    # Per request and head: the max over all three parts, then weights and their sum.
    m = torch.stack([x.amax(dim=-1) for x in lf])  # [B, Hkv, G]; every request has full rows
    m = m.scatter_reduce(0, seg[:, None, None].expand_as(ls), ls, "amax").view(B * Hkv, G)
    lz_max = lz.amax(dim=-1)
    m = m.scatter_reduce(0, pseg[:, None].expand_as(lz_max), lz_max, "amax")
    ps = torch.exp(ls - m.view(B, Hkv, G)[seg])  # [S, Hkv, G]
    pz = torch.exp(lz - m[pseg][..., None])  # [P, G, L]
    pf = [torch.exp(x - m.view(B, Hkv, G)[b][..., None]) for b, x in enumerate(lf)]
    den = torch.stack([x.sum(dim=-1) for x in pf]).index_add(0, seg, ps).view(B * Hkv, G)
    den = den.index_add(0, pseg, pz.sum(dim=-1))
    num = torch.stack([torch.matmul(x, v.float().permute(1, 0, 2)) for x, v in zip(pf, full_v)])  # [B, Hkv, G, D]
    num = num.index_add(0, seg, ps[..., None] * summary_v.float()[:, :, None, :]).view(B * Hkv, G, D)
    num = num.index_add(0, pseg, torch.matmul(torch.matmul(pz, coef_v), basis_v))
    return (num / den[..., None]).reshape(B, H, D)
