"""Token surprisal from a model's logits: s = -log p(token), the signal SeKV segments by (torch only)."""
from __future__ import annotations

from dataclasses import dataclass, field

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


# Every TAIL_STRIDE-th token past a sampled head's exact ones stands for the rest of the vocabulary's mass.
TAIL_STRIDE = 8


@dataclass(frozen=True)
class LogitHead:
    """A model's output projection, for the surprisal of many prompt tokens at once:
    logits = scale * soft_cap * tanh((hidden @ weight^T) / soft_cap) (no cap where soft_cap is None).

    weight: [V, hidden], the vocabulary's rows only (no padding), in the dtype the product runs in:
            bfloat16 where the CPU has bfloat16 dot products, about 2.5x float32's speed for a
            surprisal within ~0.1 nats of float32's (mean 0.02 on the default model's 4K essay
            prompts, whose surprisal has a standard deviation of ~3 nats).
    exact_tokens: 0: every token's logit (the exact log-sum-exp). N > 0: the log-sum-exp from the logits of
            token ids below N (a BPE vocabulary's most frequent: the earliest merges), of the targets themselves,
            and of every TAIL_STRIDE-th other id, each of those standing for TAIL_STRIDE of the rest; the
            target's own logit stays exact. The default model's 49K words at N = 8192: ~3.6x fewer products,
            within ~0.05 nats of float32's on average, p99 ~0.4 (the rest's mass is spread thin: its sample's
            error averages out; `benchmarks/perf/surprisal_tail.py`). Its rows are copied once (15 MB there).
    """

    weight: torch.Tensor
    soft_cap: float | None = None
    scale: float = 1.0
    exact_tokens: int = 0
    # [exact_tokens + tail samples, hidden]: the rows a sampled head multiplies every time (the exact ids, then
    # the tail's sample); None for the exact head.
    rows: torch.Tensor | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.sampled:
            tail = self.weight[self.exact_tokens :: TAIL_STRIDE]
            object.__setattr__(self, "rows", torch.cat([self.weight[: self.exact_tokens], tail]).contiguous())

    @property
    def sampled(self) -> bool:
        return 0 < self.exact_tokens < self.weight.shape[0] - TAIL_STRIDE

    def logit_buffer(self, rows: int) -> torch.Tensor:
        """[rows, columns] scratch in the weight's dtype for `surprisal`'s logits, reused across calls: a fresh
        buffer of that size (25 MB for 256 rows of a 49K vocabulary) is new memory the CPU faults in page by page,
        ~40% of the call's time."""
        columns = self.rows.shape[0] if self.sampled else self.weight.shape[0]
        return torch.empty(rows, columns, dtype=self.weight.dtype, device=self.weight.device)

    def surprisal(self, hidden: torch.Tensor, targets: torch.Tensor, buffer: torch.Tensor | None = None) -> torch.Tensor:
        """hidden: [n, hidden] (any float dtype), targets: [n] int64 -> [n] float32 surprisal in nats.
        buffer: `logit_buffer(m)` with m >= n, overwritten; None: a new one."""
        n = hidden.shape[0]
        buffer = (buffer if buffer is not None else self.logit_buffer(n))[:n]
        if self.sampled:
            return self._sampled_surprisal(hidden.to(self.weight.dtype), targets.to(self.weight.device), buffer)
        logits = torch.matmul(hidden.to(self.weight.dtype), self.weight.T, out=buffer)
        if self.soft_cap is not None or self.scale != 1.0:
            return token_surprisal(self._processed(logits), targets)
        # The log-sum-exp of the logits less their row maximum, in the product's dtype: every exponent
        # is <= 0 and the ones that carry the sum are near 0, where bfloat16 is densest (accumulated in
        # float32 by torch); the maximum is added back in float32.
        top = logits.amax(dim=-1, keepdim=True)
        picked = logits.gather(1, targets[:, None].to(logits.device)).squeeze(1).float()
        lse = torch.logsumexp(logits.sub_(top), dim=-1).float() + top[:, 0].float()
        return lse - picked

    def _processed(self, logits: torch.Tensor) -> torch.Tensor:
        """The soft cap and scale of vLLM's logits processor, in float32."""
        logits = logits.float()
        if self.soft_cap is not None:
            logits = torch.tanh(logits / self.soft_cap) * self.soft_cap
        return logits * self.scale

    def _sampled_surprisal(self, hidden: torch.Tensor, targets: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
        """`surprisal` with the sampled tail (see exact_tokens). hidden in the weight's dtype."""
        K, V = self.exact_tokens, self.weight.shape[0]
        extra = targets[targets >= K].unique()  # ascending: the targets past the exact ids, counted exactly
        logits = torch.matmul(hidden, self.rows.T, out=buffer)  # [n, K + samples]
        extra_logits = hidden @ self.weight[extra].T  # [n, E]
        if self.soft_cap is not None or self.scale != 1.0:
            logits, extra_logits = self._processed(logits), self._processed(extra_logits)
        in_head = targets < K
        picked = torch.where(
            in_head, logits.gather(1, targets.clamp(max=K - 1)[:, None]).squeeze(1).float(),
            extra_logits.gather(1, torch.searchsorted(extra, targets).clamp(max=max(extra.numel() - 1, 0))[:, None]
                                ).squeeze(1).float() if extra.numel() else 0.0)
        # A sampled id that is also a target is counted exactly: the sample stands for the tail less the targets.
        taken = torch.isin(torch.arange(K, V, TAIL_STRIDE, device=targets.device), extra).nonzero().squeeze(1)
        logits.index_fill_(1, K + taken, float("-inf"))
        tail_share = (V - K - extra.numel()) / max(self.rows.shape[0] - K - taken.numel(), 1)
        top = logits.amax(dim=-1)
        if extra.numel():
            top = torch.maximum(top, extra_logits.amax(dim=-1))
        # exponents <= 0 in the product's dtype (see `surprisal`), summed in float32
        exps = logits.sub_(top[:, None]).exp_()
        total = (exps[:, :K].sum(dim=-1, dtype=torch.float32)
                 + tail_share * exps[:, K:].sum(dim=-1, dtype=torch.float32)
                 + (extra_logits.float() - top[:, None].float()).exp().sum(dim=-1))
        return total.log() + top.float() - picked
