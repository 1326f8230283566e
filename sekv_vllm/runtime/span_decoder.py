"""SeKV's decode attention over the spans of the compressed requests decoding together (torch only).

Each request gets its own mixed attention, whatever else decodes with it (bit for bit). The C++
kernel (`ops.span_decode`) does scoring, zoom and attention in one call; the torch path (its
reference) scores with `ZoomPolicy.span_scores`, zooms with `segment_budgeted_zoom`, spends the
zoom rows whole spans leave over on single keys (`segment_key_recall`, where every key is a scoring
centroid) and attends the tokens read through their spans' factors (`batched_mixed_attention`). A
batch's per-request inputs (`BatchSpans`) are gathered once per layer and reused while its requests
stay the same (continuous batching changes them only when one joins or ends).
"""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from types import ModuleType

import torch

from sekv_vllm.core import LayerSpanMemory, SpanKeys, concat_span_keys
from sekv_vllm.core.batched_attention import batched_mixed_attention
from sekv_vllm.core.low_rank import SpanBases, span_factors
from sekv_vllm.policies import ZoomPolicy, segment_budgeted_zoom, segment_key_recall
from sekv_vllm.policies.exact_fallback import segment_read_coverage
from sekv_vllm.pool import HostPool
from sekv_vllm.runtime.paged_rows import PagedRows
from sekv_vllm.runtime.request_state import RequestMemory

_NO_FEATURES = torch.zeros(0, dtype=torch.float16)
_NO_CODES = torch.zeros(0, dtype=torch.float16)
_NO_RANGES = torch.zeros(0, dtype=torch.int64)
_NO_QUERY_FEATURES = torch.zeros(0, 0, 0)
_NO_NEW_ROWS = torch.zeros(0)
_ROWS = torch.zeros(0)


def _basis(bases: SpanBases) -> torch.Tensor:
    """The kernel's basis argument: empty when the bases hold the rows themselves."""
    return bases.basis if bases.factored else _ROWS


@dataclass(frozen=True)
class DecodedLayer:
    """One layer's decode attention of a batch and what it read, per request: out [B, H, D] float32;
    zoomed [B] int64 the spans some KV head read whole; recalled [B] int64 the single keys read (summed
    over KV heads); exact [B] int64 the KV heads that read every row (exact fallback)."""

    out: torch.Tensor
    zoomed: torch.Tensor
    recalled: torch.Tensor
    exact: torch.Tensor


