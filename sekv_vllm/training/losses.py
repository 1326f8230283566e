"""The router's training losses (method doc), with the budget term differentiable.

  KL(teacher || student) on next-token distributions at the queries
  + bce_weight * BCE(score, positive-span labels), positives weighted pos_weight; each
    (query, layer, head) weighted by the share of its attention that lands on spans, so heads
    that only look at the sink and the window do not dominate
  + rank_weight * cross-entropy of the teacher's span-mass distribution against softmax(scores)
    over the spans, same weighting: the spans are zoomed by descending score under a budget, so
    the order of the scores is what serving uses (an addition to the method doc's losses)
  + gate_weight * energy the gates remove, sum (1-g)^2 s^2 / sum s^2 per span
  + ramp * budget_weight * relu(E[zoomed rows] - zoom budget) / (rows of all spans), E over the
    soft zoom z = sigmoid(logit - logit(tau)): its gradient reaches both the scores and tau (the
    reference code's hard expansion count had none); bounded by 1.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from sekv_vllm.training.config import TrainConfig
from sekv_vllm.training.student import LayerMemory, StudentOutput
from sekv_vllm.training.teacher import TeacherRecord


def kl_to_teacher(teacher_logp: torch.Tensor, student_logp: torch.Tensor) -> torch.Tensor:
    """Mean over queries of KL(teacher || student); both [Q, V] log-probs."""
    t = teacher_logp.float()
    return (t.exp() * (t - student_logp)).sum(dim=-1).mean()


def router_losses(out: StudentOutput, rec: TeacherRecord, memories: list[LayerMemory], config: TrainConfig,
                  budget_ramp: float) -> dict[str, torch.Tensor]:
    kl = kl_to_teacher(rec.logp, out.logp)
    L = len(out.score_logits)
    bce = rank = gate = budget = torch.zeros(())
    weight = rec.span_mass.sum(dim=-1)  # [Q, L, H]
    weight = weight / weight.mean().clamp(min=1e-12)
    pos_weight = torch.tensor(config.pos_weight)
    for i in range(L):
        ell = out.score_logits[i]  # [Q, H, S]
        if ell.shape[-1] == 0:
            continue
        per = F.binary_cross_entropy_with_logits(ell, rec.labels[:, i].float(), pos_weight=pos_weight,
                                                 reduction="none").mean(dim=-1)  # [Q, H]
        bce = bce + (per * weight[:, i]).mean() / L
        mass = rec.span_mass[:, i]  # [Q, H, S]
        target = mass / mass.sum(dim=-1, keepdim=True).clamp(min=1e-12)
        ce = -(target * torch.log_softmax(ell, dim=-1)).sum(dim=-1)  # [Q, H]
        rank = rank + (ce * weight[:, i]).mean() / L
        s2 = memories[i].singular_k ** 2
        gate = gate + (((1 - out.gates[i]) ** 2 * s2).sum(-1) / s2.sum(-1).clamp(min=1e-12)).mean() / L
        cost = (memories[i].span_len - 1).float()
        rows = (torch.sigmoid(out.zoom_logits[i]) * cost).sum(dim=-1)  # [Q, H]
        budget = budget + (F.relu(rows - rec.zoom_budget) / cost.sum().clamp(min=1)).mean() / L
    total = (kl + config.bce_weight * bce + config.rank_weight * rank + config.gate_weight * gate
             + budget_ramp * config.budget_weight * budget)
    return {"loss": total, "kl": kl, "bce": bce, "rank": rank, "gate": gate, "budget": budget}
