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
from pydantic import BaseModel, ConfigDict

from sekv_vllm.methods.kv_quantization import KVQuantSettings

@dataclass(frozen=True)
class PromptRows:
    """One layer of a prompt as prefill computed it.

    k, v: [T, Hkv, D] post-RoPE keys and values of positions [0, T); queries: [W, H, D] post-RoPE
    queries of the last W positions (W = the method's `query_window`; [0, H, D] when it needs none).
    """

    k: torch.Tensor
    v: torch.Tensor
    queries: torch.Tensor


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

    @abstractmethod
    def keep(self, rows: PromptRows, n_keep: int) -> torch.Tensor:
        """Positions kept per KV head: [Hkv, n_keep] int64, ascending, each row distinct;
        1 <= n_keep <= T."""


def gather_kept(k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept rows: k, v [T, Hkv, D] and positions [Hkv, n] -> k, v [n, Hkv, D], where row j of KV
    head h is position positions[h, j] (heads keep different positions; attention needs no position
    once RoPE is applied)."""
    heads = torch.arange(k.shape[1], device=k.device)
    pos = positions.t().to(k.device)
    return k[pos, heads], v[pos, heads]
