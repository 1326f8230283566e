"""A request's state in the runtime, and what spanifying its window returns (torch only)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from sekv_vllm.core import SpanLayout
from sekv_vllm.methods import SEKV
from sekv_vllm.runtime.figures import CompressionFigures
from sekv_vllm.runtime.paged_rows import RowPages
from sekv_vllm.runtime.row_buffer import RowBuffer


class Status(enum.Enum):
    PREFILLING = "prefilling"  # surprisal is being collected; compressed once the prompt is done
    COMPRESSED = "compressed"
    FULL_KV = "full_kv"  # kept at full KV; `reason` says why


@dataclass
class RequestMemory:
    req_id: str
    prompt_len: int
    budget: int
    status: Status
    reason: str = ""
    method: str = SEKV  # `sekv` (spans) or a row-keeping method's name
    kv_bits: int | None = None  # the request's `sekv_kv_bits` (None: its method's setting)
    exact_fallback_coverage: float | None = None  # the request's `sekv_exact_fallback_coverage` (None: SeKV's setting)
    surprisal: torch.Tensor | None = None  # [>= T] float32 by position, s_0 = 0 (output tokens' too, once known)
    layout: SpanLayout | None = None
    zoom_budget: int = 0
    # The budget covers every span at token resolution: no choice to make, every span is
    # rebuilt exactly (no gates) and the policy is not asked.
    zoom_all: bool = False
    # SeKV's plan: scoring centroids kept per span, what a span holds in the fast tier (rows' worth of bytes) and
    # what it is priced at where a layout is fitted to its share (`SpanPlan.layout_span_rows`).
    score_centroids: int = 0
    span_rows: float = 1.0
    layout_span_rows: float = 1.0
    # PREFILLING: every computed row by position, per layer.
    captured: dict[str, RowBuffer] = field(default_factory=dict)
    # PREFILLING, for a method that reads them: the prompt's last queries [W, H, D] by layer.
    queries: dict[str, torch.Tensor] = field(default_factory=dict)
    # PREFILLING, for a method that reads it: per layer [Hkv, T] the attention each prompt row received so far.
    prompt_attention: dict[str, torch.Tensor] = field(default_factory=dict)
    # COMPRESSED: full-resolution rows only (anchors and short runs, then the window: the last prompt
    # rows and the output not spanified, in position order), per layer; in the engine's pages once
    # it hands them over (`place_rows`), else in pages of their own.
    rows: dict[str, RowPages] = field(default_factory=dict)
    # Per layer, the policy's span-side score features (`ZoomPolicy.key_features`), if it has any.
    key_features: dict[str, torch.Tensor] = field(default_factory=dict)
    # COMPRESSED: the position of the next row the runtime will keep (prompt and the output
    # processed so far); rows before it that a recompute computes again are not needed.
    next_position: int = 0
    # COMPRESSED: rows[:window_row] are fixed rows (anchors and short runs of the prompt and of
    # spanified output); from window_row on, the full-resolution window, starting at position window_pos.
    window_row: int = 0
    window_pos: int = 0
    # COMPRESSED: the window is not spanified again before this position (after a full host pool).
    spanify_from: int = 0
    output_spans: int = 0
    output_span_tokens: int = 0
    output_fixed_tokens: int = 0
    output_fast_tier_bytes: int = 0
    # COMPRESSED and preempted: state kept for the recompute that resumes it (`suspend`).
    suspended: bool = False
    decode_calls: int = 0
    zoomed_spans_total: int = 0
    recalled_keys_total: int = 0
    exact_heads_total: int = 0
    figures: CompressionFigures | None = None
    # COMPRESSED: the state a method other than SeKV keeps for the request (e.g. quest's `SelectedPages`).
    method_state: object | None = None


@dataclass(frozen=True)
class SpanifiedRows:
    """Window rows of a compressed request segmented and compressed during decoding.

    start, stop: their positions [start, stop); fast_tier_bytes: what they still take in the fast
    tier (full-resolution anchors and short runs, summaries, scoring keys, the zoom rows they add).
    """

    start: int
    stop: int
    spans: int
    fast_tier_bytes: int


def reserve_surprisal(mem: RequestMemory, n: int) -> None:
    """Room for the surprisal of positions [0, n) (zeros where none was recorded)."""
    if n > mem.surprisal.numel():
        grown = torch.zeros(max(n, 2 * mem.surprisal.numel()), dtype=torch.float32)
        grown[: mem.surprisal.numel()] = mem.surprisal
        mem.surprisal = grown


def running_figures(mem: RequestMemory, num_layers: int, host_pool_bytes_now: int) -> dict:
    """A compressed request's figures at compression (`mem.figures`) and since: decode, output spanified."""
    first = next(iter(mem.rows.values()))
    return dict(
        mem.figures.as_dict(),
        decode_steps=mem.decode_calls // max(num_layers, 1),
        mean_zoomed_spans=mem.zoomed_spans_total / max(mem.decode_calls, 1),
        # single keys read per layer and step, over the KV heads (SeKV's zoom rows whole spans leave over)
        mean_recalled_keys=mem.recalled_keys_total / max(mem.decode_calls, 1),
        # KV heads per layer and step that read every row (SeKV's exact fallback)
        mean_exact_heads=mem.exact_heads_total / max(mem.decode_calls, 1),
        output_spans=mem.output_spans,
        output_span_tokens=mem.output_span_tokens,
        output_anchor_and_short_tokens=mem.output_fixed_tokens,
        # mean surprisal of the output tokens spanified so far (nats)
        output_mean_surprisal=float(mem.surprisal[mem.prompt_len : mem.window_pos].mean())
        if mem.window_pos > mem.prompt_len else 0.0,
        output_fast_tier_bytes=mem.output_fast_tier_bytes,
        full_resolution_rows=first.length,
        rows_in_vllm_pages=not first.own,
        host_pool_bytes_now=host_pool_bytes_now,
    )
