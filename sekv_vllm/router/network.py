"""The zoom-in router: per (layer, query head) projection W, threshold tau, and reconstruction gates.

Score of span s for query head h of layer l:
    logit[h, s] = untrained_s(q_h)                                      (the untrained score)
                + (W_lh q_h) . normalize(W_lh k_bar_s) / sqrt(d_r) + b_lh  (the method's learned term)
    a = sigmoid(logit)
untrained_s is `SpanKeys.score`: the span's log attention mass estimated from its key centroids,
q . k_bar_s / sqrt(D) + log|s| when the runtime keeps none.
The method doc's score is the learned term + log|s| alone. It discards the summary key's norm,
and a first router trained that way (run of 2026-11-30, 1200 steps) ranked spans worse on
held-out texts than the untrained score (span recall 0.13 vs 0.16): so the learned term is
added to the untrained score, W starts small, and the router starts where the untrained score
is. The head zooms span s when a > tau_lh; with a token budget, spans go by descending a until
the budget is spent.

Gates: g = sigmoid(MLP_l([sigma / sigma_1, normalize(k_bar)])) per span and KV head, one gate per
singular direction; the key rows are rebuilt as U diag(g * sigma) V^T. They depend on the span
alone, not on the query, so the runtime folds them into the stored coefficients once.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from sekv_vllm.core import SpanKeys


@dataclass(frozen=True)
class ModelShape:
    """What a router must match in the base model."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    def describe(self) -> str:
        return (f"{self.num_layers} layers, {self.num_heads} heads, {self.num_kv_heads} KV heads, "
                f"head_dim {self.head_dim}")


