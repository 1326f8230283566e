"""TOVA (Oren et al., 2024): keep the rows the prompt's last query attends to most.

The last prompt token's query attends (softmax over every prompt row) with each query head; its
attention, averaged over all query heads, scores every earlier row once for all KV heads (one
choice of rows per layer, as TOVA's and kvpress's TOVAPress). Kept: the last row and the
top-scoring rows. While decoding (`evict_while_decoding`, TOVA's own policy) each step's query scores
the kept rows the same way and the lowest-scoring row goes, so the kept rows stay at their count;
kvpress compresses the prompt once (`evict_while_decoding: false`).
"""
from __future__ import annotations

import math
from typing import ClassVar

import torch

from sekv_vllm.methods.base import DecodeEviction, PromptRows, RowKeepingMethod


class TOVA(DecodeEviction, RowKeepingMethod):
    name: ClassVar[str] = "tova"

    @property
    def query_window(self) -> int:
        return 1

    def scores(self, rows: PromptRows) -> torch.Tensor:
        """The last query's head-averaged attention to rows [0, T - 1): [T - 1] float32."""
        k, q = rows.k.float(), rows.queries[-1].float()  # [T, Hkv, D], [H, D]
        Hkv, D = k.shape[1:]
        group = q.shape[0] // Hkv
        logits = torch.einsum("kgd,tkd->kgt", q.view(Hkv, group, D), k) / math.sqrt(D)
        return torch.softmax(logits, dim=-1)[..., :-1].mean(dim=(0, 1))

    def keep(self, rows: PromptRows, n_keep: int) -> torch.Tensor:
        T, Hkv = rows.k.shape[:2]
        last = torch.tensor([T - 1], device=rows.k.device)
        top = self.scores(rows).topk(n_keep - 1).indices
        return torch.cat([top, last]).sort().values.expand(Hkv, -1)

    def decode_scores(self, attn: torch.Tensor, acc: torch.Tensor, positions: torch.Tensor,
                      n_keep: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not self.evict_while_decoding:
            return None
        return acc, attn.mean(dim=0).expand(acc.shape[0], -1)  # one choice for every KV head
