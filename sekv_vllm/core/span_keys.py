"""What a zoom policy reads of one layer's spans: summary keys and key centroids (fast tier).

The method's untrained score q . k_bar / sqrt(D) + log|S| reads a span through the mean of its
keys, which washes out the one token a query needs (a needle among 30 filler tokens). Each span
therefore also keeps C key centroids (k-means of its keys) with the number of tokens each stands
for, and is scored as
    score[h, s] = logsumexp_c(q_h . c_sc / sqrt(D) + log n_sc),
an estimate of log sum_{t in s} exp(q_h . k_t / sqrt(D)): the span's true share of attention.
With C >= |S| every token is its own centroid and the estimate is exact; with C = 0 the span
is scored through its summary key alone (C = 1 centroid k_bar standing for |S| tokens), which
is the method doc's score.

Centroids are kept in float16, or at 2, 4 or 8 bits per element (`score_bits`): quantized per
KV head and channel over the centroids of a few consecutive spans (KIVI's per-channel key
quantization over groups of tokens: a few channels of LLM keys carry large magnitudes, so each
channel gets its own range; `range_spans` spans share one, 128 tokens at 4 spans of 32). With one
centroid per token that is every key of the span at a few bits, which ranks spans almost as the
exact keys do for a fraction of the bytes; the tokens each centroid stands for are then implied
by the span's length and not stored.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from sekv_vllm.core.span_summary import span_token_index

_LLOYD_ITERATIONS = 6
QUANT_BITS = (2, 4, 8)  # besides 16: float16


@dataclass(frozen=True)
class CentroidCodes:
    """Key centroids at `bits` per element, quantized per (range, KV head, channel).

    codes: [S, Hkv, D // m, C] uint8, m = 8 // bits codes per byte; byte [j, c] holds centroid c's
           channels j + i * (D // m), i = 0..m-1, channel j + i * (D // m) in bits [i * bits, (i + 1) * bits)
           (centroid-minor: the decode kernel scores a span's centroids side by side in vector lanes)
    lo, step: [N, Hkv, D] float16, one range per group of consecutive spans; a channel's value is lo + step * code
    range_of: [S] int64, the range (row of lo and step) of each span
    """

    codes: torch.Tensor
    lo: torch.Tensor
    step: torch.Tensor
    range_of: torch.Tensor
    bits: int

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.lo, self.step, self.range_of))

    def dequantize(self) -> torch.Tensor:
        """[S, C, Hkv, D] float32."""
        S, Hkv, Dm, C = self.codes.shape
        m = 8 // self.bits
        shifts = torch.arange(m, dtype=torch.uint8, device=self.codes.device) * self.bits
        code = (self.codes[:, :, None] >> shifts[:, None, None]) & ((1 << self.bits) - 1)  # [S, Hkv, m, Dm, C]
        lo, step = self.lo[self.range_of].float(), self.step[self.range_of].float()
        x = lo[..., None] + step[..., None] * code.reshape(S, Hkv, m * Dm, C).float()
        return x.permute(0, 3, 1, 2)


def quantize_centroids(cent: torch.Tensor, present: torch.Tensor | None, bits: int, range_spans: int = 1) -> CentroidCodes:
    """cent: [S, Hkv, C, D] float; present: [S, Hkv, C] bool (centroids that stand for tokens: only they
    set a channel's range), or None where every centroid is one of its span's keys (a slot past the span's
    length repeats one); range_spans: consecutive spans sharing a range."""
    S, Hkv, C, D = cent.shape
    m = 8 // bits if bits in QUANT_BITS else 1
    if bits not in QUANT_BITS or D % m:
        raise ValueError(f"score_bits: {bits} bits per element needs head_dim ({D}) divisible by {m}; "
                         f"allowed: {sorted(QUANT_BITS)} or 16 (float16)")
    top = (1 << bits) - 1
    range_of = torch.arange(S, device=cent.device) // range_spans
    N = -(-S // range_spans)
    if present is None:
        lo, hi = torch.aminmax(cent, dim=2)  # [S, Hkv, D]
    else:
        have = present[..., None]
        lo = torch.where(have, cent, torch.inf).amin(dim=2)
        hi = torch.where(have, cent, -torch.inf).amax(dim=2)
    if range_spans > 1:
        at = range_of[:, None, None].expand(S, Hkv, D)
        lo = torch.full((N, Hkv, D), torch.inf, device=cent.device).scatter_reduce(0, at, lo, "amin")
        hi = torch.full((N, Hkv, D), -torch.inf, device=cent.device).scatter_reduce(0, at, hi, "amax")
    lo16 = lo.half()
    step16 = ((hi - lo16.float()) / top).half()
    lo_s, step_s = (lo16.float(), step16.float()) if range_spans == 1 else (lo16.float()[range_of], step16.float()[range_of])
    # A channel whose range is one value (step 0) codes every element as 0: dividing by inf gives it.
    step_s = torch.where(step_s > 0, step_s, torch.inf)[:, :, None]
    code = (cent - lo_s[:, :, None]).div_(step_s).round_().clamp_(0, top).to(torch.uint8)
    code = code.view(S, Hkv, C, m, D // m).permute(0, 1, 3, 4, 2)  # [S, Hkv, m, Dm, C]
    packed = code[:, :, 0].clone()
    for i in range(1, m):
        packed |= code[:, :, i] << (i * bits)
    return CentroidCodes(packed.contiguous(), lo16, step16, range_of, bits)


@dataclass(frozen=True)
class SpanKeys:
    """summary_k:  [S, Hkv, D]     the spans' summary keys (also attended)
    span_len:   [S] int64
    centroid_k: [S, C, Hkv, D]  key centroids of each span, C >= 1 (float16; the summary keys' dtype
                                when C = 0), or None when they are kept as `codes`
    stored_log_count: [S, Hkv, C] float16  log of the tokens each centroid stands for (-inf: none), or
                                None when every centroid is one key (centroid c stands for token c of
                                its span, if the span has one: `log_count`)
    codes:      the centroids at a few bits per element, or None
    of_summary: the one centroid of each span is its summary key (C = 0: nothing kept beside it)
    """

    summary_k: torch.Tensor
    span_len: torch.Tensor
    centroid_k: torch.Tensor | None
    stored_log_count: torch.Tensor | None
    codes: CentroidCodes | None = None
    of_summary: bool = False

    @property
    def num_centroids(self) -> int:
        """C: the centroids kept per span (1 for the summary key alone)."""
        return self.codes.codes.shape[3] if self.codes is not None else self.centroid_k.shape[1]

    @property
    def every_key_a_centroid(self) -> bool:
        """Centroid c is token c of its span (counts implied): `centroid_logits_rows` ranks single keys."""
        return self.stored_log_count is None

    @property
    def log_count(self) -> torch.Tensor:
        """[S, Hkv, C] float16: log of the tokens each centroid stands for (-inf: none)."""
        if self.stored_log_count is not None:
            return self.stored_log_count
        S, Hkv, C = self.num_spans, self.summary_k.shape[1], self.num_centroids
        one = torch.arange(C, device=self.span_len.device)[None, :] < self.span_len[:, None]  # [S, C]
        logs = torch.zeros(S, C, dtype=torch.float16, device=one.device).masked_fill(~one, float("-inf"))
        return logs[:, None].expand(S, Hkv, C)

    def centroids(self) -> torch.Tensor:
        """[S, C, Hkv, D] float32, dequantized where kept as codes."""
        return self.codes.dequantize() if self.codes is not None else self.centroid_k.float()

    @classmethod
    def of_summaries(cls, summary_k: torch.Tensor, span_len: torch.Tensor) -> "SpanKeys":
        """No centroids: each span scored through its summary key standing for |S| tokens."""
        S, Hkv, _ = summary_k.shape
        log_len = torch.log(span_len.float()).half()[:, None, None].expand(S, Hkv, 1).contiguous()
        return cls(summary_k, span_len, summary_k[:, None], log_len, of_summary=True)

    @property
    def num_spans(self) -> int:
        return int(self.span_len.numel())

    @property
    def centroid_nbytes(self) -> int:
        """Fast-tier bytes of the scoring centroids (the summary rows are counted with the summaries)."""
        if self.codes is not None:
            stored = self.codes.nbytes
        else:
            stored = 0 if self.of_summary else self.centroid_k.numel() * self.centroid_k.element_size()
        counts = self.stored_log_count
        return stored + (0 if counts is None else counts.numel() * counts.element_size())

    def score(self, q: torch.Tensor, scale: float) -> torch.Tensor:
        """Estimated log attention mass of each span: q [..., H, D] -> [..., H, S] float32."""
        *lead, H, D = q.shape
        cent = self.centroids()
        S, C, Hkv, _ = cent.shape
        qg = q.float().reshape(*lead, Hkv, H // Hkv, D)
        logits = torch.einsum("...kgd,sckd->...kgsc", qg, cent) * scale
        logits = logits + self.log_count.float().permute(1, 0, 2)[:, None]  # [Hkv, 1, S, C]
        return torch.logsumexp(logits, dim=-1).reshape(*lead, H, S)

    def score_rows(self, q: torch.Tensor, scale: float) -> torch.Tensor:
        """`score` with one query per span (the query of the request the span belongs to):
        q [S, H, D] -> [S, H] float32."""
        return torch.logsumexp(self.centroid_logits_rows(q, scale), dim=-1)

    def centroid_logits_rows(self, q: torch.Tensor, scale: float) -> torch.Tensor:
        """Each centroid's term of `score_rows`, q . c * scale + log n_c (-inf where it stands for no
        token): q [S, H, D] -> [S, H, C] float32. With every key a centroid, each key's estimated logit."""
        cent = self.centroids()
        S, C, Hkv, D = cent.shape
        qg = q.float().view(S, Hkv, -1, D)
        logits = torch.einsum("skgd,sckd->skgc", qg, cent) * scale
        logits = logits + self.log_count.float()[:, :, None, :]  # [S, Hkv, 1, C]
        return logits.reshape(S, -1, C)


def concat_span_keys(parts: list[SpanKeys]) -> SpanKeys:
    """The spans of several requests, one after another; fewer centroids are padded (count 0).
    Centroids kept as codes are dequantized (float32): the torch path's input."""
    cents = [p.centroids() for p in parts]
    C = max(c.shape[1] for c in cents)

    def pad(p: SpanKeys, cent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        extra = C - cent.shape[1]
        if extra == 0:
            return cent, p.log_count
        S, _, Hkv, D = cent.shape
        return (torch.cat([cent, cent.new_zeros(S, extra, Hkv, D)], dim=1),
                torch.cat([p.log_count, p.log_count.new_full((S, Hkv, extra), float("-inf"))], dim=2))

    padded = [pad(p, c) for p, c in zip(parts, cents)]
    return SpanKeys(torch.cat([p.summary_k for p in parts]), torch.cat([p.span_len for p in parts]),
                    torch.cat([c for c, _ in padded]), torch.cat([n for _, n in padded]))


def append_span_keys(first: SpanKeys, more: SpanKeys) -> SpanKeys:
    """The spans of `first`, then those of `more`, kept as they are (same centroid count and
    storage: both float16 or both codes of the same bits); `more`'s spans keep their own quantization
    ranges. The counts stay implied only where both imply them (spans no longer than the centroids)."""
    a, b = first.codes, more.codes
    if (first.num_centroids != more.num_centroids or (a is None) != (b is None)
            or (a is not None and a.bits != b.bits) or first.of_summary != more.of_summary):
        raise ValueError("append_span_keys: both must keep the same number of centroids the same way")
    codes = None if a is None else CentroidCodes(
        torch.cat([a.codes, b.codes]), torch.cat([a.lo, b.lo]), torch.cat([a.step, b.step]),
        torch.cat([a.range_of, b.range_of + a.lo.shape[0]]), a.bits)
    implied = first.stored_log_count is None and more.stored_log_count is None
    counts = None if implied else torch.cat([first.log_count, more.log_count]).contiguous()
    return SpanKeys(
        torch.cat([first.summary_k, more.summary_k]), torch.cat([first.span_len, more.span_len]),
        None if codes is not None else torch.cat([first.centroid_k, more.centroid_k]),
        counts, codes, first.of_summary,
    )


def scoring_nbytes(num_centroids: int, bits: int, num_kv_heads: int, head_dim: int, max_span: int,
                   range_spans: int = 1) -> float:
    """Fast-tier bytes of one span's scoring centroids and counts (`SpanKeys.centroid_nbytes` per span,
    a range shared by `range_spans` spans counted in shares; spans of at most `max_span` tokens)."""
    Hkv, D, C = num_kv_heads, head_dim, num_centroids
    if C == 0:
        return Hkv * 2
    counts = 0 if C >= max_span else Hkv * C * 2
    if bits == 16:
        return C * Hkv * D * 2 + counts
    # codes, a share of the range's lo and step, the span's range index (int64)
    return Hkv * (D // (8 // bits)) * C + 2 * Hkv * D * 2 / range_spans + 8 + counts


def span_keys(k: torch.Tensor, summary_k: torch.Tensor, span_start: torch.Tensor, span_len: torch.Tensor,
              num_centroids: int, bits: int = 16, range_spans: int = 1) -> SpanKeys:
    """k: [T, Hkv, D] prompt keys; summary_k: [S, Hkv, D]; num_centroids: C (0: the summary only);
    bits: 16 keeps the centroids in float16, 2/4/8 as `CentroidCodes` with a range per `range_spans`
    consecutive spans.

    Lloyd's k-means per span and KV head, a fixed number of iterations, started from farthest
    points (deterministic): an outlier key, the needle a query may look for, gets a centroid of its
    own instead of being averaged into its neighbours. Centroids are stored in float16 (they only
    rank spans; half the fast-tier bytes of float32 keys). With C at least every span's length each
    key is its own centroid and the counts are implied, not stored.
    """
    S = span_len.numel()
    if num_centroids == 0 or S == 0:
        return SpanKeys.of_summaries(summary_k, span_len)
    C = num_centroids
    index, valid = span_token_index(span_start, span_len)  # [S, L]
    x = k.float()[index].permute(0, 2, 1, 3)  # [S, Hkv, L, D]
    Hkv, L = x.shape[1], x.shape[2]
    if C >= L:
        # every key is its own centroid (what k-means gives too, without its cost); the slots past a span's
        # length repeat its last key (`span_token_index`), which counts as no token (`log_count`)
        cent = x if C == L else torch.cat([x, x[:, :, -1:].expand(S, Hkv, C - L, x.shape[3])], dim=2)
        present = None
        log_count = None
    else:
        cent = _farthest_points(x, valid, C)
        member = valid[:, None, :, None]  # [S, 1, L, 1]
        for _ in range(_LLOYD_ITERATIONS):
            near = torch.cdist(x, cent).argmin(dim=-1)  # [S, Hkv, L]
            one_hot = torch.nn.functional.one_hot(near, C).float() * member  # [S, Hkv, L, C]
            count = one_hot.sum(dim=2)  # [S, Hkv, C]
            sums = torch.einsum("shlc,shld->shcd", one_hot, x)
            cent = torch.where(count[..., None] > 0, sums / count.clamp(min=1)[..., None], cent)
        present = count > 0
        log_count = torch.log(count).half().contiguous()  # [S, Hkv, C]
    if bits != 16:
        return SpanKeys(summary_k, span_len, None, log_count, quantize_centroids(cent, present, bits, range_spans))
    return SpanKeys(summary_k, span_len, cent.permute(0, 2, 1, 3).half().contiguous(), log_count)


def _farthest_points(x: torch.Tensor, valid: torch.Tensor, C: int) -> torch.Tensor:
    """x: [S, Hkv, L, D]; valid: [S, L] -> [S, Hkv, C, D]: the token farthest from the span's mean,
    then repeatedly the token farthest from those already taken (every token when C >= |S|)."""
    S, Hkv, L, D = x.shape
    mask = valid[:, None, :]  # [S, 1, L]
    mean = (x * mask[..., None]).sum(2, keepdim=True) / mask.sum(-1, keepdim=True)[..., None]
    score = torch.cdist(x, mean).squeeze(-1)  # [S, Hkv, L]: distance to the mean, then to the nearest pick
    nearest = torch.full_like(score, float("inf"))
    picks = []
    for _ in range(C):
        pick = score.masked_fill(~mask, -1.0).argmax(dim=-1)  # [S, Hkv]
        picks.append(torch.gather(x, 2, pick[..., None, None].expand(S, Hkv, 1, D)))
        nearest = torch.minimum(nearest, torch.cdist(x, picks[-1]).squeeze(-1))
        score = nearest
    return torch.cat(picks, dim=2)
