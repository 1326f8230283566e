"""A page-selecting method's requests in the runtime (`PageSelectRunner`, methods/quest.py): the prompt's
pages into the host pool with their key bounds in the fast tier, then decode over the pages each step's
query ranks highest and the window (torch only).

The window (the prompt's last rows, then the output) lives in `PagedRows` like a row method's kept
rows, so it moves into vLLM's pages and survives preemption the same way. As the output grows, its
oldest whole pages go to the host pool as the prompt's did (one path, `_page_out`) and their vLLM
pages are returned. A budget that covers the whole prompt keeps every row in the window (nothing
paged, nothing to select: exact attention, as a row method at full budget).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch

from sekv_vllm.core import exact_attention
from sekv_vllm.methods.kv_quantization import KVQuantization
from sekv_vllm.methods.quest import Quest, box_scores, page_bounds, page_box, read_host_pages, to_host_pages, top_pages
from sekv_vllm.pool import HostPool
from sekv_vllm.runtime.figures import CompressionFigures
from sekv_vllm.runtime.method_runner import MethodRunner
from sekv_vllm.runtime.paged_rows import PagedRows, RowPages
from sekv_vllm.runtime.quantized_rows import QuantizedRows
from sekv_vllm.runtime.request_state import RequestMemory, SpanifiedRows, Status
from sekv_vllm.runtime.row_placement import leave_engine_pages

logger = logging.getLogger("sekv_vllm")


@dataclass
class SelectedPages:
    """A request's page state (`RequestMemory.method_state`).

    paged: positions [0, paged) are in host pages of every layer (pool key: the layer name; entry (k, v)
    [P, page_size, Hkv, D], or with `codec` their rows' codes ([P, page_size, row_bytes] uint8,); 0: nothing
    paged, every row in the window). codec: the request's KV quantization (None: rows as they are; window
    and pages alike). full_row, row: a row's bytes at the KV dtype and as kept. centre, half: per layer
    [P, Hkv, D] (KV dtype) the pages' key bounds as box centres and half-widths (`page_box`). budget_rows:
    the fast-tier rows (at the KV dtype) the request may hold for its paged text, window and pages read
    (grows with the output at the request's ratio). pages_per_step: pages read per KV head. window_rows: the
    prompt rows not paged (what the budget pays for beside the bounds and the pages read; the output's rows
    are not charged, as with every method).
    """

    paged: int
    budget_rows: int
    pages_per_step: int
    window_rows: int
    codec: KVQuantization | None
    full_row: int
    row: int
    centre: dict[str, torch.Tensor] = field(default_factory=dict)
    half: dict[str, torch.Tensor] = field(default_factory=dict)


def pages_read(budget_rows: int, pages: int, window_rows: int, page_size: int, full_row: int = 1,
               row: int = 1) -> int:
    """Pages read per KV head and step: what the budget leaves once the bounds (one row per page at the KV
    dtype: its key box) and the window are paid for; full_row, row: a row's bytes at the KV dtype and as kept
    (quantized rows: more pages for the same budget)."""
    left = (budget_rows - pages) * full_row - window_rows * row
    return min(max(left // (page_size * row), 0), pages)


class PageSelectRunner(MethodRunner):
    """Quest's requests; window rows go into pages of `block` rows with room for `spare` more; `growth`:
    rows the window may grow past `method.recent_rows` before its oldest pages go to the host pool (0: never)."""

    def __init__(self, method: Quest, layer_names: list[str], pool: HostPool, block: int, spare: int,
                 growth: int) -> None:
        self.method, self.layer_names, self.pool = method, layer_names, pool
        self.block, self.spare, self.growth = block, spare, growth

    def full_kv_reason(self, prompt_len: int, budget: int, kv_bits: int | None) -> str:
        m = self.method
        paged = m.paged_rows(prompt_len)
        if paged == 0:
            return (f"prompt ({prompt_len}) shorter than {m.name}'s recent_rows ({m.recent_rows}) + one page "
                    f"({m.page_size})")
        if m.kv_quantization(kv_bits) is None:  # quantized rows' bytes are known once the rows are (`compress`)
            return self._budget_reason(budget, prompt_len, paged, 1, 1)
        return ""

    def _budget_reason(self, budget: int, prompt_len: int, paged: int, full_row: int, row: int) -> str:
        m = self.method
        if budget < prompt_len and pages_read(budget, paged // m.page_size, prompt_len - paged, m.page_size,
                                              full_row, row) < 1:
            return (f"budget ({budget} rows) cannot hold {m.name}'s page bounds ({paged // m.page_size} rows), "
                    f"window ({prompt_len - paged}) and one page ({m.page_size})")
        return ""

    def compress(self, mem: RequestMemory) -> str:
        m, T = self.method, mem.prompt_len
        first = next(iter(mem.captured.values()))
        Hkv, D = first.k.shape[1:]
        codec, reason = m.request_quantization(mem.kv_bits, D)
        if reason:
            return reason
        full_row = 2 * Hkv * D * first.k.element_size()
        # A budget that covers the prompt reads every row: nothing to page or select.
        paged = 0 if mem.budget >= T else m.paged_rows(T)
        st = SelectedPages(paged=0, budget_rows=mem.budget, pages_per_step=0, window_rows=T - paged, codec=codec,
                           full_row=full_row, row=codec.row_bytes(Hkv, D) if codec else full_row)
        reason = self._budget_reason(mem.budget, T, paged, st.full_row, st.row) if paged else ""
        if reason:
            return reason
        rows = {name: mem.captured[name].view() for name in self.layer_names}
        if paged and not self._page_out(mem, st, rows, paged):
            return "host pool full"
        st.pages_per_step = self._pages_read(st)
        mem.method_state = st
        mem.next_position = first.length
        # Rows past the prompt (a resumed request's earlier output) stay in the window.
        mem.rows = {name: self._window(st, k[paged:], v[paged:], self.spare) for name, (k, v) in rows.items()}
        mem.captured = {}
        mem.status = Status.COMPRESSED
        mem.figures = self._figures(mem, st)
        logger.info("sekv: compressed %s with %s: %d prompt tokens -> %d host pages of %d rows, %d read per step; "
                    "fast tier %.1f%% of full KV", mem.req_id, m.name, T, paged // m.page_size, m.page_size,
                    st.pages_per_step, 100 * mem.figures.fast_tier_fraction)
        return ""

    def _pages_read(self, st: SelectedPages) -> int:
        return pages_read(st.budget_rows, st.paged // self.method.page_size, st.window_rows, self.method.page_size,
                          st.full_row, st.row)

    def _window(self, st: SelectedPages, k: torch.Tensor, v: torch.Tensor, spare: int) -> RowPages:
        """The window's rows k, v [n, Hkv, D] in pages of their own, quantized with the request's pages."""
        if st.codec is None:
            return PagedRows.of_rows(k, v, self.block, spare=spare)
        return QuantizedRows.of_rows(k, v, st.codec, self.block, spare=spare)

    def _page_out(self, mem: RequestMemory, st: SelectedPages, rows: dict[str, tuple[torch.Tensor, torch.Tensor]],
                  n: int) -> bool:
        """Rows [0, n) of every layer's rows (k, v [>= n, Hkv, D]; positions from st.paged on) into host pages
        beside the request's earlier ones, their bounds into the fast tier; False (nothing changed) when the
        host pool cannot take them."""
        page = self.method.page_size
        if not self.pool.fits(n * st.row * len(rows)):
            return False
        for name, (k, v) in rows.items():
            new = to_host_pages(k[:n], v[:n], page, st.codec)
            if st.paged:
                new = tuple(torch.cat(pair) for pair in zip(self.pool.load(mem.req_id, name), new))
            self.pool.store(mem.req_id, name, new, sum(t.nbytes for t in new))
            centre, half = page_box(*page_bounds(k[:n], page))
            st.centre[name] = torch.cat([st.centre[name], centre]) if name in st.centre else centre
            st.half[name] = torch.cat([st.half[name], half]) if name in st.half else half
        st.paged += n
        return True

    def _figures(self, mem: RequestMemory, st: SelectedPages) -> CompressionFigures:
        L = len(self.layer_names)
        pages = st.paged // self.method.page_size
        # the fast tier: bounds (one row per page, at the KV dtype), the window and the pages read per step
        fast_row_bytes = pages * st.full_row + (st.window_rows + st.pages_per_step * self.method.page_size) * st.row
        return CompressionFigures(
            mem.req_id, mem.method, mem.prompt_len, mem.budget, full_kv_bytes=mem.prompt_len * st.full_row * L,
            fast_tier_bytes=fast_row_bytes * L, host_pool_bytes=self.pool.owner_bytes(mem.req_id),
            own={"host_pages": pages, "page_size": self.method.page_size, "pages_per_step": st.pages_per_step,
                 "window_tokens": st.window_rows, "kv_bits": st.codec.bits if st.codec else 16})

    def attend(self, mems: list[RequestMemory], layer_name: str, q: torch.Tensor, scale: float,
               new_k: torch.Tensor | None, new_v: torch.Tensor | None) -> torch.Tensor:
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        for i, mem in enumerate(mems):
            st: SelectedPages = mem.method_state
            k, v = mem.rows[layer_name].view()
            if st.paged:
                scores = box_scores(q[i], st.centre[layer_name], st.half[layer_name], scale)
                chosen = top_pages(scores, st.pages_per_step)
                host = self.pool.load(mem.req_id, layer_name)
                k_read, v_read = read_host_pages(host, chosen, st.codec, k.shape[1:], k.dtype)
                k, v = torch.cat([k_read, k]), torch.cat([v_read, v])
            out[i] = exact_attention(q[i], k, v, scale)
            mem.decode_calls += 1
            mem.zoomed_spans_total += st.pages_per_step
        return out

    def window_due(self, mem: RequestMemory) -> bool:
        if not self.growth or mem.status is not Status.COMPRESSED or mem.suspended:
            return False
        st: SelectedPages = mem.method_state
        return (st.paged > 0 and mem.next_position - st.paged >= self.method.recent_rows + self.growth
                and mem.next_position >= mem.spanify_from)

    def grow_output(self, mem: RequestMemory) -> SpanifiedRows | None:
        """The window's oldest whole pages (all but its last `recent_rows` rows) go to the host pool; the budget
        grows with them at the request's ratio. None when the host pool cannot take them (logged; tried again
        `growth` rows later)."""
        st: SelectedPages = mem.method_state
        m, start = self.method, st.paged
        n = (mem.next_position - start - m.recent_rows) // m.page_size * m.page_size
        if n <= 0:
            return None
        rows = {name: mem.rows[name].view() for name in self.layer_names}
        pages_before = st.pages_per_step
        if not self._page_out(mem, st, rows, n):
            mem.spanify_from = mem.next_position + self.growth
            logger.warning("sekv: host pool full (%d of %d bytes used): request %s keeps its last %d rows in the "
                           "fast tier", self.pool.used_bytes, self.pool.capacity_bytes, mem.req_id,
                           mem.next_position - start)
            return None
        leave_engine_pages(mem)  # the window is rebuilt in pages of its own; some of its pages go back to vLLM
        mem.rows = {name: self._window(st, k[n:], v[n:], self.growth + 1) for name, (k, v) in rows.items()}
        st.budget_rows += math.ceil(n * mem.budget / mem.prompt_len)
        st.pages_per_step = self._pages_read(st)
        # the new pages' bounds and the rows read per step in more
        fast_bytes = (n // m.page_size * st.full_row
                      + (st.pages_per_step - pages_before) * m.page_size * st.row) * len(self.layer_names)
        mem.output_fast_tier_bytes += fast_bytes
        logger.info("sekv: %s: output rows %d-%d -> %d host pages; %d pages read per step", mem.req_id, start,
                    start + n, n // m.page_size, st.pages_per_step)
        return SpanifiedRows(start, start + n, 0, fast_bytes)
