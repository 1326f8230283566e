"""SeKV's decode attention over the spans of the compressed requests decoding together (torch only).

Each request gets its own mixed attention, whatever else decodes with it (bit for bit). The C++
kernel (`ops.span_decode`) does scoring, zoom and attention in one call; the torch path (its
reference) scores with `ZoomPolicy.span_scores`, zooms with `segment_budgeted_zoom` and attends
zoomed spans through their factors (`batched_mixed_attention`). A batch's per-request inputs
(`BatchSpans`) are gathered once per layer and reused while its requests stay the same
(continuous batching changes them only when one joins or ends).
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
from sekv_vllm.policies import ZoomPolicy, segment_budgeted_zoom
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


@dataclass
class BatchSpans:
    """The spans of one layer of the requests decoding together, one request after another.

    layers: each request's compressed layer; features: each request's `key_features` (a
    placeholder where it has none); seg [S] the request (batch position) of each span; budgets [B] zoom rows per
    KV head; zoom_all [B] bool. `keys` and `summary_v` [S, Hkv, D] concatenate the requests' spans
    (the torch path's inputs), `kernel_spans` and `kernel_bases` list them (the C++ kernel's); each
    is made on first use.
    """

    req_ids: tuple[str, ...]
    layers: tuple[LayerSpanMemory, ...]
    features: tuple[torch.Tensor, ...]
    seg: torch.Tensor
    budgets: torch.Tensor
    zoom_all: torch.Tensor
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
    """The batch's spans per layer (cached) and their attention; max_span pads the torch path's factors."""

    def __init__(self, policy: ZoomPolicy, pool: HostPool[LayerSpanMemory], max_span: int) -> None:
        self.policy = policy
        self.pool = pool
        self.max_span = max_span
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
        batch = BatchSpans(
            req_ids=key,
            layers=layers,
            features=features,
            seg=torch.repeat_interleave(torch.arange(len(req_ids)), torch.tensor(counts, dtype=torch.int64)),
            budgets=torch.tensor([m.zoom_budget for m in mems], dtype=torch.int64),
            zoom_all=torch.tensor([m.zoom_all for m in mems], dtype=torch.bool),
            span_offset=[0, *itertools.accumulate(counts)][:-1],
        )
        self._cache[layer_name] = batch
        return batch

    def attend_kernel(self, kernel: ModuleType, batch: BatchSpans, layer: int, q: torch.Tensor, rows: list[PagedRows],
                      new_k: torch.Tensor | None, new_v: torch.Tensor | None, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The C++ kernel: q [B, H, D], each request's rows (room made for new_k, new_v [B, Hkv, D], which
        it writes in place) -> (out [B, H, D] float32, zoomed spans [B] int64)."""
        terms = self.policy.query_terms(layer, q, scale)
        learned = terms.features is not None
        return kernel.span_decode(
            q=q.float().contiguous(), row_pages=[b.pages for b in rows], page_table=[b.table for b in rows],
            num_full=torch.tensor([b.length for b in rows], dtype=torch.int64),
            new_k=_NO_NEW_ROWS if new_k is None else new_k.float().contiguous(),
            new_v=_NO_NEW_ROWS if new_v is None else new_v.float().contiguous(),
            **batch.kernel_spans, **batch.kernel_bases,
            key_features=list(batch.features) if learned else [], budgets=batch.budgets, zoom_all=batch.zoom_all,
            query_features=terms.features if learned else _NO_QUERY_FEATURES, bias=terms.bias,
            threshold=terms.threshold, scale=scale, score_scale=terms.score_scale,
        )

    def attend_torch(self, batch: BatchSpans, layer: int, q: torch.Tensor,
                     full: list[tuple[torch.Tensor, torch.Tensor]], scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The torch path (the kernel's reference): full [B] (k, v) [n, Hkv, D] each request's rows ->
        (out [B, H, D] float32, zoom [S, Hkv] bool)."""
        score, eligible = self.policy.span_scores(layer, q, batch.seg, batch.keys, scale)
        Hkv, D = batch.keys.summary_k.shape[1:]
        zoom = segment_budgeted_zoom(score, batch.seg, batch.keys.span_len, batch.budgets, Hkv, eligible)
        zoom |= batch.zoom_all[batch.seg][:, None]
        # The factors of every zoomed (span, KV head) pair; no row is rebuilt: the attention works
        # on them (`batched_mixed_attention`).
        pair_span, pair_head = torch.nonzero(zoom.view(zoom.shape[0], Hkv, -1).any(dim=2), as_tuple=True)
        pair_req = batch.seg[pair_span]
        parts = []
        for i in torch.unique(pair_req).tolist():
            mine = pair_req == i
            parts.append((batch.layers[i], pair_span[mine] - batch.span_offset[i], pair_head[mine]))
        if parts:
            # Padded to the largest possible span and rank (D: bases kept as rows are the
            # coefficients of the identity basis), not this batch's: a request's result then does
            # not depend on which others decode with it.
            L, R = self.max_span, D
            coef_k, basis_k = (torch.cat(t) for t in zip(*(span_factors(m.bases_k, s_, h, L, R) for m, s_, h in parts)))
            coef_v, basis_v = (torch.cat(t) for t in zip(*(span_factors(m.bases_v, s_, h, L, R) for m, s_, h in parts)))
        else:
            coef_k = coef_v = torch.zeros(0, 1, 1)
            basis_k = basis_v = torch.zeros(0, 1, D)
        out = batched_mixed_attention(
            q, [k for k, _ in full], [v for _, v in full], batch.keys.summary_k, batch.summary_v,
            batch.keys.span_len, batch.seg, zoom, pair_span, pair_head, coef_k, basis_k, coef_v, basis_v, scale,
        )
        return out, zoom.view(zoom.shape[0], Hkv, -1)[:, :, 0]
