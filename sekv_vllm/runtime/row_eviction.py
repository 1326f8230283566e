"""Eviction while decoding for a row-keeping method that does it (H2O, TOVA, StreamingLLM; torch only).

Each step the newest row joins the kept rows, the step's query attends over them all, the method scores
them (`RowKeepingMethod.decode_scores`) and each KV head evicts its lowest-scoring row: the request's last
row moves into that row's place for that head (attention needs no order once RoPE is applied), so the
kept rows stay at their count and in the pages they had.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from sekv_vllm.methods import RowKeepingMethod
from sekv_vllm.runtime.paged_rows import RowPages


@dataclass
class EvictionState:
    """One layer's kept rows as the method sees them: positions [Hkv, n] int64 of each KV head's rows in
    their order in the pages, acc [Hkv, n] float32 what the method accumulates per row; `capacity` rows are
    kept, n_keep of them chosen from the prompt."""

    positions: torch.Tensor
    acc: torch.Tensor
    capacity: int
    n_keep: int
    evicted: int = 0


def start_eviction(positions: torch.Tensor, acc: torch.Tensor | None, T: int, extra_rows: int,
                   n_keep: int) -> EvictionState:
    """The state of a layer just compressed: positions [Hkv, n_keep] kept of the T prompt rows, then
    `extra_rows` rows after them (a resumed request's earlier output, positions T ..); acc [Hkv, T] what the
    method accumulated over the prompt (None: zeros)."""
    Hkv = positions.shape[0]
    later = torch.arange(T, T + extra_rows, device=positions.device).expand(Hkv, -1)
    prompt_acc = acc.gather(1, positions) if acc is not None else \
        torch.zeros(positions.shape, dtype=torch.float32, device=positions.device)
    return EvictionState(torch.cat([positions, later], dim=1),
                         torch.cat([prompt_acc, prompt_acc.new_zeros(Hkv, extra_rows)], dim=1),
                         capacity=n_keep + extra_rows, n_keep=n_keep)


def attend_and_evict(method: RowKeepingMethod, rows: RowPages, state: EvictionState, q: torch.Tensor, scale: float,
                     position: int) -> torch.Tensor:
    """q [H, D], the query of the newest row (at `position`, the rows' last) -> [H, D] float32 attention over
    the rows; then each KV head evicts the row its method scores lowest when they outnumber `capacity`. Rows
    attended again with no new row among them are not scored again."""
    k, v = rows.view()
    n, Hkv, D = k.shape
    H = q.shape[0]
    probs = torch.softmax(torch.einsum("kgd,nkd->kgn", q.float().view(Hkv, H // Hkv, D), k.float()) * scale, dim=-1)
    out = torch.einsum("kgn,nkd->kgd", probs, v.float()).reshape(H, D)
    if n == state.positions.shape[1]:  # no new row since the last step (attended again): nothing to score
        return out
    positions = torch.cat([state.positions, state.positions.new_full((Hkv, 1), position)], dim=1)
    acc = torch.cat([state.acc, state.acc.new_zeros(Hkv, 1)], dim=1)
    acc, scores = method.decode_scores(probs.reshape(H, n), acc, positions, state.n_keep)
    if n > state.capacity:
        drop = scores.argmin(dim=1)  # [Hkv]
        rows.evict_into(drop)
        heads = torch.arange(Hkv, device=positions.device)
        positions[heads, drop], acc[heads, drop] = positions[:, -1], acc[:, -1]
        positions, acc = positions[:, :-1], acc[:, :-1]
        state.evicted += 1
    state.positions, state.acc = positions, acc
    return out
