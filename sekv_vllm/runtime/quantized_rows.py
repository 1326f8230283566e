"""Kept rows quantized (`methods.kv_quantization`), in pages: the bytes saved are pages handed back.

The listed pages are one byte stream: row i is bytes [i * row_bytes, (i + 1) * row_bytes) of the pages
in table order (a row may straddle two pages), so n rows need ceil(n * row_bytes / page_bytes) pages,
exactly the fast-tier bytes a method reports. In the engine's pages each page [2, block, Hkv, D] of the
KV cache dtype is read as its bytes.
"""
from __future__ import annotations

import torch

from sekv_vllm.methods.kv_quantization import KVQuantization
from sekv_vllm.runtime.paged_rows import RowPages


class QuantizedRows(RowPages):
    """pages: [P, page_bytes] uint8; the rows decode to `dtype` [.., Hkv, D]."""

    def __init__(self, pages: torch.Tensor, table: torch.Tensor, length: int, own: bool, codec: KVQuantization,
                 row_shape: tuple[int, int], dtype: torch.dtype) -> None:
        super().__init__(pages, table, length, own)
        self.codec, self.row_shape, self.dtype = codec, row_shape, dtype

    @classmethod
    def of_rows(cls, k: torch.Tensor, v: torch.Tensor, codec: KVQuantization, block: int,
                spare: int = 0) -> "QuantizedRows":
        """Own pages (`block` rows each) holding k, v [n, Hkv, D] quantized, with room for `spare` more rows."""
        n, Hkv, D = k.shape
        codec.check_head_size(D)
        rows = cls(torch.empty(0, block * codec.row_bytes(Hkv, D), dtype=torch.uint8, device=k.device),
                   torch.arange(0), 0, True, codec, (Hkv, D), k.dtype)
        rows.reserve(max(n + spare, 1))
        rows.write(0, k, v)
        return rows

    @property
    def page_bytes(self) -> int:
        return self.pages.shape[1]

    @property
    def row_bytes(self) -> int:
        return self.codec.row_bytes(*self.row_shape)

    @property
    def capacity(self) -> int:
        return self.table.numel() * self.page_bytes // self.row_bytes

    def _pages_for(self, rows: int) -> int:
        return -(-rows * self.row_bytes // self.page_bytes)

    def _own_page_shape(self, block: int) -> tuple[int, ...]:
        return (block * self.row_bytes,)

    def _bytes_at(self, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(page, offset) of every byte of rows [start, start + n): two [n * row_bytes] int64."""
        i = torch.arange(start * self.row_bytes, (start + n) * self.row_bytes, device=self.pages.device)
        return self.table.to(self.pages.device)[i // self.page_bytes], i % self.page_bytes

    def _encode(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.codec.encode(k, v)

    def _decode(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.codec.decode(rows, *self.row_shape, self.dtype)

    def _put(self, start: int, rows: torch.Tensor) -> None:
        page, offset = self._bytes_at(start, rows.shape[0])
        self.pages[page, offset] = rows.reshape(-1)

    def _get(self, start: int, n: int) -> torch.Tensor:
        if start == 0:  # whole pages in table order, then the rows' bytes: one gather of pages
            used = self._pages_for(n)
            return self.pages[self.table[:used]].reshape(-1)[: n * self.row_bytes].view(n, self.row_bytes)
        page, offset = self._bytes_at(start, n)
        return self.pages[page, offset].view(n, self.row_bytes)

    def _move_heads(self, src: int, dst: torch.Tensor) -> None:
        cells = self.codec.head_bytes(*self.row_shape, device=self.pages.device)  # [Hkv, bytes of one head]
        flat = dst.to(self.pages.device)[:, None] * self.row_bytes + cells
        self.pages[self.table.to(self.pages.device)[flat // self.page_bytes], flat % self.page_bytes] = \
            self._get(src, 1)[0][cells]

    def scrub(self) -> None:
        if not self.own:  # codes read as floats can be NaN: the pages go back zeroed
            with torch.inference_mode():  # the engine's cache is an inference tensor; this runs between steps
                self.pages[self.table.to(self.pages.device)] = 0

    def _in(self, pages: torch.Tensor, table: torch.Tensor | None) -> "QuantizedRows":
        if table is None:
            return QuantizedRows(pages, torch.arange(pages.shape[0]), 0, True, self.codec, self.row_shape, self.dtype)
        as_bytes = pages.view(pages.shape[0], -1).view(torch.uint8)  # a page is contiguous: its bytes
        return QuantizedRows(as_bytes, table, 0, False, self.codec, self.row_shape, self.dtype)
