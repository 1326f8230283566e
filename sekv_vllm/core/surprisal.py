"""Token surprisal from a model's logits: s = -log p(token), the signal SeKV segments by (torch only)."""
from __future__ import annotations

import torch


def token_surprisal(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """logits: [n, V] (any float dtype), targets: [n] int64 -> [n] float32 surprisal in nats."""
    logits = logits.float()
    return torch.logsumexp(logits, dim=-1) - logits.gather(1, targets[:, None].to(logits.device)).squeeze(1)
