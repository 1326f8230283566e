"""What a KV-cache method's settings are, and what a row-keeping method is (plain torch, no engine).

Every method but SeKV is a `MethodSettings` subclass: its pydantic fields are its settings
(deployment: `{"method": name, field: value}`); a setting of another method is refused at start-up
naming the field. The runtime runs it through the runner of its kind (`runtime/method_runner.py`).

A row-keeping method looks at a request's prompt once it is prefilled and keeps, per layer and
per KV head, some of its rows; the rest are evicted. Decode attends over what was kept plus every row
generated since. The budget is a share of the prompt's full-KV bytes, all of it in the fast tier: as many
rows per KV head as it holds, at the KV cache dtype or quantized (`kv_quantization.py`).

Adding one: a file in this folder with a subclass, and its line in `METHODS` (`__init__.py`).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch
from pydantic import BaseModel, ConfigDict, Field

from sekv_vllm.methods.kv_quantization import KVQuantSettings


@dataclass(frozen=True)
class PromptRows:
    """One layer of a prompt as prefill computed it.

    k, v: [T, Hkv, D] post-RoPE keys and values of positions [0, T); queries: [W, H, D] post-RoPE
    queries of the last W positions (W = the method's `query_window`; [0, H, D] when it needs none);
    attention: [Hkv, T] float32, the attention each row received from every prompt query, summed over
    the queries and the query heads of its KV head (a method with `accumulates_prompt_attention`; else None).
    """

    k: torch.Tensor
    v: torch.Tensor
    queries: torch.Tensor
    attention: torch.Tensor | None = None


class MethodSettings(BaseModel):
    """A method's name and settings (pydantic fields)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: ClassVar[str]

    @property
    def query_window(self) -> int:
        """Last prompt positions whose queries the method reads (0: none)."""
        return 0


class RowKeepingMethod(MethodSettings, KVQuantSettings, ABC):
    """A method that keeps, per KV head, a choice of the prompt's rows (`keep`), at the KV cache dtype or
    quantized (`kv_bits`: more rows for the same bytes)."""

    # prefill sums the attention every prompt row receives (`PromptRows.attention`; H2O's heavy hitters)
    accumulates_prompt_attention: ClassVar[bool] = False

    @property
    def evicts_while_decoding(self) -> bool:
        """Whether the kept rows stay at their count while decoding (`decode_scores` picks what goes)."""
        return False

    @abstractmethod
    def keep(self, rows: PromptRows, n_keep: int) -> torch.Tensor:
        """Positions kept per KV head: [Hkv, n_keep] int64, ascending, each row distinct;
        1 <= n_keep <= T."""

    def decode_scores(self, attn: torch.Tensor, acc: torch.Tensor, positions: torch.Tensor,
                      n_keep: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """While decoding, after each step's attention over the kept rows (the newest included): which row
        each KV head evicts to stay at its count. attn: [H, n] float32 the step's attention; acc: [Hkv, n]
        float32 what the method accumulates per row (zeros at first); positions: [Hkv, n] int64 each row's
        position; n_keep: the rows kept. Returns (acc, scores [Hkv, n]): the row of lowest score is evicted;
        None: the method does not evict while decoding (its rows grow with the output)."""
        return None


class DecodeEviction(BaseModel):
    """The setting of a method that may evict while decoding (a mixin of its settings)."""

    evict_while_decoding: bool = Field(True, description="evict a row per KV head at each decode step so that the "
                                       "kept rows stay at their count (false: the prompt is compressed once and the "
                                       "output kept whole, as kvpress's presses)")

    @property
    def evicts_while_decoding(self) -> bool:
        return self.evict_while_decoding


def protect(scores: torch.Tensor, protected: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """scores [Hkv, n] with the protected rows ([Hkv, n] bool) scored above every other row of their KV head,
    the oldest of them (positions [Hkv, n]) lowest: evicted only when every row is protected."""
    above = scores.amax(dim=1, keepdim=True) + 1 + positions.to(scores.dtype)
    return torch.where(protected, above, scores)


def recent(positions: torch.Tensor, n: int) -> torch.Tensor:
    """[Hkv, n_rows] bool: each KV head's n most recent rows (positions [Hkv, n_rows])."""
    return positions > positions.max(dim=1, keepdim=True).values - n


def head_mean(attn: torch.Tensor, Hkv: int) -> torch.Tensor:
    """attn [H, n] -> [Hkv, n]: the mean over the query heads of each KV head."""
    return attn.view(Hkv, attn.shape[0] // Hkv, -1).mean(dim=1)


def gather_kept(k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept rows: k, v [T, Hkv, D] and positions [Hkv, n] -> k, v [n, Hkv, D], where row j of KV
    head h is position positions[h, j] (heads keep different positions; attention needs no position
    once RoPE is applied)."""
    heads = torch.arange(k.shape[1], device=k.device)
    pos = positions.t().to(k.device)
    return k[pos, heads], v[pos, heads]
