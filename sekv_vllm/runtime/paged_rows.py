"""A compressed request's full-resolution K/V rows of one layer, kept in pages.

The pages are the serving engine's own (vLLM's KV cache: the pages a compressed request keeps,
reinterpreted, since vLLM never reads them again for it) or, until the engine hands them over
(and in tests, benchmarks, a preempted request), pages this object allocates itself.
Layout of one page: its K rows, then its V rows: pages [P, 2, block, Hkv, D]; `table` lists the
page of every `block` rows, in row order.
"""
from __future__ import annotations

import torch


class PagedRows:
    """pages: [P, 2, block, Hkv, D]; table: [n] int64 page ids (rows [i * block, (i + 1) * block) in
    page table[i]); the first `length` rows are valid. `own` pages grow (double) when full; the
    engine's do not: `place` hands more over."""

    def __init__(self, pages: torch.Tensor, table: torch.Tensor, length: int, own: bool) -> None:
        self.pages = pages
        self.table = table
        self.length = length
        self.own = own

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

    def _slots(self, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = torch.arange(start, start + n)
        return self.table[i // self.block], i % self.block

    def write(self, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Rows [start, start + n) = k, v [n, Hkv, D]; rows before start must be valid."""
        n = k.shape[0]
        self.reserve(start + n)
        page, slot = self._slots(start, n)
        self.pages[page, 0, slot] = k.to(self.dtype)
        self.pages[page, 1, slot] = v.to(self.dtype)
        self.length = max(self.length, start + n)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.write(self.length, k, v)

    def grow(self, n: int) -> None:
        """n more valid rows, written by the caller (the decode kernel) at [length - n, length)."""
        self.reserve(self.length + n)
        self.length += n

    def reserve(self, rows: int) -> None:
        """Room for `rows` rows: own pages double; the engine's must have been handed over."""
        if rows <= self.capacity:
            return
        if not self.own:
            raise RuntimeError(f"paged rows: {rows} rows need more than the {self.table.numel()} pages handed over")
        more = max(-(-rows // self.block), 2 * self.table.numel()) - self.table.numel()
        self.pages = torch.cat([self.pages[self.table], self.pages.new_empty(more, *self.pages.shape[1:])])
        self.table = torch.arange(self.pages.shape[0])

    def view(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the valid rows: k, v [length, Hkv, D]."""
        page, slot = self._slots(0, self.length)
        return self.pages[page, 0, slot], self.pages[page, 1, slot]

    def place(self, pages: torch.Tensor, table: torch.Tensor) -> "PagedRows":
        """The same rows written into other pages (the engine's): pages [P', 2, block, Hkv, D], table [m]
        (enough for the rows)."""
        if table.numel() * pages.shape[2] < self.length:
            raise ValueError(f"paged rows: {table.numel()} pages of {pages.shape[2]} rows cannot hold {self.length} rows")
        k, v = self.view()
        placed = PagedRows(pages, table.to(torch.int64), 0, own=False)
        placed.write(0, k, v)
        return placed
