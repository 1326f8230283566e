"""How the runtime runs one KV-cache method's requests (torch only): the seam every method sits behind.

The runtime owns what every method shares (admission, row capture, the rows' pages, preemption, figures'
life, release); a runner owns what its method decides: whether a prompt can be compressed, what prefill
must capture for it, the compression, the decode attention and what happens to the output as it grows.
SeKV runs as `SpanRunner` (runtime/span_runner.py), each row-keeping method as `KeptRowsRunner`
(runtime/kept_rows.py).
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from sekv_vllm.runtime.request_state import RequestMemory, SpanifiedRows


class MethodRunner(ABC):
    """One method's part of the runtime. Its requests' `mem.method` is its name."""

    # the prompt's token surprisal is recorded during prefill (`record_surprisal`)
    needs_surprisal: bool = False

    @property
    def query_window(self) -> int:
        """Last prompt positions whose queries prefill keeps for the compression (0: none)."""
        return 0

    @property
    def accumulates_prompt_attention(self) -> bool:
        """Whether prefill sums the attention every prompt row receives (`RequestMemory.prompt_attention`)."""
        return False

    @property
    def writes_new_rows(self) -> bool:
        """Whether `attend` writes the newest rows into the request's rows itself (room is made for them);
        else the runtime appends them before `attend`."""
        return False

    @abstractmethod
    def full_kv_reason(self, prompt_len: int, budget: int, kv_bits: int | None) -> str:
        """Why a prompt of this length keeps full KV with this method under a budget of `budget` rows (and the
        request's `sekv_kv_bits`), or "" (asked at admission, before prefill captures anything for it)."""

    @abstractmethod
    def compress(self, mem: RequestMemory) -> str:
        """Compress a prefilled request (rows in `mem.captured`, queries in `mem.queries`); "" when done
        (`mem.status` COMPRESSED, `mem.rows` and `mem.figures` set), else why it keeps full KV."""

    @abstractmethod
    def attend(self, mems: list[RequestMemory], layer_name: str, q: torch.Tensor, scale: float,
               new_k: torch.Tensor | None, new_v: torch.Tensor | None) -> torch.Tensor:
        """The newest token of each compressed request: q [B, H, D] -> [B, H, D] float32. new_k, new_v
        [B, Hkv, D]: rows to write (only when `writes_new_rows`), else None."""

    def window_due(self, mem: RequestMemory) -> bool:
        """Whether the request's output has grown enough for `grow_output`."""
        return False

    def grow_output(self, mem: RequestMemory) -> SpanifiedRows | None:
        """Compress the request's older output rows (between steps); None when nothing changed."""
        return None

    def forget(self, req_id: str) -> None:
        """The request ended or changed: drop what the runner caches for it."""
