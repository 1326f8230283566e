"""The causal student: the frozen model decoding the recorded queries with the prompt compressed.

Each query token runs through every layer with its own hidden state (as a decode step does);
at each layer its attention reads, in one softmax:
  - the prompt's full-resolution rows (anchors, short runs, window), exact;
  - one summary row per span with bias log|S| + log(1 - z), z = sigmoid(logit - logit(tau));
  - every span token, keys rebuilt through the router's gates, with bias log z;
  - the continuation rows before the query (teacher-forced) and its own new row.
Nothing at or after a query's position but its own row is visible (a future perturbation
cannot change an earlier query's output), and every span is built from prompt tokens only,
which all precede every query. With z in {0, 1} (a hard zoom) this is exactly the serving
runtime's mixed attention.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from sekv_vllm.core import SpanKeys, fit_span_bases, singular_values, span_keys, summarize_spans
from sekv_vllm.core.low_rank import span_of_rows
from sekv_vllm.core.span_summary import span_token_index
from sekv_vllm.router import ZoomRouter
from sekv_vllm.training.frozen_lm import FrozenLM
from sekv_vllm.training.teacher import TeacherRecord

# (layer, q [Q, H, D], the layer's span keys, zoom_budget) -> zoom [Q, H, S] bool
HardZoom = Callable[[int, torch.Tensor, SpanKeys, int], torch.Tensor]


@dataclass
class LayerMemory:
    """The compressed prompt of one layer, as the runtime would hold it (no gradient)."""

    fixed_k: torch.Tensor  # [N, Hkv, D]
    fixed_v: torch.Tensor
    keys: SpanKeys  # summary keys [S, Hkv, D], span lengths, scoring centroids
    summary_v: torch.Tensor  # [S, Hkv, D]
    coef_k: torch.Tensor  # [S, Hkv, Lmax, R] U diag(s) of each span's tokens, zero-padded
    basis_k: torch.Tensor  # [S, Hkv, R, D]
    valid: torch.Tensor  # [S, Lmax] bool: real tokens of the padded spans
    singular_k: torch.Tensor  # [S, Hkv, R]
    span_v: torch.Tensor  # [P, Hkv, D] exact values of every span token
    row_span: torch.Tensor  # [P]
    cont_k: torch.Tensor  # [C, Hkv, D] continuation rows, positions T0 .. T-1
    cont_v: torch.Tensor

    @property
    def summary_k(self) -> torch.Tensor:
        return self.keys.summary_k

    @property
    def span_len(self) -> torch.Tensor:
        return self.keys.span_len


def layer_memories(rec: TeacherRecord, r_max: int, score_centroids: int, score_bits: int = 16,
                   score_range_spans: int = 1) -> list[LayerMemory]:
    layout = rec.layout
    T0 = rec.text.prompt_len
    fixed = torch.cat([layout.fixed_pos, torch.arange(layout.window_start, T0)])
    tok_idx, valid = span_token_index(layout.span_start, layout.span_len)
    span_pos = tok_idx[valid]
    out = []
    for i in range(rec.k.shape[0]):
        k, v = rec.k[i].float(), rec.v[i].float()
        bases = fit_span_bases(k[:T0], layout.span_start, layout.span_len, r_max)
        row_idx, _ = span_token_index(bases.row_offset, bases.span_len)
        coef = (bases.coef.float()[row_idx] * valid[:, :, None, None]).permute(0, 2, 1, 3)  # [S, Hkv, Lmax, R]
        summary_k = summarize_spans(k[:T0], rec.surprisal, layout.span_start, layout.span_len)
        out.append(LayerMemory(
            k[fixed], v[fixed],
            span_keys(k[:T0], summary_k, layout.span_start, layout.span_len, score_centroids, score_bits,
                      score_range_spans),
            summarize_spans(v[:T0], rec.surprisal, layout.span_start, layout.span_len),
            coef, bases.basis.float(), valid, singular_values(bases),
            v[span_pos], span_of_rows(bases), k[T0:], v[T0:],
        ))
    return out


@dataclass
class StudentOutput:
    logp: torch.Tensor  # [Q, V]
    score_logits: list[torch.Tensor] = field(default_factory=list)  # per layer [Q, H, S]
    zoom_logits: list[torch.Tensor] = field(default_factory=list)  # per layer [Q, H, S], minus logit(tau)
    gates: list[torch.Tensor] = field(default_factory=list)  # per layer [S, Hkv, R]


def budget_threshold(ell: torch.Tensor, span_len: torch.Tensor, zoom_budget: int) -> torch.Tensor:
    """[Q, H, 1]: midway between the last span a budgeted top-k by `ell` [Q, H, S] takes and the first
    it leaves (no gradient): the soft zoom sigmoid(ell - this) is a relaxed budgeted top-k."""
    ell = ell.detach()
    S = ell.shape[-1]
    ranked, order = torch.sort(ell, dim=-1, descending=True)
    taken = (torch.cumsum((span_len - 1)[order], dim=-1) <= zoom_budget).sum(dim=-1, keepdim=True)  # [Q, H, 1]
    last = ranked.gather(-1, (taken - 1).clamp(min=0))
    first = ranked.gather(-1, taken.clamp(max=S - 1))
    last = torch.where(taken > 0, last, ranked[..., :1] + 1)
    first = torch.where(taken < S, first, ranked[..., -1:] - 1)
    return (last + first) / 2


def student_forward(lm: FrozenLM, router: ZoomRouter, rec: TeacherRecord, memories: list[LayerMemory],
                    hard_zoom: HardZoom | None = None, relaxed_topk: bool = False,
                    temperature: float = 1.0) -> StudentOutput:
    """Decode every recorded query with the compressed prompt; soft zoom unless hard_zoom is given.

    relaxed_topk: the soft zoom is sigmoid((score - the record's budget threshold) / temperature)
    instead of sigmoid(score - logit(tau)), so the KL term ranks the spans at the budget's edge."""
    H, Hkv, D = lm.shape.num_heads, lm.shape.num_kv_heads, lm.shape.head_dim
    G = H // Hkv
    qpos = rec.query_pos
    Q = qpos.numel()
    T0 = rec.text.prompt_len
    cont_pos = torch.arange(T0, rec.text.ids.numel())
    cont_mask = cont_pos[None, :] < qpos[:, None]  # [Q, C]: strictly before the query
    h = lm.model.model.embed_tokens(rec.text.ids[qpos])  # [Q, hidden]
    out = StudentOutput(logp=torch.empty(0))
    for i, layer in enumerate(lm.layers):
        mem = memories[i]
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        q = lm.rope(lm.heads(attn.q_proj(x), H), qpos)
        k_new = lm.rope(lm.heads(attn.k_proj(x), Hkv), qpos)
        v_new = lm.heads(attn.v_proj(x), Hkv)

        S = mem.span_len.numel()
        if hard_zoom is None:
            g = router.gates(i, mem.singular_k, mem.summary_k)  # [S, Hkv, R]
            ell = router.score_logits(i, q, mem.keys)  # [Q, H, S]
            if relaxed_topk:
                zl = (ell - budget_threshold(ell, mem.span_len, rec.zoom_budget)) / temperature
            else:
                zl = ell - router.threshold_logit(i)[:, None]
            log_z, log_not_z = F.logsigmoid(zl), F.logsigmoid(-zl)
            out.score_logits.append(ell)
            out.zoom_logits.append(zl)
            out.gates.append(g)
        else:
            g = router.gates(i, mem.singular_k, mem.summary_k) if router is not None else None
            zoom = hard_zoom(i, q.detach(), mem.keys, rec.zoom_budget)
            log_z = torch.zeros(Q, H, S).masked_fill(~zoom, float("-inf"))
            log_not_z = torch.zeros(Q, H, S).masked_fill(zoom, float("-inf"))
        coef = mem.coef_k if g is None else mem.coef_k * g[:, :, None, :]
        span_k = (coef @ mem.basis_k).permute(0, 2, 1, 3)[mem.valid]  # [P, Hkv, D], spans in order

        keys = torch.cat([mem.fixed_k, mem.summary_k, span_k, mem.cont_k])  # [N, Hkv, D]
        values = torch.cat([mem.fixed_v, mem.summary_v, mem.span_v, mem.cont_v])
        N_f, C = mem.fixed_k.shape[0], mem.cont_k.shape[0]
        qg = q.view(Q, Hkv, G, D)
        logits = torch.einsum("qkgd,nkd->qkgn", qg, keys) * lm.scale  # [Q, Hkv, G, N]
        bias = torch.cat([
            torch.zeros(Q, H, N_f),
            torch.log(mem.span_len.float()) + log_not_z,
            log_z[:, :, mem.row_span],
            torch.zeros(Q, H, C).masked_fill(~cont_mask[:, None, :], float("-inf")),
        ], dim=-1).view(Q, Hkv, G, -1)
        own = (qg * k_new[:, :, None, :]).sum(-1, keepdim=True) * lm.scale  # [Q, Hkv, G, 1]
        p = torch.softmax(torch.cat([logits + bias, own], dim=-1), dim=-1)
        ctx = torch.einsum("qkgn,nkd->qkgd", p[..., :-1], values) + p[..., -1:] * v_new[:, :, None, :]
        h = h + attn.o_proj(ctx.reshape(Q, H * D))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    out.logp = lm.logprobs(lm.model.model.norm(h))
    return out
