"""The compressed prompt memory of one layer: summaries and scoring keys (fast tier) and low-rank
bases (host pool)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from sekv_vllm.core.low_rank import (
    Eigh, SpanBases, append_span_bases, as_rows, fit_span_bases, gate_bases, gated_span_rows, rebuild_spans_of,
    rows_if_smaller, singular_values, span_rows,
)
from sekv_vllm.core.mixed_attention import mixed_attention
from sekv_vllm.core.segmentation import SpanLayout
from sekv_vllm.core.span_keys import SpanKeys, append_span_keys, span_keys
from sekv_vllm.core.span_summary import summarize_spans


@dataclass(frozen=True)
class LayerSpanMemory:
    """keys: summary keys, span lengths and scoring centroids; summary_v: [S, Hkv, D]; bases for
    keys and values."""

    keys: SpanKeys
    summary_v: torch.Tensor
    bases_k: SpanBases
    bases_v: SpanBases

    @property
    def summary_k(self) -> torch.Tensor:
        return self.keys.summary_k

    @property
    def span_len(self) -> torch.Tensor:
        return self.keys.span_len

    @property
    def fast_tier_nbytes(self) -> int:
        """Summary rows (K and V) and scoring centroids."""
        return 2 * self.summary_k.numel() * self.summary_k.element_size() + self.keys.centroid_nbytes

    @property
    def bases_nbytes(self) -> int:
        return self.bases_k.nbytes + self.bases_v.nbytes


KeyGates = Callable[[torch.Tensor, torch.Tensor], "torch.Tensor | None"]


def compress_layer(
    k: torch.Tensor, v: torch.Tensor, layout: SpanLayout, surprisal: torch.Tensor, r_max: int,
    score_centroids: int = 0, score_bits: int = 16, key_gates: KeyGates | None = None,
    store_rows: bool | None = None, score_range_spans: int = 1, eigh: Eigh = torch.linalg.eigh,
    summary_dtype: torch.dtype | None = None,
) -> LayerSpanMemory:
    """k, v: [T, Hkv, D] prompt keys (post-RoPE) and values; surprisal: [T] float.
    score_centroids: key centroids per span for zoom scoring (0: the summary key alone), kept at
    score_bits bits per element (16: float16), one quantization range per score_range_spans spans.
    store_rows: the host pool keeps the spans' rows (True) or their factors (False); None: whichever
    takes fewer bytes.

    key_gates(singular [S, Hkv, R], summary_k [S, Hkv, D]) -> g [S, Hkv, R]: reconstruction
    gates of the keys (the trained router's), folded into the stored coefficients.
    eigh: the eigensolver of the spans' Gram matrices (`torch.linalg.eigh` or `ops.small_eigh`).
    summary_dtype: the summary rows' dtype (None: k's); the gates and scoring keys see the stored summaries.
    """
    summary_k = summarize_spans(k, surprisal, layout.span_start, layout.span_len).to(summary_dtype or k.dtype)
    summary_v = summarize_spans(v, surprisal, layout.span_start, layout.span_len).to(summary_dtype or v.dtype)
    form = rows_if_smaller if store_rows is None else (as_rows if store_rows else lambda b: b)
    # At r_max >= every span's length the factors rebuild the rows exactly and take more bytes than
    # they do: the rows are kept as they are (no decomposition) unless factors were asked for.
    exact = layout.num_spans == 0 or r_max >= int(layout.span_len.max())
    as_is = exact and store_rows is not False

    def bases_of(x: torch.Tensor) -> SpanBases:
        return span_rows(x, layout.span_start, layout.span_len) if as_is else form(
            fit_span_bases(x, layout.span_start, layout.span_len, r_max, eigh))

    bases_k = None
    if key_gates is not None and layout.num_spans and as_is:
        bases_k = gated_span_rows(k, layout.span_start, layout.span_len, lambda s: key_gates(s, summary_k), eigh)
    elif key_gates is not None and layout.num_spans:  # factors: gated where the policy has gates
        fitted = fit_span_bases(k, layout.span_start, layout.span_len, r_max, eigh)
        gates = key_gates(singular_values(fitted), summary_k)
        bases_k = form(fitted if gates is None else gate_bases(fitted, gates))
    if bases_k is None:
        bases_k = bases_of(k)
    return LayerSpanMemory(
        span_keys(k, summary_k, layout.span_start, layout.span_len, score_centroids, score_bits, score_range_spans),
        summary_v, bases_k, bases_of(v),
    )


def append_spans(memory: LayerSpanMemory, more: LayerSpanMemory) -> LayerSpanMemory:
    """memory's spans, then more's (compressed the same way: `compress_layer` with the same
    centroids, bits and `store_rows=not memory.bases_k.factored`)."""
    return LayerSpanMemory(
        append_span_keys(memory.keys, more.keys),
        torch.cat([memory.summary_v, more.summary_v]),
        append_span_bases(memory.bases_k, more.bases_k),
        append_span_bases(memory.bases_v, more.bases_v),
    )


def attend_memory(
    q: torch.Tensor,
    full_k: torch.Tensor,
    full_v: torch.Tensor,
    memory: LayerSpanMemory,
    zoom: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Rebuild the spans any head zoomed into and attend everything in one softmax.

    q: [H, D]; full_k, full_v: [N, Hkv, D]; zoom: [H, S] bool; returns [H, D] float32
    """
    span_ids = torch.nonzero(zoom.any(dim=0)).flatten()
    (zoom_k, zoom_v), zoom_span = rebuild_spans_of(span_ids, memory.bases_k, memory.bases_v)
    return mixed_attention(
        q, full_k, full_v, memory.summary_k, memory.summary_v, memory.span_len,
        zoom, zoom_k, zoom_v, zoom_span, scale,
    )
