"""Per-request SeKV state inside a serving engine, engine-agnostic (torch only).

Life of a request: admitted (decides whether it will be compressed) -> surprisal recorded
while its prompt is prefilled -> compressed once the prompt is complete (summaries kept,
bases stored in the host pool) -> every decode step attends through `attend_batch`; when its
window (last prompt rows, then the output) outgrows `window_growth`, the oldest rows are compressed
the same way (`spanify_window`) -> released when it finishes or aborts (kept while preempted).
"""
from __future__ import annotations

import json
import logging
import math
from collections import deque
from types import ModuleType

import torch

from sekv_vllm.config import RequestOverrides, SeKVConfig
from sekv_vllm.core import LayerSpanMemory
from sekv_vllm.methods import ROW_METHODS, SEKV, RowKeepingMethod
from sekv_vllm.ops.span_decode import KernelBuildError, load_span_decode
from sekv_vllm.policies import ZoomPolicy, make_policy
from sekv_vllm.pool import HostPool
from sekv_vllm.router import ModelShape
from sekv_vllm.runtime.kept_rows import attend_kept, compress_kept_rows
from sekv_vllm.runtime.request_state import RequestMemory, SpanifiedRows, Status, reserve_surprisal, running_figures
from sekv_vllm.runtime.row_buffer import RowBuffer
from sekv_vllm.runtime.row_placement import (
    OWN_BLOCK, add_pages, in_engine_pages, make_room, place_rows, rows_to_own_pages,
)
from sekv_vllm.runtime.span_compression import SpanCompression
from sekv_vllm.runtime.span_decoder import SpanDecoder

logger = logging.getLogger("sekv_vllm")


