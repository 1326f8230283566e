"""A compressed request's kept K/V rows of one layer, in pages.

The pages are the serving engine's own (vLLM's KV cache: the pages a compressed request keeps,
reinterpreted, since vLLM never reads them again for it) or, until the engine hands them over
(and in tests, benchmarks, a preempted request), pages this object allocates itself.
`RowPages` is what every layout shares (a page table, the valid length, own pages that double);
`PagedRows` keeps rows in the KV cache dtype: one page is its K rows, then its V rows
[P, 2, block, Hkv, D]. Quantized rows: `quantized_rows.py`.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch


class RowPages(ABC):
    """pages: [P, ...] (the layout's); table: [m] int64 page ids in row order; the first `length` rows are
    valid. `own` pages grow (double) when full; the engine's do not: `place` hands more over."""

    def __init__(self, pages: torch.Tensor, table: torch.Tensor, length: int, own: bool) -> None:
        self.pages = pages
        self.table = table
        self.length = length
        self.own = own

    @property
    @abstractmethod
    def capacity(self) -> int:
        """Rows the listed pages hold."""

    @property
    @abstractmethod
    def row_bytes(self) -> int:
        """Bytes one row (K and V of every KV head) takes in the pages."""

    @abstractmethod
    def _pages_for(self, rows: int) -> int:
        """Pages of this layout that hold `rows` rows."""

    @abstractmethod
    def _put(self, start: int, rows: Any) -> None:
        """Rows [start, start + n) = rows in this layout's form (room reserved)."""

    @abstractmethod
    def _get(self, start: int, n: int) -> Any:
        """Rows [start, start + n) in this layout's form."""

    @abstractmethod
    def _encode(self, k: torch.Tensor, v: torch.Tensor) -> Any:
        """k, v [n, Hkv, D] -> this layout's form."""

    @abstractmethod
    def _decode(self, rows: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """This layout's form -> k, v [n, Hkv, D]."""

    @abstractmethod
    def _in(self, pages: torch.Tensor, table: torch.Tensor) -> "RowPages":
        """An empty store of this layout in other pages: the engine's [P', 2, block, Hkv, D] (not own), or
        pages of its own [P', ...] when `table` is None (own)."""

    @property
    def pages_used(self) -> torch.Tensor:
        """The ids of the pages the valid rows occupy, in row order."""
        return self.table[: self._pages_for(self.length)]

    def write(self, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Rows [start, start + n) = k, v [n, Hkv, D]; rows before start must be valid."""
        n = k.shape[0]
        self.reserve(start + n)
        self._put(start, self._encode(k, v))
        self.length = max(self.length, start + n)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.write(self.length, k, v)

    def reserve(self, rows: int) -> None:
        """Room for `rows` rows: own pages double; the engine's must have been handed over."""
        if rows <= self.capacity:
            return
        if not self.own:
            raise RuntimeError(f"paged rows: {rows} rows need more than the {self.table.numel()} pages handed over")
        more = max(self._pages_for(rows), 2 * self.table.numel()) - self.table.numel()
        self.pages = torch.cat([self.pages[self.table], self.pages.new_empty(more, *self.pages.shape[1:])])
        self.table = torch.arange(self.pages.shape[0])

    def view(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the valid rows: k, v [length, Hkv, D]."""
        return self._decode(self._get(0, self.length))

    def evict_into(self, dst: torch.Tensor) -> None:
        """Evict row dst[h] of each KV head h (dst: [Hkv] int64): the last row of that head moves there, and
        the last row goes."""
        self._move_heads(self.length - 1, dst.to(torch.int64))
        self.length -= 1

    @abstractmethod
    def _move_heads(self, src: int, dst: torch.Tensor) -> None:
        """Row src of each KV head h copied into row dst[h] of that head."""

    def _copy_into(self, other: "RowPages") -> "RowPages":
        other._put(0, self._get(0, self.length))  # as stored: nothing quantized twice
        other.length = self.length
        return other

    def fits(self, pages: torch.Tensor, table: torch.Tensor) -> bool:
        """Whether the engine's pages [P', 2, block, Hkv, D] listed in table [m] hold the valid rows."""
        return self._in(pages, table.to(torch.int64)).capacity >= self.length

    def scrub(self) -> None:
        """The rows leave the engine's pages: none of their bytes may read as a NaN to vLLM's kernel, which may
        attend over a whole page of the next request holding it (masked slots included). Rows in the KV dtype
        are values already."""

    def place(self, pages: torch.Tensor, table: torch.Tensor) -> "RowPages":
        """The same rows written into the engine's pages [P', 2, block, Hkv, D], table [m] (enough for them)."""
        placed = self._in(pages, table.to(torch.int64))
        if placed.capacity < self.length:
            raise ValueError(f"paged rows: {table.numel()} pages of {pages.shape[2]} rows cannot hold {self.length} rows")
        return self._copy_into(placed)

    def to_own(self, block: int, spare: int) -> "RowPages":
        """The same rows in pages of their own (`block` rows each), with room for `spare` more."""
        own = self._in(self.pages.new_empty(0, *self._own_page_shape(block)), None)
        own.reserve(self.length + spare)
        return self._copy_into(own)

    @abstractmethod
    def _own_page_shape(self, block: int) -> tuple[int, ...]:
        """The shape of one own page of `block` rows."""


class PagedRows(RowPages):
    """Rows in the KV cache dtype: pages [P, 2, block, Hkv, D]; rows [i * block, (i + 1) * block) in page
    table[i]."""

    @classmethod
    def of_rows(cls, k: torch.Tensor, v: torch.Tensor, block: int, spare: int = 0) -> "PagedRows":
        """Own pages holding k, v [n, Hkv, D], with room for `spare` more rows."""
        n, Hkv, D = k.shape
        pages = k.new_empty(max(-(-(n + spare) // block), 1), 2, block, Hkv, D)
        rows = cls(pages, torch.arange(pages.shape[0]), 0, own=True)
        rows.write(0, k, v)
        return rows

    @property
    def block(self) -> int:
        return self.pages.shape[2]

    @property
    def capacity(self) -> int:
        return self.table.numel() * self.block

    @property
    def dtype(self) -> torch.dtype:
        return self.pages.dtype

    @property
    def row_shape(self) -> tuple[int, int]:
        """(Hkv, D)."""
        return self.pages.shape[3], self.pages.shape[4]

    @property
    def row_bytes(self) -> int:
        Hkv, D = self.row_shape
        return 2 * Hkv * D * self.pages.element_size()

    def _pages_for(self, rows: int) -> int:
        return -(-rows // self.block)

    def _own_page_shape(self, block: int) -> tuple[int, ...]:
        return (2, block, *self.row_shape)

    def _slots(self, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = torch.arange(start, start + n)
        return self.table[i // self.block], i % self.block

    def _encode(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return k.to(self.dtype), v.to(self.dtype)

    def _decode(self, rows: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return rows

    def _put(self, start: int, rows: tuple[torch.Tensor, torch.Tensor]) -> None:
        page, slot = self._slots(start, rows[0].shape[0])
        self.pages[page, 0, slot] = rows[0]
        self.pages[page, 1, slot] = rows[1]

    def _get(self, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        page, slot = self._slots(start, n)
        return self.pages[page, 0, slot], self.pages[page, 1, slot]

    def _move_heads(self, src: int, dst: torch.Tensor) -> None:
        heads = torch.arange(dst.numel(), device=dst.device)
        page, slot = self._slots(src, 1)
        self.pages[self.table[dst // self.block], :, dst % self.block, heads] = self.pages[page, :, slot, heads]

    def _in(self, pages: torch.Tensor, table: torch.Tensor | None) -> "PagedRows":
        if table is None:
            return PagedRows(pages, torch.arange(pages.shape[0]), 0, own=True)
        return PagedRows(pages, table, 0, own=False)

    def grow(self, n: int) -> None:
        """n more valid rows, written by the caller (the decode kernel) at [length - n, length)."""
        self.reserve(self.length + n)
        self.length += n
