"""SeKV's compression of a request, one path for its prompt and for its window as the output grows
(torch only).

A stretch of rows (the prompt once it is prefilled; later the oldest rows of the window) is segmented
by its tokens' surprisal into anchors and short runs, kept at full resolution, and spans, whose
summaries and scoring keys go to the fast tier and whose rows or factors go to the host pool.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from sekv_vllm.config import SeKVConfig
from sekv_vllm.core import LayerSpanMemory, SpanLayout, append_spans, compress_layer, segment_prompt, surprisal_threshold
from sekv_vllm.core.low_rank import Eigh
from sekv_vllm.runtime.span_budget import SpanCosts, SpanPlan, plan_layout, summary_dtype
from sekv_vllm.methods import SEKV
from sekv_vllm.policies import ZoomPolicy
from sekv_vllm.pool import HostPool
from sekv_vllm.runtime.figures import CompressionFigures
from sekv_vllm.runtime.paged_rows import PagedRows
from sekv_vllm.runtime.request_state import RequestMemory, SpanifiedRows, Status, reserve_surprisal

logger = logging.getLogger("sekv_vllm")


class SpanCompression:
    """Compresses the requests of one worker into spans. layer_names in model order (the policy's layer
    index is the position in this list); rows kept at full resolution go into pages of `block` rows."""

    def __init__(self, config: SeKVConfig, layer_names: list[str], policy: ZoomPolicy, pool: HostPool,
                 block: int, eigh: Eigh = torch.linalg.eigh) -> None:
        self.config, self.layer_names, self.policy, self.pool, self.block = config, layer_names, policy, pool, block
        self.eigh = eigh  # the spans' eigensolver (the router's key gates): torch's or the C++ kernel
        # the policy's span features, per span and layer on average (what the budget plan prices)
        self.feature_bytes = sum(policy.span_feature_nbytes(i) for i in range(len(layer_names))) / len(layer_names)

    def _compress_layers(self, mem: RequestMemory, rows: dict[str, tuple[torch.Tensor, torch.Tensor]],
                         layout: SpanLayout, surprisal: torch.Tensor, store_rows: bool | None
                         ) -> dict[str, LayerSpanMemory]:
        """Every layer's stretch rows (k, v [n, Hkv, D]) under one layout: the same spans in every layer."""
        cfg = self.config
        # the spans' keys are decomposed only for gates that change them
        gated = self.policy.has_key_gates and cfg.key_gate_strength > 0 and not mem.zoom_all
        return {name: compress_layer(k, v, layout, surprisal, cfg.r_max,
                                     0 if mem.zoom_all else mem.score_centroids, cfg.score_bits,
                                     self._key_gates(i) if gated else None,
                                     store_rows=store_rows, score_range_spans=cfg.score_range_spans, eigh=self.eigh,
                                     summary_dtype=summary_dtype(cfg, k.dtype))
                for i, (name, (k, v)) in enumerate(rows.items())}

    def _key_gates(self, layer: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor | None]:
        """The policy's key gates of `layer`, moved toward 1 (no gate) by 1 - key_gate_strength."""
        strength = self.config.key_gate_strength

        def gates(singular: torch.Tensor, summary_k: torch.Tensor) -> torch.Tensor | None:
            g = self.policy.key_gates(layer, singular, summary_k)
            return g if g is None or strength == 1 else 1 - strength * (1 - g)
        return gates

    def _key_features(self, mem: RequestMemory, memories: dict[str, LayerSpanMemory]) -> int:
        """The policy's features of every span (`ZoomPolicy.key_features`); returns the bytes they added."""
        added = 0
        for i, (name, memory) in enumerate(memories.items()):
            old, feats = mem.key_features.get(name), self.policy.key_features(i, memory.keys)
            if feats is not None:
                mem.key_features[name] = feats
                added += (feats.numel() - (old.numel() if old is not None else 0)) * feats.element_size()
        return added

    def _keep_rows(self, mem: RequestMemory, rows: dict[str, tuple[torch.Tensor, torch.Tensor]], keep: torch.Tensor,
                   spare: int) -> None:
        for name, (k, v) in rows.items():
            mem.rows[name] = PagedRows.of_rows(k[keep], v[keep], self.block, spare=spare)

    def costs(self, k: torch.Tensor) -> SpanCosts:
        """What SeKV's parts cost per layer for rows like k [n, Hkv, D] (the KV dtype)."""
        _, Hkv, D = k.shape
        return SpanCosts.of_rows(Hkv, D, k.element_size(), self.feature_bytes, summary_dtype(self.config, k.dtype).itemsize)

    def compress_prompt(self, mem: RequestMemory) -> str:
        """Compress a prefilled prompt from its captured rows; "" when done, else why it keeps full KV."""
        cfg, T = self.config, mem.prompt_len
        plan = plan_layout(mem.surprisal[:T], mem.budget, cfg, self.costs(mem.captured[self.layer_names[0]].view()[0]))
        layout, zoom_budget = plan.layout, plan.zoom_budget
        if layout.num_spans == 0:
            return "no span of at least l_min tokens outside the window"
        mem.zoom_all, mem.score_centroids = plan.zoom_all, plan.centroids
        mem.span_rows, mem.layout_span_rows = plan.span_rows, plan.layout_span_rows
        captured = {name: mem.captured[name].view() for name in self.layer_names}
        memories = self._compress_layers(mem, {n: (k[:T], v[:T]) for n, (k, v) in captured.items()}, layout,
                                         mem.surprisal[:T], None)
        for name, memory in memories.items():
            if not self.pool.store(mem.req_id, name, memory, memory.bases_nbytes):
                self.pool.release(mem.req_id)
                logger.warning("sekv: host pool full (%d of %d bytes used): request %s keeps full KV",
                               self.pool.used_bytes, self.pool.capacity_bytes, mem.req_id)
                return "host pool full"
        # Rows past the prompt (a resumed request's earlier output) stay as window rows.
        mem.next_position = mem.captured[self.layer_names[0]].length
        keep = torch.cat([layout.fixed_pos, torch.arange(layout.window_start, mem.next_position)])
        self._keep_rows(mem, captured, keep, spare=cfg.window + cfg.window_growth)
        mem.captured = {}
        features_bytes = 0 if mem.zoom_all else self._key_features(mem, memories)
        mem.layout, mem.zoom_budget = layout, zoom_budget
        mem.window_row, mem.window_pos = int(layout.fixed_pos.numel()), layout.window_start
        mem.status = Status.COMPRESSED
        mem.figures = self._prompt_figures(mem, plan, memories, features_bytes)
        if plan.fast_rows > mem.budget:
            logger.warning("sekv: request %s: anchors, window and span summaries need %.0f rows' worth of bytes, "
                           "the budget is %d; serving it at the smallest layout (no scoring centroids)",
                           mem.req_id, plan.fast_rows, mem.budget)
        logger.info("sekv: compressed %s: %d prompt tokens -> %d spans (%d tokens), %d anchor/short, %d window; "
                    "fast tier %.1f%% of full KV; host pool %d bytes", mem.req_id, T, layout.num_spans,
                    layout.span_tokens, layout.fixed_pos.numel(), T - layout.window_start,
                    100 * mem.figures.fast_tier_fraction, mem.figures.host_pool_bytes)
        return ""

    def _prompt_figures(self, mem: RequestMemory, plan: SpanPlan, memories: dict[str, LayerSpanMemory],
                        features_bytes: int) -> CompressionFigures:
        L, row, layout = len(self.layer_names), mem.rows[self.layer_names[0]].row_bytes, plan.layout
        # the fast tier: fixed rows, summaries and scoring codes, the policy's span features, zoom rows
        fast = (layout.num_fixed * row * L + sum(m.fast_tier_nbytes for m in memories.values()) + features_bytes
                + mem.zoom_budget * row * L)
        return CompressionFigures(
            mem.req_id, SEKV, mem.prompt_len, mem.budget, full_kv_bytes=mem.prompt_len * row * L,
            fast_tier_bytes=fast, host_pool_bytes=self.pool.owner_bytes(mem.req_id), spans=layout.num_spans,
            own={"score_centroids": plan.centroids, "span_tokens": layout.span_tokens,
                 "anchor_and_short_tokens": int(layout.fixed_pos.numel()),
                 "window_tokens": mem.prompt_len - layout.window_start, "base_rows": layout.base_rows,
                 "zoom_budget_rows": mem.zoom_budget,
                 "budget_exceeded_by_base": max(round(layout.fast_rows(plan.span_rows)) - mem.budget, 0)})

    def window_due(self, mem: RequestMemory | None) -> bool:
        """Whether a compressed request's window holds `window` + `window_growth` rows or more."""
        growth = self.config.window_growth
        return (growth > 0 and mem is not None and mem.status is Status.COMPRESSED and not mem.suspended
                and mem.next_position - mem.window_pos >= self.config.window + growth
                and mem.next_position >= mem.spanify_from)

    def spanify_window(self, mem: RequestMemory) -> SpanifiedRows | None:
        """Segment and compress the oldest rows of a compressed request's window (all but its last
        `window`), output included, as its prompt was: by the surprisal of those tokens (the prompt's
        threshold), into anchors and short runs kept at full resolution and spans appended to every
        layer's compressed memory. Call it between steps, when every layer holds the same rows. None when
        no span formed (the rows stay at full resolution) or the host pool cannot take the spans (logged;
        tried again after `window_growth` more tokens).
        """
        cfg = self.config
        start, stop = mem.window_pos, mem.next_position - cfg.window
        n, r0 = stop - start, mem.window_row
        reserve_surprisal(mem, stop)
        surprisal = mem.surprisal[start:stop]
        # The prompt's threshold: a stretch of repetitive output would make anchors of its few
        # less predictable tokens by its own statistics. Its budget: the request's ratio of its rows,
        # split as the prompt's.
        share = n * mem.budget / mem.prompt_len
        layout = segment_prompt(surprisal, window=0, alpha=cfg.alpha, l_min=cfg.l_min, max_span=cfg.max_span,
                                budget=share * (1 - cfg.zoom_share), span_rows=mem.layout_span_rows, first_anchor=False,
                                theta=surprisal_threshold(mem.surprisal[: mem.prompt_len], cfg.alpha))
        if layout.num_spans == 0:
            mem.window_row, mem.window_pos = r0 + n, stop
            return None
        rows = {name: mem.rows[name].view() for name in self.layer_names}
        stored = {name: self.pool.load(mem.req_id, name) for name in self.layer_names}
        parts = self._compress_layers(mem, {n_: (k[r0 : r0 + n], v[r0 : r0 + n]) for n_, (k, v) in rows.items()},
                                      layout, surprisal, not stored[self.layer_names[0]].bases_k.factored)
        merged = {name: append_spans(stored[name], part) for name, part in parts.items()}
        if not self.pool.fits(sum(merged[m].bases_nbytes - stored[m].bases_nbytes for m in merged)):
            mem.spanify_from = mem.next_position + cfg.window_growth
            logger.warning("sekv: host pool full (%d of %d bytes used): request %s keeps its last %d rows at full "
                           "resolution", self.pool.used_bytes, self.pool.capacity_bytes, mem.req_id, n + cfg.window)
            return None
        for name, memory in merged.items():
            self.pool.store(mem.req_id, name, memory, memory.bases_nbytes)
        fast_bytes = sum(p.fast_tier_nbytes for p in parts.values())
        fast_bytes += 0 if mem.zoom_all else self._key_features(mem, merged)
        keep = torch.cat([torch.arange(r0), r0 + layout.fixed_pos, torch.arange(r0 + n, mem.rows[self.layer_names[0]].length)])
        self._keep_rows(mem, rows, keep, spare=cfg.window_growth + 1)
        # The budget grows with the compressed text at the request's ratio; what its new anchors and
        # spans do not take goes to zoomed spans.
        num_fixed = int(layout.fixed_pos.numel())
        zoom_rows = max(int(share - layout.fast_rows(mem.span_rows)), 0)
        mem.zoom_budget += zoom_rows
        mem.window_row, mem.window_pos = r0 + num_fixed, stop
        mem.output_spans += layout.num_spans
        mem.output_span_tokens += layout.span_tokens
        mem.output_fixed_tokens += num_fixed
        fast_bytes += (num_fixed + zoom_rows) * mem.rows[self.layer_names[0]].row_bytes * len(self.layer_names)
        mem.output_fast_tier_bytes += fast_bytes
        logger.info("sekv: %s: window rows %d-%d -> %d spans (%d tokens), %d anchor/short; host pool %d bytes",
                    mem.req_id, start, stop, layout.num_spans, layout.span_tokens, num_fixed,
                    self.pool.owner_bytes(mem.req_id))
        return SpanifiedRows(start, stop, layout.num_spans, fast_bytes)
