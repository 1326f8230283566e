"""Per-request SeKV state inside a serving engine, engine-agnostic (torch only).

Life of a request: admitted (decides whether it will be compressed) -> surprisal recorded
while its prompt is prefilled -> compressed once the prompt is complete (summaries kept,
bases stored in the host pool) -> every decode step attends through `attend_batch`; when its
window (last prompt rows, then the output) outgrows `window_growth`, the oldest rows are compressed
the same way (`spanify_window`) -> released when it finishes or aborts (kept while preempted).
"""
from __future__ import annotations

import dataclasses
import json
import logging
from collections import deque

import torch

from sekv_vllm.config import RequestOverrides, SeKVConfig, SeKVConfigError
from sekv_vllm.core import LayerSpanMemory
from sekv_vllm.methods import METHODS, SEKV, MethodSettings, RowKeepingMethod
from sekv_vllm.methods.h2o import accumulate_attention
from sekv_vllm.methods.kv_quantization import KVQuantSettings
from sekv_vllm.pool import HostPool
from sekv_vllm.router import ModelShape
from sekv_vllm.runtime.figures import EnginePages
from sekv_vllm.runtime.kept_rows import KeptRowsRunner
from sekv_vllm.runtime.method_runner import MethodRunner
from sekv_vllm.runtime.page_selection import PageSelectRunner
from sekv_vllm.runtime.request_state import RequestMemory, SpanifiedRows, Status, reserve_surprisal, running_figures
from sekv_vllm.runtime.row_buffer import RowBuffer
from sekv_vllm.runtime.row_placement import (
    OWN_BLOCK, add_pages, in_engine_pages, leave_engine_pages, make_room, place_rows, rows_to_own_pages,
)
from sekv_vllm.runtime.span_runner import SpanRunner

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
        # SeKV's span memories, quest's host pages ((k, v) per layer)
        self.pool: HostPool[LayerSpanMemory | tuple[torch.Tensor, ...]] = HostPool(config.host_pool_bytes)
        self.requests: dict[str, RequestMemory] = {}
        # Every method by name: SeKV's runner (its policy, kernel, spans) and one per other method.
        self.sekv = SpanRunner(config, layer_names, self.pool, shape, model_name)
        self.methods: dict[str, MethodRunner] = {
            SEKV: self.sekv, **{name: self._runner(config.method_of(name), shape) for name in METHODS}}
        # Figures of the last requests that ended, for benchmarks and tests in this process.
        self.completed_figures: deque[dict] = deque(maxlen=4096)

    def _runner(self, method: MethodSettings, shape: ModelShape | None) -> MethodRunner:
        """The runner of a method's kind: a choice of rows, or pages selected per step; a method's quantization
        that does not fit the model's head size (`shape`) is refused."""
        spare = self.config.window_growth + 1
        codec = method.kv_quantization() if isinstance(method, KVQuantSettings) else None
        if codec is not None and shape is not None:
            try:
                codec.check_head_size(shape.head_dim)
            except ValueError as err:
                raise SeKVConfigError(f"invalid sekv config: sekv.{err}") from None
        if isinstance(method, RowKeepingMethod):
            return KeptRowsRunner(method, self.layer_names, OWN_BLOCK, spare=spare)
        return PageSelectRunner(method, self.layer_names, self.pool, OWN_BLOCK, spare=spare,
                                growth=self.config.window_growth)

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
            if overrides.sekv_exact_fallback_coverage is not None and method != SEKV:
                raise ValueError(f"sekv_exact_fallback_coverage is a setting of method {SEKV!r}, and this "
                                 f"deployment's method is {method!r}: name sekv_method {SEKV!r} with it")
            budget = self.config.budget_for(prompt_len, overrides)
            reason = self._full_kv_reason(prompt_len, overrides, method, budget)
        except ValueError as err:
            budget, reason = prompt_len, f"bad per-request settings: {err}"
            logger.warning("sekv: request %s keeps full KV: %s", req_id, reason)
        mem = RequestMemory(req_id, prompt_len, budget, Status.FULL_KV if reason else Status.PREFILLING, reason,
                            method=method, kv_bits=overrides.sekv_kv_bits if not reason else None,
                            exact_fallback_coverage=overrides.sekv_exact_fallback_coverage if not reason else None)
        if not reason and self.methods[method].needs_surprisal:
            mem.surprisal = torch.zeros(prompt_len, dtype=torch.float32)
        self.requests[req_id] = mem
        return mem

    def _full_kv_reason(self, prompt_len: int, overrides: RequestOverrides, method: str, budget: int) -> str:
        """Why a request keeps full KV, or "" when it will be compressed."""
        if not overrides.sekv_compress:
            return "compression switched off by the request"
        if prompt_len < self.config.min_prompt_tokens:
            return f"prompt ({prompt_len}) shorter than min_prompt_tokens ({self.config.min_prompt_tokens})"
        return self.methods[method].full_kv_reason(prompt_len, budget, overrides.sekv_kv_bits)

    def get(self, req_id: str) -> RequestMemory | None:
        return self.requests.get(req_id)

    def needs_surprisal(self, req_id: str) -> bool:
        """Whether the request's method reads its tokens' surprisal (SeKV's segmentation does)."""
        mem = self.requests.get(req_id)
        return mem is not None and self.methods[mem.method].needs_surprisal

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
        their queries, kept where the request's method reads them (the prompt's last query_window), or the
        attention they pay every row before them summed where it keeps that (H2O)."""
        mem = self.requests[req_id]
        if mem.status is Status.PREFILLING:
            buf = mem.captured.get(layer_name)
            if buf is None:
                buf = mem.captured[layer_name] = RowBuffer(mem.prompt_len, k.shape[1], k.shape[2], k.dtype)
            buf.write(start, k, v)
            runner = self.methods[mem.method]
            if runner.query_window and q is not None:
                self._capture_queries(mem, layer_name, start, q, runner.query_window)
            if runner.accumulates_prompt_attention and q is not None:
                self._sum_attention(mem, layer_name, start, q, buf)
        else:  # decode rows join the window
            self._make_room(mem, layer_name, k.shape[0])
            mem.rows[layer_name].append(k, v)
            self._advance([mem], layer_name, k.shape[0])

    @staticmethod
    def _sum_attention(mem: RequestMemory, layer_name: str, start: int, q: torch.Tensor, buf: RowBuffer) -> None:
        """Add the attention of the prompt's queries among q [n, H, D] at [start, start + n) to every row."""
        acc = mem.prompt_attention.get(layer_name)
        if acc is None:
            acc = mem.prompt_attention[layer_name] = torch.zeros(buf.k.shape[1], mem.prompt_len, device=q.device)
        n = min(q.shape[0], mem.prompt_len - start)
        if n > 0:
            accumulate_attention(acc, q[:n], buf.view()[0][: start + n], start)

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

    def _advance(self, mems: list[RequestMemory], layer_name: str, n: int) -> None:
        """Compressed requests' windows grew by n rows in a layer: count their positions once (first layer)."""
        if layer_name == self.layer_names[0]:
            for mem in mems:
                mem.next_position += n

    def compress(self, req_id: str) -> RequestMemory:
        """Compress a request whose prompt is complete with its method (`MethodRunner.compress`)."""
        mem = self.requests[req_id]
        if set(mem.captured) != set(self.layer_names):
            return self._keep_full(mem, "prompt rows were not captured in every layer")
        reason = self.methods[mem.method].compress(mem)
        return self._keep_full(mem, reason) if reason else mem

    # -- decode: the output grows -------------------------------------------------------------
    def window_due(self, req_id: str) -> bool:
        """Whether a compressed request's output has grown enough for its method to compress it further."""
        mem = self.requests.get(req_id)
        return mem is not None and self.methods[mem.method].window_due(mem)

    def spanify_window(self, req_id: str) -> SpanifiedRows | None:
        """The older rows of a request's window compressed by its method (SeKV: into spans); call it between
        steps, when every layer holds the same rows."""
        mem = self.requests[req_id]
        return self.methods[mem.method].grow_output(mem)

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
        mem.queries, mem.prompt_attention = {}, {}
        logger.info("sekv: request %s keeps full KV: %s", mem.req_id, reason)
        return mem

    # -- decode ------------------------------------------------------------------------
    def attend(self, req_id: str, layer_name: str, q: torch.Tensor, scale: float) -> torch.Tensor:
        """q: [H, D] post-RoPE query of the newest token (already captured); returns [H, D] float32."""
        return self.attend_batch([req_id], layer_name, q[None], scale)[0]

    def attend_batch(self, req_ids: list[str], layer_name: str, q: torch.Tensor, scale: float,
                     new_k: torch.Tensor | None = None, new_v: torch.Tensor | None = None) -> torch.Tensor:
        """Many compressed requests' newest tokens at once: q [B, H, D] -> [B, H, D] float32.

        new_k, new_v: [B, Hkv, D] the newest tokens' rows, appended to the requests' windows before they
        are attended (by the method's kernel itself where it writes them); None when captured already.
        The requests of each method attend together through its runner.
        """
        mems = [self.requests[r] for r in req_ids]
        groups: dict[str, list[int]] = {}
        for i, mem in enumerate(mems):
            groups.setdefault(mem.method, []).append(i)
        if len(groups) == 1:
            return self._attend_group(mems, layer_name, q, scale, new_k, new_v)
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        for idx in groups.values():
            out[idx] = self._attend_group([mems[i] for i in idx], layer_name, q[idx], scale,
                                          None if new_k is None else new_k[idx], None if new_v is None else new_v[idx])
        return out

    def _attend_group(self, mems: list[RequestMemory], layer_name: str, q: torch.Tensor, scale: float,
                      new_k: torch.Tensor | None, new_v: torch.Tensor | None) -> torch.Tensor:
        """`attend_batch` for requests of one method: their newest rows written first (or room made for the
        runner to write them)."""
        runner = self.methods[mems[0].method]
        writes = runner.writes_new_rows
        if new_k is not None:
            for i, mem in enumerate(mems):
                self._make_room(mem, layer_name, 1)
                if writes:
                    mem.rows[layer_name].grow(1)
                else:
                    mem.rows[layer_name].append(new_k[i : i + 1], new_v[i : i + 1])
            self._advance(mems, layer_name, 1)
        return runner.attend(mems, layer_name, q, scale, new_k if writes else None, new_v if writes else None)

    def is_active(self, req_id: str) -> bool:
        """Whether the request's rows must be captured (prefilling or compressed)."""
        mem = self.requests.get(req_id)
        return mem is not None and mem.status is not Status.FULL_KV

    # -- end ---------------------------------------------------------------------------
    def figures(self, req_id: str) -> dict:
        """Figures of a compressed request so far (empty if it is not compressed)."""
        mem = self.requests[req_id]
        return running_figures(mem, len(self.layer_names), self.pool.owner_bytes(req_id)) if mem.figures is not None else {}

    def record_engine_pages(self, req_id: str, pages: EnginePages) -> None:
        """The engine's pages of a compressed request (held and handed back), for its figures."""
        mem = self.requests[req_id]
        mem.figures = dataclasses.replace(mem.figures, pages=pages)

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
        mem = self.requests.pop(req_id, None)
        if mem is not None:
            leave_engine_pages(mem)
            self.methods[mem.method].forget(req_id)
        self.pool.release(req_id)
        if not self.requests:
            logger.info("sekv: no request held; host pool %d of %d bytes in use",
                        self.pool.used_bytes, self.pool.capacity_bytes)
        if not figures:
            return None
        figures["outcome"] = outcome
        logger.info(
            "sekv: %s %s after %d decode steps; mean zoomed spans per layer-step %.1f of %d; KV heads reading "
            "every row per layer-step %.2f",
            req_id, outcome, figures["decode_steps"], figures["mean_zoomed_spans"], figures["spans"],
            figures["mean_exact_heads"],
        )
        self.completed_figures.append(figures)
        if self.config.stats_path:
            with open(self.config.stats_path, "a") as f:
                f.write(json.dumps(figures) + "\n")
        return figures
