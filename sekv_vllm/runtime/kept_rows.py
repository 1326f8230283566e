"""A row-keeping method's requests in the runtime (`KeptRowsRunner`): the prompt's kept rows, then decode
over them.

The kept rows of every layer go into pages as a SeKV request's full-resolution rows do (`PagedRows`, or
`QuantizedRows` at `kv_bits` < 16), so they move into vLLM's pages, grow with the output and survive
preemption the same way; the output is quantized as it is written when the rows are, and kept whole
unless the method evicts while decoding (`row_eviction.py`: the rows stay at their count).
"""
from __future__ import annotations

import logging
from typing import Callable

import torch

from sekv_vllm.core import exact_attention
from sekv_vllm.methods import PromptRows, RowKeepingMethod, gather_kept
from sekv_vllm.methods.kv_quantization import KVQuantization
from sekv_vllm.runtime.figures import CompressionFigures
from sekv_vllm.runtime.method_runner import MethodRunner
from sekv_vllm.runtime.paged_rows import PagedRows, RowPages
from sekv_vllm.runtime.quantized_rows import QuantizedRows
from sekv_vllm.runtime.request_state import RequestMemory, Status
from sekv_vllm.runtime.row_eviction import attend_and_evict, start_eviction

logger = logging.getLogger("sekv_vllm")


def keep_prompt_rows(method: RowKeepingMethod, mem: RequestMemory, n_keep: int,
                     store: Callable[..., RowPages]) -> dict[str, torch.Tensor]:
    """Per layer, the rows `method` keeps of the prompt's captured rows (k, v [>= T, Hkv, D]; rows past
    the prompt, a resumed request's earlier output, are all kept after them) into `mem.rows`, stored by
    `store(k, v)`; returns the kept positions per layer [Hkv, n_keep]."""
    kept = {}
    for name, buf in mem.captured.items():
        k, v = buf.view()
        no_queries = k.new_zeros(0, 1, k.shape[2])  # the method reads none
        T = mem.prompt_len
        prompt = PromptRows(k[:T], v[:T], mem.queries.get(name, no_queries), mem.prompt_attention.get(name))
        kept[name] = method.keep(prompt, n_keep)
        k_kept, v_kept = gather_kept(prompt.k, prompt.v, kept[name])
        mem.rows[name] = store(torch.cat([k_kept, k[T:]]), torch.cat([v_kept, v[T:]]))
    return kept


def compress_kept_rows(method: RowKeepingMethod, mem: RequestMemory, codec: KVQuantization | None, block: int,
                       spare: int) -> None:
    """A prefilled request compressed by a row-keeping method: the prompt rows it keeps per KV head (the
    rest evicted) in pages of `block` rows with room for `spare` more, its figures. Quantized rows
    (`codec`: the request's `kv_bits` < 16) cost fewer bytes each: the budget's bytes keep more of them. A
    method that evicts while decoding keeps them at their count (`row_eviction.py`) unless they hold the
    whole prompt."""
    first = next(iter(mem.captured.values()))
    Hkv, D = first.k.shape[1:]
    full_row = 2 * Hkv * D * first.k.element_size()
    if codec is None:
        row, store = full_row, lambda k, v: PagedRows.of_rows(k, v, block, spare=spare)
    else:
        row, store = codec.row_bytes(Hkv, D), lambda k, v: QuantizedRows.of_rows(k, v, codec, block, spare=spare)
    n_keep = min(mem.budget * full_row // row, mem.prompt_len)
    kept = keep_prompt_rows(method, mem, n_keep, store)
    evicts = n_keep < mem.prompt_len and method.evicts_while_decoding
    if evicts:
        extra = first.length - mem.prompt_len
        mem.method_state = {name: start_eviction(pos, mem.prompt_attention.get(name), mem.prompt_len, extra, n_keep)
                            for name, pos in kept.items()}
    mem.next_position = first.length
    mem.captured, mem.queries, mem.prompt_attention = {}, {}, {}
    mem.status = Status.COMPRESSED
    L = len(mem.rows)
    mem.figures = CompressionFigures(
        mem.req_id, mem.method, mem.prompt_len, mem.budget, full_kv_bytes=mem.prompt_len * full_row * L,
        fast_tier_bytes=n_keep * row * L, host_pool_bytes=0,
        own={"kv_bits": codec.bits if codec else 16, "evicts_while_decoding": evicts, "kept_prompt_rows": n_keep})
    logger.info("sekv: compressed %s with %s: %d prompt tokens -> %d kept rows per KV head%s%s", mem.req_id,
                mem.method, mem.prompt_len, n_keep, f" at {codec.bits} bits" if codec else "",
                ", evicted while decoding" if evicts else "")


def attend_kept(rows: list[RowPages], q: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [B, H, D], one query per request, over that request's rows -> [B, H, D] float32."""
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for i, r in enumerate(rows):
        k, v = r.view()
        out[i] = exact_attention(q[i], k, v, scale)
    return out


class KeptRowsRunner(MethodRunner):
    """A row-keeping method's requests; kept rows go into pages of `block` rows with room for `spare` more."""

    def __init__(self, method: RowKeepingMethod, layer_names: list[str], block: int, spare: int) -> None:
        self.method, self.layer_names, self.block, self.spare = method, layer_names, block, spare

    @property
    def query_window(self) -> int:
        return self.method.query_window

    def full_kv_reason(self, prompt_len: int, budget: int, kv_bits: int | None) -> str:
        window = self.method.query_window
        return f"prompt ({prompt_len}) not longer than {self.method.name}'s query window ({window})" \
            if prompt_len <= window else ""

    def compress(self, mem: RequestMemory) -> str:
        if self.method.query_window and set(mem.queries) != set(self.layer_names):
            return "prompt queries were not captured in every layer"
        codec, reason = self.method.request_quantization(mem.kv_bits, next(iter(mem.captured.values())).k.shape[2])
        if reason:
            return reason
        compress_kept_rows(self.method, mem, codec, self.block, self.spare)
        return ""

    @property
    def accumulates_prompt_attention(self) -> bool:
        return self.method.accumulates_prompt_attention

    def attend(self, mems: list[RequestMemory], layer_name: str, q: torch.Tensor, scale: float,
               new_k: torch.Tensor | None, new_v: torch.Tensor | None) -> torch.Tensor:
        for mem in mems:
            mem.decode_calls += 1
        if all(m.method_state is None for m in mems):
            return attend_kept([m.rows[layer_name] for m in mems], q, scale)
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        for i, mem in enumerate(mems):
            rows = mem.rows[layer_name]
            out[i] = attend_kept([rows], q[i : i + 1], scale)[0] if mem.method_state is None else \
                attend_and_evict(self.method, rows, mem.method_state[layer_name], q[i], scale, mem.next_position - 1)
        return out