@dataclass
class BatchSpans:
    """The spans of one layer of the requests decoding together, one request after another.

    layers: each request's compressed layer; features: each request's `key_features` (a
    placeholder where it has none); seg [S] the request (batch position) of each span; budgets [B] zoom
    rows per KV head, whole_budgets [B] the most of them whole spans take, min_shares [B] float32 the least
    share of its request's span scores a span zoomed whole has (`segment_budgeted_zoom`); fallbacks [B] float32
    the coverage below which a KV head reads every row (`segment_read_coverage`; 0: never); zoom_all [B] bool; per_key [S]
    bool: the span's keys may be recalled one by one (its request recalls keys, does not zoom every span,
    and its scoring centroids are its keys). `keys` and `summary_v` [S, Hkv, D] concatenate the requests'
    spans (the torch path's inputs), `kernel_spans` and `kernel_bases` list them (the C++ kernel's); each is
    made on first use.
    """

    req_ids: tuple[str, ...]
    layers: tuple[LayerSpanMemory, ...]
    features: tuple[torch.Tensor, ...]
    seg: torch.Tensor
    budgets: torch.Tensor
    whole_budgets: torch.Tensor
    min_shares: torch.Tensor
    fallbacks: torch.Tensor
    zoom_all: torch.Tensor
    per_key: torch.Tensor
    span_offset: list[int]

    @functools.cached_property
    def keys(self) -> SpanKeys:
        return concat_span_keys([m.keys for m in self.layers])

    @functools.cached_property
    def summary_v(self) -> torch.Tensor:
        return torch.cat([m.summary_v for m in self.layers])

    @functools.cached_property
    def kernel_spans(self) -> dict[str, list[torch.Tensor] | int]:
        """The C++ kernel's per-request span inputs, by argument name: centroid_k holds the codes where keys
        are quantized (centroid_lo, centroid_step, centroid_range then, empty lists otherwise), code_bits their
        bits; log_count is empty where the counts are implied (every centroid one key)."""
        m = self.layers
        codes = [x.keys.codes for x in m]
        bits = max((c.bits for c in codes if c is not None), default=0)
        return {
            "summary_k": [x.keys.summary_k for x in m], "summary_v": [x.summary_v for x in m],
            "span_len": [x.keys.span_len for x in m],
            "centroid_k": [x.keys.centroid_k if c is None else c.codes for x, c in zip(m, codes)],
            "log_count": [_NO_CODES if x.keys.stored_log_count is None else x.keys.stored_log_count for x in m],
            "centroid_lo": [_NO_CODES if c is None else c.lo for c in codes] if bits else [],
            "centroid_step": [_NO_CODES if c is None else c.step for c in codes] if bits else [],
            "centroid_range": [_NO_RANGES if c is None else c.range_of for c in codes] if bits else [],
            "code_bits": bits,
        }

    @functools.cached_property
    def kernel_bases(self) -> dict[str, list[torch.Tensor]]:
        """The C++ kernel's per-request host-pool inputs, by argument name."""
        m = self.layers
        return {"coef_k": [x.bases_k.coef for x in m], "basis_k": [_basis(x.bases_k) for x in m],
                "coef_v": [x.bases_v.coef for x in m], "basis_v": [_basis(x.bases_v) for x in m],
                "row_offset": [x.bases_k.row_offset for x in m]}


