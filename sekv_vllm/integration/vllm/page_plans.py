"""Which of a compressed request's vLLM pages go back to the pool, and which it keeps for its rows.

After compression the request keeps as many leading prompt pages as its fast tier needs (the pool
accounts for it) and its last, partly filled prompt page; every spanification of its window returns
the pages wholly inside the compressed rows but for their fast-tier share (rounded up once over all
windows, not per window). The ranges are filed with the page-returning manager (kv_pages.py), filed
again when a preempted request resumes, and read when its rows are placed in the pages it keeps.
"""
from __future__ import annotations

import math

from sekv_vllm.integration.vllm.version import PageRange, kv_pages
from sekv_vllm.runtime import EnginePages, RequestMemory, SpanifiedRows


class PagePlans:
    """The page ranges of every compressed request of one worker. block_size: vLLM's page size in
    tokens; block_bytes: the bytes of one page across every layer."""

    def __init__(self) -> None:
        self._ranges: dict[str, list[PageRange]] = {}

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._ranges

    def after_compression(self, mem: RequestMemory, block_size: int, block_bytes: int,
                          return_pages: bool) -> EnginePages:
        """File the prompt's range (with `return_pages`); returns the pages it holds and hands back."""
        prompt_pages = math.ceil(mem.prompt_len / block_size)
        held = prompt_pages
        if return_pages:
            keep = min(math.ceil(mem.figures.fast_tier_bytes / block_bytes), mem.prompt_len // block_size)
            self._ranges[mem.req_id] = [PageRange(keep, mem.prompt_len)]
            kv_pages.plan_release(mem.req_id, self._ranges[mem.req_id])
            held = keep + (prompt_pages - mem.prompt_len // block_size)
        return EnginePages(held * block_bytes, (prompt_pages - held) * block_bytes)

    def after_spanification(self, mem: RequestMemory, part: SpanifiedRows, block_size: int,
                            block_bytes: int) -> EnginePages | None:
        """File one more range: the pages wholly inside rows [.., part.stop) compressed now, after those an
        earlier range returned (a window smaller than `window` + growth may end inside them). Returns the
        request's pages now, None when nothing changed."""
        ranges, before = self._ranges.get(mem.req_id), mem.figures.pages
        if ranges is None or before is None:
            return None
        first = ranges[-1].end_token // block_size
        pages = max(part.stop // block_size - first, 0)
        if not pages:
            return None
        keep = max(min(math.ceil(mem.output_fast_tier_bytes / block_bytes) - before.output_pages_kept, pages), 0)
        ranges.append(PageRange(first + keep, part.stop))
        kv_pages.plan_release(mem.req_id, ranges)
        return EnginePages(before.held_bytes, before.returned_bytes + (pages - keep) * block_bytes,
                           before.output_pages_kept + keep)

    def refile(self, req_id: str) -> None:
        """A preempted request resumed: its pages were allocated again, the same ranges go back again."""
        if req_id in self._ranges:
            kv_pages.plan_release(req_id, self._ranges[req_id])

    def kept(self, req_id: str, block_ids: list[int], block_size: int) -> list[int]:
        """The request's block ids that no range returns, in block-table order."""
        ranges = self._ranges.get(req_id, [])
        return [b for i, b in enumerate(block_ids) if not any(r.first_block <= i < r.end_token // block_size
                                                                 for r in ranges)]

    def forget(self, req_id: str) -> None:
        self._ranges.pop(req_id, None)
        kv_pages.forget_plan(req_id)