class ZoomRouter(nn.Module):
    """Trainable router parameters of every layer, batched over layers.

    W:       [L, H, d_r, D]
    bias:    [L, H]
    tau_logit: [L, H]          tau = sigmoid(tau_logit)
    gate MLP per layer: (R + D) -> hidden -> hidden -> R, GELU, sigmoid output
    """

    def __init__(self, shape: ModelShape, d_r: int = 32, r_max: int = 32, gate_hidden: int = 64,
                 tau_init: float = 0.05, w_init: float = 0.05, seed: int = 0) -> None:
        super().__init__()
        self.shape, self.d_r, self.r_max, self.gate_hidden = shape, d_r, r_max, gate_hidden
        L, H, D = shape.num_layers, shape.num_heads, shape.head_dim
        gen = torch.Generator().manual_seed(seed)
        # Small orthonormal rows: the learned term starts near zero.
        w = torch.linalg.qr(torch.randn(L, H, D, d_r, generator=gen))[0].mT
        self.W = nn.Parameter((w_init * w).contiguous())
        self.bias = nn.Parameter(torch.zeros(L, H))
        self.tau_logit = nn.Parameter(torch.full((L, H), math.log(tau_init / (1 - tau_init))))
        n_in = r_max + D

        def lin(i: int, o: int, scale: float = 1.0) -> tuple[nn.Parameter, nn.Parameter]:
            return (nn.Parameter(torch.randn(L, i, o, generator=gen) * scale / math.sqrt(i)),
                    nn.Parameter(torch.zeros(L, o)))

        self.w1, self.b1 = lin(n_in, gate_hidden)
        self.w2, self.b2 = lin(gate_hidden, gate_hidden)
        self.w3, self.b3 = lin(gate_hidden, r_max, scale=0.1)
        with torch.no_grad():
            self.b3.fill_(4.0)  # g ~ 0.98: start from the exact rebuild

    # -- scores --------------------------------------------------------------------------
    def score_logits(self, layer: int, q: torch.Tensor, keys: SpanKeys) -> torch.Tensor:
        """Pre-sigmoid scores of every span for every query (training).

        q:         [..., H, D] post-RoPE queries
        keys:      the layer's summary keys [S, Hkv, D], span lengths and scoring centroids
        returns    [..., H, S] float32
        """
        qp = torch.einsum("hrd,...hd->...hr", self.W[layer], q.float())
        learned = torch.einsum("...hr,shr->...hs", qp, self.projected_keys(layer, keys)) / math.sqrt(self.d_r)
        return keys.score(q, 1 / math.sqrt(self.shape.head_dim)) + learned + self.bias[layer][:, None]

    def score_rows(self, layer: int, q: torch.Tensor, seg: torch.Tensor, keys: SpanKeys,
                   key_scales: torch.Tensor | None = None) -> torch.Tensor:
        """`score_logits` of each span for its own request's query (serving many requests at once):
        q [B, H, D], seg [S] the request of each span -> [S, H]. key_scales: `key_scales` of these
        keys when already computed (they do not change while a batch decodes).

        The learned term is computed as served: (W q) . normalize(W k_bar) / sqrt(d_r)
        = (W^T W q / sqrt(d_r)) . k_bar / |W k_bar|, from the summary keys the fast tier holds anyway
        and one scale per span and head (not a d_r-wide projected key per span and head)."""
        qf = self.query_features(layer, q)[seg]  # [S, H, D]
        scales = self.key_scales(layer, keys) if key_scales is None else key_scales
        learned = (qf * self._per_head(keys.summary_k)).sum(-1) * scales
        return keys.score_rows(q[seg], 1 / math.sqrt(self.shape.head_dim)) + learned + self.bias[layer][None, :]

    def query_features(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """W^T W q / sqrt(d_r): q [B, H, D] -> [B, H, D] float32 (the learned term is its dot with a
        span's summary key times the span's `key_scales`)."""
        w = self.W[layer].float()
        qp = torch.einsum("hrd,bhd->bhr", w, q.float())
        return torch.einsum("hrd,bhr->bhd", w, qp) / math.sqrt(self.d_r)

    def key_scales(self, layer: int, keys: SpanKeys) -> torch.Tensor:
        """1 / |W_h k_bar_s|: [S, H] float32, at most float16's largest value (the fast tier keeps them in
        float16; a projected key that short, as with W = 0, has a term near 0 anyway)."""
        proj = torch.einsum("hrd,shd->shr", self.W[layer].float(), self._per_head(keys.summary_k))
        return (1 / torch.linalg.vector_norm(proj, dim=-1)).clamp(max=torch.finfo(torch.float16).max)

    def projected_keys(self, layer: int, keys: SpanKeys) -> torch.Tensor:
        """normalize(W k_bar): [S, H, d_r] (training's form of the learned term)."""
        return nn.functional.normalize(torch.einsum("hrd,shd->shr", self.W[layer], self._per_head(keys.summary_k)),
                                       dim=-1)

    def _per_head(self, summary_k: torch.Tensor) -> torch.Tensor:
        """[S, Hkv, D] -> [S, H, D] float32: each query head's KV head's summary key."""
        return summary_k.float().repeat_interleave(self.shape.num_heads // self.shape.num_kv_heads, dim=1)

    def threshold_logit(self, layer: int) -> torch.Tensor:
        """[H] logit of tau: a > tau iff score logit > this."""
        return self.tau_logit[layer]

    # -- gates ---------------------------------------------------------------------------
    def gates(self, layer: int, singular: torch.Tensor, summary_k: torch.Tensor) -> torch.Tensor:
        """singular: [S, Hkv, R] singular values of each span's keys (descending); summary_k: [S, Hkv, D].
        Returns g [S, Hkv, R] in (0, 1]: the first r_max directions gated, any beyond them (spans longer than
        the router was trained on) kept whole (1)."""
        S, Hkv, R = singular.shape
        rel = singular[..., :self.r_max].float() / singular[..., :1].float().clamp(min=1e-12)
        rel = nn.functional.pad(rel, (0, self.r_max - rel.shape[-1]))
        x = torch.cat([rel, nn.functional.normalize(summary_k.float(), dim=-1)], dim=-1)
        h = nn.functional.gelu(x @ self.w1[layer] + self.b1[layer])
        h = nn.functional.gelu(h @ self.w2[layer] + self.b2[layer])
        g = torch.sigmoid(h @ self.w3[layer] + self.b3[layer])
        return nn.functional.pad(g, (0, R - self.r_max), value=1.0) if R > self.r_max else g[..., :R]

    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.parameters())