class SeKVRuntime:
    """All compressed requests of one worker.

    Bytes are counted in the KV cache dtype: a row is K and V of every KV head of one layer.
    layer_names are in model order (the router's layer index is the position in this list).
    """

    def __init__(self, config: SeKVConfig, layer_names: list[str], shape: ModelShape | None = None,
                 model_name: str = "") -> None:
        self.config = config
        self.layer_names = layer_names
        self.layer_index = {name: i for i, name in enumerate(layer_names)}
        self.policy: ZoomPolicy = make_policy(config.zoom_policy, shape=shape, model_name=model_name,
                                              router_weights=config.router_weights)
        self.row_methods: dict[str, RowKeepingMethod] = {name: config.row_method(name) for name in ROW_METHODS}
        self.pool: HostPool[LayerSpanMemory] = HostPool(config.host_pool_bytes)
        self.requests: dict[str, RequestMemory] = {}
        self.spans = SpanDecoder(self.policy, self.pool, config.max_span)
        self.span_compression = SpanCompression(config, layer_names, self.policy, self.pool, OWN_BLOCK)
        self.kernel: ModuleType | None = self._load_kernel(config.decode_kernel)
        # Figures of the last requests that ended, for benchmarks and tests in this process.
        self.completed_figures: deque[dict] = deque(maxlen=4096)

    @staticmethod
    def _load_kernel(choice: str) -> ModuleType | None:
        """The C++ decode kernel, or None for the torch path (`SeKVConfig.decode_kernel`)."""
        if choice == "torch":
            return None
        try:
            kernel = load_span_decode()
        except KernelBuildError as err:
            if choice == "cpp":
                raise RuntimeError(f"sekv.decode_kernel is 'cpp' but the C++ kernel cannot be built here: {err}; "
                                   "allowed: 'auto' (fall back to torch, logged) or 'torch'") from None
            logger.warning("sekv: C++ decode kernel unavailable (%s); decoding with the torch ops", err)
            return None
        logger.info("sekv: decode attention: C++ kernel (decode_kernel=%s)", choice)
        return kernel

    # -- admission ---------------------------------------------------------------------
    def admit(self, req_id: str, prompt_len: int, extra_args: dict | None) -> RequestMemory:
        """Decide once per request whether its prompt will be compressed.

        extra_args were validated at the front end; a bad value here still must not fail
        the request, so it is kept at full KV and the reason logged.
        """
        method = self.config.method
        try:
            overrides = RequestOverrides.from_extra_args(extra_args)
            method = overrides.sekv_method or method
            budget = self.config.budget_for(prompt_len, overrides)
            reason = self._full_kv_reason(prompt_len, overrides, method)
        except ValueError as err:
            budget, reason = prompt_len, f"bad per-request settings: {err}"
            logger.warning("sekv: request %s keeps full KV: %s", req_id, reason)
        mem = RequestMemory(req_id, prompt_len, budget, Status.FULL_KV if reason else Status.PREFILLING, reason,
                            method=method)
        if not reason and method == SEKV:
            mem.surprisal = torch.zeros(prompt_len, dtype=torch.float32)
        self.requests[req_id] = mem
        return mem

    def _full_kv_reason(self, prompt_len: int, overrides: RequestOverrides, method: str) -> str:
        """Why a request keeps full KV, or "" when it will be compressed."""
        if not overrides.sekv_compress:
            return "compression switched off by the request"
        if prompt_len < self.config.min_prompt_tokens:
            return f"prompt ({prompt_len}) shorter than min_prompt_tokens ({self.config.min_prompt_tokens})"
        if method in self.row_methods:
            window = self.row_methods[method].query_window
            return f"prompt ({prompt_len}) not longer than {method}'s query window ({window})" if prompt_len <= window else ""
        if prompt_len <= self.config.window:
            return f"prompt ({prompt_len}) fits in the window ({self.config.window})"
        return ""

    def get(self, req_id: str) -> RequestMemory | None:
        return self.requests.get(req_id)

    def needs_surprisal(self, req_id: str) -> bool:
        """Whether the request's method reads its tokens' surprisal (SeKV's segmentation does)."""
        mem = self.requests.get(req_id)
        return mem is not None and mem.method == SEKV

    def is_compressed(self, req_id: str) -> bool:
        mem = self.requests.get(req_id)
        return mem is not None and mem.status is Status.COMPRESSED

    # -- prefill -----------------------------------------------------------------------
    def record_surprisal(self, req_id: str, positions: torch.Tensor, values: torch.Tensor) -> None:
        """positions: [n] int64 positions (>= 1; past the prompt: output tokens); values: [n] float
        surprisal there."""
        mem = self.requests[req_id]
        if positions.numel():
            reserve_surprisal(mem, int(positions.max()) + 1)
        mem.surprisal[positions] = values.float()

    def capture(self, req_id: str, layer_name: str, start: int, k: torch.Tensor, v: torch.Tensor,
                q: torch.Tensor | None = None) -> None:
        """Rows computed this step: k, v [n, Hkv, D] (post-RoPE) at positions [start, start + n); q [n, H, D]
        their queries, kept where the request's method reads them (the prompt's last query_window)."""
        mem = self.requests[req_id]
        if mem.status is Status.PREFILLING:
            buf = mem.captured.get(layer_name)
            if buf is None:
                buf = mem.captured[layer_name] = RowBuffer(mem.prompt_len, k.shape[1], k.shape[2], k.dtype)
            buf.write(start, k, v)
            window = self.row_methods[mem.method].query_window if mem.method in self.row_methods else 0
            if window and q is not None:
                self._capture_queries(mem, layer_name, start, q, window)
        else:  # decode rows join the window
            self._make_room(mem, layer_name, k.shape[0])
            mem.rows[layer_name].append(k, v)
            self._advance([req_id], layer_name, k.shape[0])

    @staticmethod
    def _capture_queries(mem: RequestMemory, layer_name: str, start: int, q: torch.Tensor, window: int) -> None:
        """Keep the queries of positions [T - window, T) among q [n, H, D] at [start, start + n)."""
        first = mem.prompt_len - window
        lo, hi = max(first, start), min(mem.prompt_len, start + q.shape[0])
        if lo >= hi:
            return
        kept = mem.queries.get(layer_name)
        if kept is None:
            kept = mem.queries[layer_name] = q.new_zeros(window, *q.shape[1:])
        kept[lo - first : hi - first] = q[lo - start : hi - start]

    def _advance(self, req_ids: list[str], layer_name: str, n: int) -> None:
        """Compressed requests' windows grew by n rows in a layer: count their positions once (first layer)."""
        if layer_name == self.layer_names[0]:
            for req_id in req_ids:
                self.requests[req_id].next_position += n

    def compress(self, req_id: str) -> RequestMemory:
        """Segment the prompt and compress every layer from its captured rows."""
        mem = self.requests[req_id]
        cfg = self.config
        if set(mem.captured) != set(self.layer_names):
            return self._keep_full(mem, "prompt rows were not captured in every layer")
        if mem.method in self.row_methods:
            return self._compress_kept_rows(mem)
        reason = self.span_compression.compress_prompt(mem)
        if reason:
            return self._keep_full(mem, reason)
        if self.kernel is not None and mem.rows[self.layer_names[0]].pages.dtype != torch.float32:
            # `decode_kernel: cpp` with such a cache is refused at start-up (integration/vllm/v0_32/shims.py)
            logger.warning("sekv: the C++ decode kernel reads float32 KV rows, these are %s: decoding with "
                           "the torch ops", mem.rows[self.layer_names[0]].pages.dtype)
            self.kernel = None
        return mem

    def _compress_kept_rows(self, mem: RequestMemory) -> RequestMemory:
        """A row-keeping method's compression: the prompt rows it keeps per KV head, the rest evicted."""
        method = self.row_methods[mem.method]
        if method.query_window and set(mem.queries) != set(self.layer_names):
            return self._keep_full(mem, "prompt queries were not captured in every layer")
        compress_kept_rows(method, mem, OWN_BLOCK, spare=self.config.window_growth + 1)
        return mem

    # -- decode: the window outgrows its limit ----------------------------------------------
    def window_due(self, req_id: str) -> bool:
        """Whether a compressed request's window holds `window` + `window_growth` rows or more."""
        return self.span_compression.window_due(self.requests.get(req_id))

    def spanify_window(self, req_id: str) -> SpanifiedRows | None:
        """The oldest rows of a SeKV request's window compressed into spans (`SpanCompression.spanify_window`)."""
        part = self.span_compression.spanify_window(self.requests[req_id])
        if part is not None:
            self.spans.forget(req_id)
        return part

    # -- where the rows live (row_placement.py) ---------------------------------------------
    def place_rows(self, req_id: str, pages: dict[str, torch.Tensor], table: torch.Tensor) -> bool:
        """A compressed request's full-resolution rows into the engine's pages (`row_placement.place_rows`)."""
        return place_rows(self.requests[req_id], pages, table)

    def add_pages(self, req_id: str, table: torch.Tensor) -> None:
        """More engine pages for a request whose rows are in the engine's pages (its output grows)."""
        add_pages(self.requests[req_id], table)

    def rows_in_engine_pages(self, req_id: str) -> bool:
        return in_engine_pages(self.requests.get(req_id))

    def _make_room(self, mem: RequestMemory, layer_name: str, n: int) -> None:
        make_room(mem, layer_name, n, spare=self.config.window_growth)

    def _keep_full(self, mem: RequestMemory, reason: str) -> RequestMemory:
        mem.status, mem.reason, mem.rows, mem.captured = Status.FULL_KV, reason, {}, {}
        logger.info("sekv: request %s keeps full KV: %s", mem.req_id, reason)
        return mem

    # -- decode ------------------------------------------------------------------------
    def attend(self, req_id: str, layer_name: str, q: torch.Tensor, scale: float) -> torch.Tensor:
        """q: [H, D] post-RoPE query of the newest token (already captured); returns [H, D] float32."""
        return self.attend_batch([req_id], layer_name, q[None], scale)[0]

    def attend_batch(self, req_ids: list[str], layer_name: str, q: torch.Tensor, scale: float,
                     new_k: torch.Tensor | None = None, new_v: torch.Tensor | None = None) -> torch.Tensor:
        """Many compressed requests' newest tokens at once: q [B, H, D] -> [B, H, D] float32.

        new_k, new_v: [B, Hkv, D] the newest tokens' rows, appended to the requests' windows here (as
        `capture` would) before they are attended; None when they were captured already.
        SeKV requests attend through their spans (`_attend_spans`), a row-keeping method's over the
        rows it kept and its output (`attend_kept`).
        """
        kept = [i for i, r in enumerate(req_ids) if self.requests[r].method != SEKV]
        if not kept:
            return self._attend_spans(req_ids, layer_name, q, scale, new_k, new_v)
        spans = sorted(set(range(len(req_ids))) - set(kept))
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        if spans:
            out[spans] = self._attend_spans([req_ids[i] for i in spans], layer_name, q[spans], scale,
                                            None if new_k is None else new_k[spans],
                                            None if new_v is None else new_v[spans])
        ids = [req_ids[i] for i in kept]
        for i, req_id in zip(kept, ids):
            if new_k is not None:
                self.capture(req_id, layer_name, 0, new_k[i : i + 1], new_v[i : i + 1])
            self.requests[req_id].decode_calls += 1
        out[kept] = attend_kept([self.requests[r].rows[layer_name] for r in ids], q[kept], scale)
        return out

    def _attend_spans(self, req_ids: list[str], layer_name: str, q: torch.Tensor, scale: float,
                      new_k: torch.Tensor | None, new_v: torch.Tensor | None) -> torch.Tensor:
        """`attend_batch` for SeKV requests through their spans (`span_decoder.SpanDecoder`): the kernel
        writes new_k, new_v in place, the torch path captures them first."""
        batch = self.spans.batch([self.requests[r] for r in req_ids], layer_name)
        layer = self.layer_index[layer_name]
        if self.kernel is not None:
            if new_k is not None:
                for r in req_ids:
                    self._make_room(self.requests[r], layer_name, 1)
                    self.requests[r].rows[layer_name].grow(1)
                self._advance(req_ids, layer_name, 1)
            rows = [self.requests[r].rows[layer_name] for r in req_ids]
            out, zoomed = self.spans.attend_kernel(self.kernel, batch, layer, q, rows, new_k, new_v, scale)
        else:
            if new_k is not None:
                for i, req_id in enumerate(req_ids):
                    self.capture(req_id, layer_name, 0, new_k[i : i + 1], new_v[i : i + 1])
            full = [self.requests[r].rows[layer_name].view() for r in req_ids]
            out, zoom = self.spans.attend_torch(batch, layer, q, full, scale)
            zoomed = torch.zeros(len(req_ids), dtype=torch.int64).index_add_(0, batch.seg, zoom.any(dim=1).long())
        for req_id, c in zip(req_ids, zoomed.tolist()):
            mem = self.requests[req_id]
            mem.decode_calls += 1
            mem.zoomed_spans_total += c
        return out

    def is_active(self, req_id: str) -> bool:
        """Whether the request's rows must be captured (prefilling or compressed)."""
        mem = self.requests.get(req_id)
        return mem is not None and mem.status is not Status.FULL_KV

    # -- end ---------------------------------------------------------------------------
    def figures(self, req_id: str) -> dict:
        """Figures of a compressed request so far (empty if it is not compressed)."""
        mem = self.requests[req_id]
        return running_figures(mem, len(self.layer_names), self.pool.owner_bytes(req_id)) if mem.figures else {}

    def suspend(self, req_id: str) -> None:
        """A compressed request was preempted: keep its state (host pool, rows) for the recompute
        that resumes it, so that it is not compressed again from rows computed another way (its
        output rows would then come from exact attention, not from its compressed decode) and its
        output does not change. Rows in the engine's pages are copied out first: the engine frees
        those pages now (its recompute computes them again, exactly, not as these rows). `release`
        frees it when it ends."""
        mem = self.requests[req_id]
        if mem.suspended:
            return
        mem.suspended = True
        rows_to_own_pages(mem, spare=self.config.window_growth)
        logger.info("sekv: %s preempted; its compressed state (%d host-pool bytes) is kept for its recompute",
                    req_id, self.pool.owner_bytes(req_id))

    def resume(self, req_id: str) -> None:
        self.requests[req_id].suspended = False

    def release(self, req_id: str, *, outcome: str) -> dict | None:
        """Free both tiers of a request; returns its figures if it was compressed."""
        try:
            figures = self.figures(req_id) if req_id in self.requests else {}
        except Exception:  # a request whose state broke (it failed) still frees both tiers
            logger.exception("sekv: %s: its figures could not be read", req_id)
            figures = {}
        self.requests.pop(req_id, None)
        self.spans.forget(req_id)
        self.pool.release(req_id)
        if not self.requests:
            logger.info("sekv: no request held; host pool %d of %d bytes in use",
                        self.pool.used_bytes, self.pool.capacity_bytes)
        if not figures:
            return None
        figures["outcome"] = outcome
        logger.info(
            "sekv: %s %s after %d decode steps; mean zoomed spans per layer-step %.1f of %d",
            req_id, outcome, figures["decode_steps"], figures["mean_zoomed_spans"], figures["spans"],
        )
        self.completed_figures.append(figures)
        if self.config.stats_path:
            with open(self.config.stats_path, "a") as f:
                f.write(json.dumps(figures) + "\n")
        return figures
