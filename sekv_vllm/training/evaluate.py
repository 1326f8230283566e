"""Held-out evaluation of zoom policies against the teacher.

Per (query, layer, head) of held-out records, with each policy's hard zoom under the record's
zoom budget: recall of the teacher's positive spans, share of the span attention mass zoomed,
and the student's KL to the teacher and next-token agreement (the compressed model's output).
"""
from __future__ import annotations

import torch

from sekv_vllm.policies import ZoomPolicy
from sekv_vllm.router import ZoomRouter
from sekv_vllm.training.frozen_lm import FrozenLM
from sekv_vllm.training.losses import kl_to_teacher
from sekv_vllm.training.student import layer_memories, student_forward
from sekv_vllm.training.teacher import TeacherRecord


@torch.no_grad()
def evaluate_policy(lm: FrozenLM, policy: ZoomPolicy, router: ZoomRouter | None, records: list[TeacherRecord],
                    r_max: int, score_centroids: int, score_bits: int = 16, score_range_spans: int = 1) -> dict:
    """router: whose gates rebuild the keys (None: exact rebuild); score_centroids: per span (0: summary),
    at score_bits bits per element.
    KL and agreement are also given per budget ratio of the records (`by_budget`), and span recall, KL and
    agreement per source of the texts (`by_source`: essay or task family)."""
    recall, mass_share, kls, agree, zoomed, ratios, sources, text_recall = [], [], [], [], [], [], [], []

    def hard_zoom(layer, q, keys, zoom_budget):
        return torch.stack([policy.select(layer, q[j], keys, zoom_budget, lm.scale)
                            for j in range(q.shape[0])])

    for rec in records:
        if rec.layout.num_spans == 0:
            continue
        mems = layer_memories(rec, r_max, score_centroids, score_bits, score_range_spans)
        first = len(recall)
        for i in range(len(mems)):
            q = rec.q[i].float()  # teacher queries: what the policy sees at this layer
            zoom = hard_zoom(i, q, mems[i].keys, rec.zoom_budget)  # [Q, H, S]
            labels, mass = rec.labels[:, i], rec.span_mass[:, i]
            has_pos = labels.any(dim=-1)
            recall.append(((zoom & labels).sum(-1).float() / labels.sum(-1).clamp(min=1))[has_pos])
            mass_share.append(((zoom * mass).sum(-1) / mass.sum(-1).clamp(min=1e-12))[has_pos])
            zoomed.append(zoom.sum(-1).float().flatten())
        out = student_forward(lm, router, rec, mems, hard_zoom=hard_zoom)
        ratios.append(rec.text.budget_ratio)
        sources.append(rec.text.source)
        text_recall.append(torch.cat(recall[first:]))
        kls.append(kl_to_teacher(rec.logp, out.logp))
        agree.append((out.logp.argmax(-1) == rec.logp.float().argmax(-1)).float().mean())
    return {
        "span_recall": float(torch.cat(recall).mean()),
        "span_mass_zoomed": float(torch.cat(mass_share).mean()),
        "mean_zoomed_spans": float(torch.cat(zoomed).mean()),
        "kl_to_full_kv": float(torch.stack(kls).mean()),
        "next_token_agreement": float(torch.stack(agree).mean()),
        "records": len(kls),
        "by_budget": {
            str(b): {"kl_to_full_kv": float(torch.stack([x for x, r in zip(kls, ratios) if r == b]).mean()),
                     "next_token_agreement": float(torch.stack([x for x, r in zip(agree, ratios) if r == b]).mean()),
                     "records": ratios.count(b)}
            for b in sorted(set(ratios), reverse=True)
        },
        "by_source": {source: _per_source([j for j, s in enumerate(sources) if s == source], text_recall, kls, agree)
                      for source in sorted(set(sources))},
    }


def _per_source(texts: list[int], recall: list[torch.Tensor], kls: list[torch.Tensor], agree: list[torch.Tensor]
                ) -> dict:
    """Span recall (over every query, layer and head), KL and agreement (per text) of the texts listed."""
    return {"span_recall": float(torch.cat([recall[j] for j in texts]).mean()),
            "kl_to_full_kv": float(torch.stack([kls[j] for j in texts]).mean()),
            "next_token_agreement": float(torch.stack([agree[j] for j in texts]).mean()),
            "records": len(texts)}
