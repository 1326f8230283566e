"""Token surprisal from a model's logits: s = -log p(token), the signal SeKV segments by (torch only)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


def token_surprisal(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """logits: [n, V] (any float dtype), targets: [n] int64 -> [n] float32 surprisal in nats."""
    logits = logits.float()
    return torch.logsumexp(logits, dim=-1) - logits.gather(1, targets[:, None].to(logits.device)).squeeze(1)


def bfloat16_is_fast(device: torch.device) -> bool:
    """Whether bfloat16 matrix products beat float32's on `device` (CPUs: bfloat16 dot products, AVX-512 BF16 or
    AMX; on AVX2 alone they run ~5x slower than float32's)."""
    if device.type == "cuda":
        return True
    return device.type == "cpu" and (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


@dataclass(frozen=True)
class LogitHead:
    """A model's output projection, for the surprisal of many prompt tokens at once:
    logits = scale * soft_cap * tanh((hidden @ weight^T) / soft_cap) (no cap where soft_cap is None).

    weight: [V, hidden], the vocabulary's rows only (no padding), in the dtype the product runs in:
            bfloat16 where the CPU has bfloat16 dot products, about 2.5x float32's speed for a
            surprisal within ~0.1 nats of float32's (mean 0.02 on the default model's 4K essay
            prompts, whose surprisal has a standard deviation of ~3 nats).
    """

    weight: torch.Tensor
    soft_cap: float | None = None
    scale: float = 1.0

    def logit_buffer(self, rows: int) -> torch.Tensor:
        """[rows, V] scratch in the weight's dtype for `surprisal`'s logits, reused across calls: a fresh buffer
        of that size (25 MB for 256 rows of a 49K vocabulary) is new memory the CPU faults in page by page, ~40%
        of the call's time."""
        return torch.empty(rows, self.weight.shape[0], dtype=self.weight.dtype, device=self.weight.device)

    def surprisal(self, hidden: torch.Tensor, targets: torch.Tensor, buffer: torch.Tensor | None = None) -> torch.Tensor:
        """hidden: [n, hidden] (any float dtype), targets: [n] int64 -> [n] float32 surprisal in nats.
        buffer: `logit_buffer(m)` with m >= n, overwritten; None: a new one."""
        n = hidden.shape[0]
        logits = torch.matmul(hidden.to(self.weight.dtype), self.weight.T,
                              out=(buffer if buffer is not None else self.logit_buffer(n))[:n])
        if self.soft_cap is not None or self.scale != 1.0:
            logits = logits.float()
            if self.soft_cap is not None:
                logits = torch.tanh(logits / self.soft_cap) * self.soft_cap
            return token_surprisal(logits * self.scale, targets)
        # The log-sum-exp of the logits less their row maximum, in the product's dtype: every exponent
        # is <= 0 and the ones that carry the sum are near 0, where bfloat16 is densest (accumulated in
        # float32 by torch); the maximum is added back in float32.
        top = logits.amax(dim=-1, keepdim=True)
        picked = logits.gather(1, targets[:, None].to(logits.device)).squeeze(1).float()
        lse = torch.logsumexp(logits.sub_(top), dim=-1).float() + top[:, 0].float()
        return lse - picked
