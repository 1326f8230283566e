"""The rows of a prefilling request, captured by position (compression reads them once)."""
from __future__ import annotations

import torch


class RowBuffer:
    """rows k, v: [capacity, Hkv, D]; `length` rows are valid. Capacity doubles when needed."""

    def __init__(self, capacity: int, Hkv: int, D: int, dtype: torch.dtype) -> None:
        self.k = torch.empty(max(capacity, 1), Hkv, D, dtype=dtype)
        self.v = torch.empty_like(self.k)
        self.length = 0

    def _reserve(self, capacity: int) -> None:
        if capacity <= self.k.shape[0]:
            return
        new = max(capacity, 2 * self.k.shape[0])
        k = self.k.new_empty(new, *self.k.shape[1:])
        v = self.v.new_empty(new, *self.v.shape[1:])
        k[: self.length] = self.k[: self.length]
        v[: self.length] = self.v[: self.length]
        self.k, self.v = k, v

    def write(self, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Rows [start, start + n) = k, v ([n, Hkv, D]); rows before start must already be written."""
        n = k.shape[0]
        self._reserve(start + n)
        self.k[start : start + n] = k
        self.v[start : start + n] = v
        self.length = max(self.length, start + n)

    def view(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[: self.length], self.v[: self.length]