class SpanDecoder:
    """The batch's spans per layer (cached) and their attention; max_span pads the torch path's factors;
    recall_keys: spend the zoom rows whole spans leave over on single keys (`SeKVConfig.recall_keys`), of which
    whole spans take at most whole_span_share where keys are recalled (`SeKVConfig.whole_span_share`), and only
    spans holding whole_span_min_share of their request's span scores (`SeKVConfig.whole_span_min_share`), and a
    KV head reads every row where its rows read hold less than exact_fallback_coverage of a query head's attention
    (`SeKVConfig.exact_fallback_coverage`)."""

    def __init__(self, policy: ZoomPolicy, pool: HostPool[LayerSpanMemory], max_span: int, recall_keys: bool,
                 whole_span_share: float, whole_span_min_share: float, exact_fallback_coverage: float) -> None:
        self.policy = policy
        self.pool = pool
        self.max_span = max_span
        self.recall_keys = recall_keys
        self.whole_span_share = whole_span_share
        self.whole_span_min_share = whole_span_min_share
        self.exact_fallback_coverage = exact_fallback_coverage
        # Per layer, the spans of the last batch that decoded.
        self._cache: dict[str, BatchSpans] = {}

    def forget(self, req_id: str) -> None:
        """A request's spans changed or it ended: batches holding it are gathered again."""
        self._cache = {name: b for name, b in self._cache.items() if req_id not in b.req_ids}

    def clear(self) -> None:
        self._cache.clear()

    def batch(self, mems: list[RequestMemory], layer_name: str) -> BatchSpans:
        """The spans of one layer of these requests (made once while the batch is unchanged)."""
        req_ids = [m.req_id for m in mems]
        key = tuple(req_ids)
        cached = self._cache.get(layer_name)
        if cached is not None and cached.req_ids == key:
            return cached
        layers = tuple(self.pool.load(r, layer_name) for r in req_ids)
        counts = [m.keys.num_spans for m in layers]
        # a request that zooms every span is never scored: no features, a placeholder
        features = tuple(m.key_features.get(layer_name, _NO_FEATURES) for m in mems)
        recalls = [self.recall_keys and not mem.zoom_all and m.keys.every_key_a_centroid
                   for mem, m in zip(mems, layers)]
        batch = BatchSpans(
            req_ids=key,
            layers=layers,
            features=features,
            seg=torch.repeat_interleave(torch.arange(len(req_ids)), torch.tensor(counts, dtype=torch.int64)),
            budgets=torch.tensor([m.zoom_budget for m in mems], dtype=torch.int64),
            whole_budgets=torch.tensor([int(m.zoom_budget * self.whole_span_share) if r else m.zoom_budget
                                        for m, r in zip(mems, recalls)], dtype=torch.int64),
            min_shares=torch.tensor([self.whole_span_min_share if r else 0.0 for r in recalls], dtype=torch.float32),
            fallbacks=torch.tensor([self._fallback(m) if r else 0.0 for m, r in zip(mems, recalls)],
                                   dtype=torch.float32),
            zoom_all=torch.tensor([m.zoom_all for m in mems], dtype=torch.bool),
            per_key=torch.repeat_interleave(torch.tensor(recalls), torch.tensor(counts, dtype=torch.int64)),
            span_offset=[0, *itertools.accumulate(counts)][:-1],
        )
        self._cache[layer_name] = batch
        return batch

    def _fallback(self, mem: RequestMemory) -> float:
        """The request's exact-fallback coverage: its own (`sekv_exact_fallback_coverage`) or the deployment's."""
        return self.exact_fallback_coverage if mem.exact_fallback_coverage is None else mem.exact_fallback_coverage

    def attend_kernel(self, kernel: ModuleType, batch: BatchSpans, layer: int, q: torch.Tensor, rows: list[PagedRows],
                      new_k: torch.Tensor | None, new_v: torch.Tensor | None, scale: float) -> DecodedLayer:
        """The C++ kernel: q [B, H, D], each request's rows (room made for new_k, new_v [B, Hkv, D], which
        it writes in place) -> out [B, H, D] float32 and what each request read."""
        terms = self.policy.query_terms(layer, q, scale)
        learned = terms.features is not None
        out, zoomed, recalled, exact = kernel.span_decode(
            q=q.float().contiguous(), row_pages=[b.pages for b in rows], page_table=[b.table for b in rows],
            num_full=torch.tensor([b.length for b in rows], dtype=torch.int64),
            new_k=_NO_NEW_ROWS if new_k is None else new_k.float().contiguous(),
            new_v=_NO_NEW_ROWS if new_v is None else new_v.float().contiguous(),
            **batch.kernel_spans, **batch.kernel_bases,
            key_features=list(batch.features) if learned else [], budgets=batch.budgets,
            whole_budgets=batch.whole_budgets, min_shares=batch.min_shares, fallbacks=batch.fallbacks,
            zoom_all=batch.zoom_all, recall_keys=self.recall_keys,
            query_features=terms.features if learned else _NO_QUERY_FEATURES, bias=terms.bias,
            threshold=terms.threshold, scale=scale, score_scale=terms.score_scale,
        )
        return DecodedLayer(out, zoomed, recalled, exact)

    def attend_torch(self, batch: BatchSpans, layer: int, q: torch.Tensor,
                     full: list[tuple[torch.Tensor, torch.Tensor]], scale: float) -> DecodedLayer:
        """The torch path (the kernel's reference): full [B] (k, v) [n, Hkv, D] each request's rows."""
        keys = batch.keys
        score, eligible = self.policy.span_scores(layer, q, batch.seg, keys, scale)
        Hkv, D = keys.summary_k.shape[1:]
        B = len(batch.req_ids)
        zoom = segment_budgeted_zoom(score, batch.seg, keys.span_len, batch.whole_budgets, Hkv, eligible,
                                     batch.min_shares)
        zoom |= batch.zoom_all[batch.seg][:, None]
        whole = zoom.view(zoom.shape[0], Hkv, -1)[:, :, 0]  # [S, Hkv]
        L = self.max_span
        span_tokens = torch.arange(L, device=q.device)[None, :] < keys.span_len[:, None]  # [S, L]
        read = whole[..., None] & span_tokens[:, None, :]  # [S, Hkv, L]
        keys_read = torch.zeros(0, Hkv, 1, dtype=torch.bool, device=q.device)
        if bool(batch.per_key.any()):
            key_score = self.policy.key_scores(layer, q, batch.seg, keys, score, scale)
            keys_read = segment_key_recall(key_score, batch.seg, keys.span_len, zoom, batch.budgets, Hkv, eligible,
                                           batch.per_key)
            read |= torch.nn.functional.pad(keys_read, (0, max(L - keys_read.shape[2], 0)))[..., :L]
        exact = self._exact_heads(batch, q, full, read, scale)  # [B, Hkv]
        if bool(exact.any()):  # only requests that recall keys fall back: keys_read is [S, Hkv, C] then
            every = exact[batch.seg]  # [S, Hkv]
            whole = whole | every
            read |= every[..., None] & span_tokens[:, None, :]
            keys_read = keys_read & ~every[..., None]
        recalled = torch.zeros(B, dtype=torch.int64, device=q.device)
        if keys_read.numel():
            recalled.index_add_(0, batch.seg, keys_read.sum(dim=(1, 2)))
        summary_count = keys.span_len[:, None] - read.sum(dim=2)  # [S, Hkv]
        # The factors of every (span, KV head) pair with tokens read; no row is rebuilt: the attention works
        # on them (`batched_mixed_attention`).
        pair_span, pair_head = torch.nonzero(read.any(dim=2), as_tuple=True)
        pair_req = batch.seg[pair_span]
        parts = []
        for i in torch.unique(pair_req).tolist():
            mine = pair_req == i
            parts.append((batch.layers[i], pair_span[mine] - batch.span_offset[i], pair_head[mine]))
        if parts:
            # Padded to the largest possible span and rank (D: bases kept as rows are the
            # coefficients of the identity basis), not this batch's: a request's result then does
            # not depend on which others decode with it.
            coef_k, basis_k = (torch.cat(t) for t in zip(*(span_factors(m.bases_k, s_, h, L, D) for m, s_, h in parts)))
            coef_v, basis_v = (torch.cat(t) for t in zip(*(span_factors(m.bases_v, s_, h, L, D) for m, s_, h in parts)))
        else:
            coef_k = coef_v = torch.zeros(0, L, 1)
            basis_k = basis_v = torch.zeros(0, 1, D)
        out = batched_mixed_attention(
            q, [k for k, _ in full], [v for _, v in full], keys.summary_k, batch.summary_v, batch.seg, summary_count,
            pair_span, pair_head, coef_k, basis_k, coef_v, basis_v, read[pair_span, pair_head], scale,
        )
        zoomed = torch.zeros(B, dtype=torch.int64, device=q.device).index_add_(0, batch.seg, whole.any(dim=1).long())
        return DecodedLayer(out, zoomed, recalled, exact.sum(dim=1))

    def _exact_heads(self, batch: BatchSpans, q: torch.Tensor, full: list[tuple[torch.Tensor, torch.Tensor]],
                     read: torch.Tensor, scale: float) -> torch.Tensor:
        """[B, Hkv] bool: the KV heads whose rows read (read [S, Hkv, L]) hold less than their request's
        fallback share of a query head's estimated attention (`segment_read_coverage`)."""
        B, Hkv = len(batch.req_ids), read.shape[1]
        if not bool((batch.fallbacks > 0).any()):
            return torch.zeros(B, Hkv, dtype=torch.bool, device=q.device)
        keys = batch.keys
        key_logits = keys.centroid_logits_rows(q[batch.seg], self.policy.centroid_scale(scale))  # [S, H, C]
        G = q.shape[1] // Hkv
        full_lse = torch.stack([
            torch.logsumexp(torch.einsum("hd,nhd->hn", q[i].float(), k.float().repeat_interleave(G, dim=1)) * scale,
                            dim=1) for i, (k, _) in enumerate(full)])
        cover = segment_read_coverage(key_logits, batch.seg, read[..., :key_logits.shape[2]], full_lse, Hkv)
        return cover < batch.fallbacks[:, None]
