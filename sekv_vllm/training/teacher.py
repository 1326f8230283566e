"""The teacher pass: the frozen model over one training text, kept for every later epoch.

What it records: post-rotary keys and values of every layer (float16), prompt surprisal,
the span layout the runtime would build, the query positions whose attention reaches
furthest beyond the local window, their next-token log-probs, their queries, and per query,
layer and head the attention mass on every span with the positive-span labels.
Attention mass is computed one layer at a time for the chosen queries only ([Q, H, T] at a
time), never as a [T, T] matrix.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from sekv_vllm.config import RequestOverrides
from sekv_vllm.core import SpanLayout
from sekv_vllm.core.span_summary import span_token_index
from sekv_vllm.runtime import SpanCosts, plan_layout, summary_dtype
from sekv_vllm.training.config import TrainConfig
from sekv_vllm.training.data import TrainingText
from sekv_vllm.training.frozen_lm import FrozenLM

_LOGIT_CHUNK = 256


@dataclass
class TeacherRecord:
    """T tokens, T0 prompt tokens, Q queries, L layers, S spans.

    k, v:        [L, T, Hkv, D] float16 post-rotary keys, values
    surprisal:   [T0] float32
    query_pos:   [Q] int64 positions in [T0, T - 1)
    logp:        [Q, V] float16 teacher next-token log-probs at the queries
    q:           [L, Q, H, D] float16 teacher post-rotary queries
    span_mass:   [Q, L, H, S] float32 attention mass on each span's tokens
    labels:      [Q, L, H, S] bool  smallest top set of spans holding rho of the span mass
    """

    text: TrainingText
    layout: SpanLayout
    zoom_budget: int
    k: torch.Tensor
    v: torch.Tensor
    surprisal: torch.Tensor
    query_pos: torch.Tensor
    logp: torch.Tensor
    q: torch.Tensor
    span_mass: torch.Tensor
    labels: torch.Tensor


def positive_spans(mass: torch.Tensor, rho: float) -> torch.Tensor:
    """mass: [..., S] >= 0 -> bool [..., S]: the fewest spans, by descending mass, holding rho of it."""
    total = mass.sum(dim=-1, keepdim=True)
    sorted_mass, order = torch.sort(mass, dim=-1, descending=True)
    before = torch.cumsum(sorted_mass, dim=-1) - sorted_mass  # mass of the spans ranked above
    take_sorted = (before < rho * total) & (total > 0)
    return torch.zeros_like(take_sorted).scatter(-1, order, take_sorted)


def span_index(layout: SpanLayout, T: int) -> torch.Tensor:
    """[T] int64: the span of each position, S (one past the last) for rows kept at full resolution."""
    idx = torch.full((T,), layout.num_spans, dtype=torch.int64)
    pos, valid = span_token_index(layout.span_start, layout.span_len)
    idx[pos[valid]] = torch.arange(layout.num_spans)[:, None].expand_as(pos)[valid]
    return idx


@torch.no_grad()
def teacher_pass(lm: FrozenLM, text: TrainingText, config: TrainConfig) -> TeacherRecord:
    L, H, Hkv, D = lm.shape.num_layers, lm.shape.num_heads, lm.shape.num_kv_heads, lm.shape.head_dim
    ids, T0 = text.ids, text.prompt_len
    T = ids.numel()
    pre: dict[tuple[int, str], torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(lm.layers):
        for name in ("q_proj", "k_proj", "v_proj"):
            def hook(_m, _inp, out, key=(i, name)):
                pre[key] = out[0]
            hooks.append(getattr(layer.self_attn, name).register_forward_hook(hook))
    try:
        hidden = lm.model.model(input_ids=ids[None]).last_hidden_state[0]  # [T, hidden], normed
    finally:
        for h in hooks:
            h.remove()

    # Surprisal of prompt tokens 1..T0-1 (s_0 = 0), as the serving runtime computes it.
    surprisal = torch.zeros(T0)
    for a in range(0, T0 - 1, _LOGIT_CHUNK):
        b = min(a + _LOGIT_CHUNK, T0 - 1)
        logp = lm.logprobs(hidden[a:b])
        surprisal[a + 1:b + 1] = -logp.gather(1, ids[a + 1:b + 1, None]).squeeze(1)

    pos = torch.arange(T)
    k = torch.stack([lm.rope(lm.heads(pre[(i, "k_proj")], Hkv), pos) for i in range(L)])  # [L, T, Hkv, D]
    v = torch.stack([lm.heads(pre[(i, "v_proj")], Hkv) for i in range(L)])
    cand = torch.arange(T0, T - 1)
    q = torch.stack([lm.rope(lm.heads(pre[(i, "q_proj")][cand], H), cand) for i in range(L)])  # [L, C, H, D]

    budget = config.sekv.budget_for(T0, RequestOverrides(sekv_budget_ratio=text.budget_ratio))
    # what the served plan holds: float32 rows (vLLM's CPU cache), the summaries' dtype beside them and the
    # router's span scales
    costs = SpanCosts.of_rows(Hkv, D, 4, H * 2, summary_dtype(config.sekv, torch.float32).itemsize)
    plan = plan_layout(surprisal, budget, config.sekv, costs)
    layout, zoom_budget = plan.layout, plan.zoom_budget
    S = layout.num_spans
    where = span_index(layout, T)
    window = config.sekv.window
    mass = torch.zeros(cand.numel(), L, H, S + 1)
    beyond = torch.zeros(cand.numel())
    causal = pos[None, :] <= cand[:, None]  # [C, T]
    far = pos[None, :] < (cand[:, None] - window)
    for i in range(L):
        qg = q[i].view(-1, Hkv, H // Hkv, D)
        logits = torch.einsum("ckgd,tkd->ckgt", qg, k[i]) * lm.scale
        p = torch.softmax(logits.masked_fill(~causal[:, None, None, :], float("-inf")), dim=-1).reshape(-1, H, T)
        mass[:, i].index_add_(2, where, p)
        beyond += (p * far[:, None, :]).sum(dim=(1, 2)) / (L * H)
    keep = torch.sort(torch.topk(beyond, min(config.queries, cand.numel())).indices).values
    span_mass = mass[keep, :, :, :S]
    return TeacherRecord(
        text=text, layout=layout, zoom_budget=zoom_budget,
        k=k.half(), v=v.half(), surprisal=surprisal, query_pos=cand[keep],
        logp=lm.logprobs(hidden[cand[keep]]).half(), q=q[:, keep].half(),
        span_mass=span_mass, labels=positive_spans(span_mass, config.rho),
    )
