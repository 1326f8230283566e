"""Returning a compressed request's pages to vLLM's block pool (written against vLLM 0.32).

sekv's layers get `SeKVAttentionSpec`, a FullAttentionSpec whose manager is
`PageReturningManager` (registered in vLLM's KV-cache spec registry, grouped with full
attention, as the in-tree R-SWA spec is). When the runner bridge compresses a request it files
a `PageRange`: from the prompt's pages keep the first `first_block` (the fast tier's share of the
pool) and every page from the prompt's last, partly filled one on (generated tokens are written
there). Each time the request's window is spanified during decoding, one more range follows: the
pages wholly inside the compressed rows, after as many as their fast-tier share. On the request's
next allocation the manager frees the pages of every range and puts the null block in their
place, as the R-SWA manager frees its middle gap; the scheduler sees them free at once and
admits more requests. The worker's block table keeps the old ids, which is safe because a
compressed request's decode rows never reach vLLM's kernel: the runtime answers them from its
own rows. Plans live in this module: the scheduler and the worker share the engine-core
process on CPU (one worker, in-process executor).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, fields

from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import AttentionSpec, FullAttentionSpec
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

logger = logging.getLogger("sekv_vllm")


@dataclass(frozen=True, kw_only=True)
class SeKVAttentionSpec(FullAttentionSpec):
    """Full attention whose prompt pages are returned once sekv has compressed the request."""


@dataclass(frozen=True)
class PageRange:
    """Free the request's pages from `first_block` up to the last page wholly before `end_token`."""

    first_block: int
    end_token: int


_plans: dict[str, list[PageRange]] = {}
_freed_listeners: list[Callable[[str, bool], None]] = []
# Requests whose pages the scheduler is freeing because it preempts them (set by a wrap of
# Scheduler._preempt_request, shims.py).
preempting: set[str] = set()
# Pages returned to the pool so far in this process (a metric, and what the tests read).
returned_pages = 0


def on_request_freed(listener: Callable[[str, bool], None]) -> None:
    """Call `listener(req_id, preempted)` when the scheduler frees a request's pages (finished,
    aborted or preempted): the runner bridge frees its tiers then, not at the next step, which an
    idle engine would never run."""
    _freed_listeners.append(listener)


def plan_release(req_id: str, ranges: list[PageRange]) -> None:
    """File the page ranges of a compressed request (all so far); the manager frees them on its next
    allocation."""
    _plans[req_id] = list(ranges)


def forget_plan(req_id: str) -> None:
    """Drop the request's page ranges (a failed request: its pages are freed when it finishes)."""
    _plans.pop(req_id, None)


class PageReturningManager(FullAttentionManager):
    """FullAttentionManager that frees the page ranges filed for compressed requests."""

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        global returned_pages
        ranges = _plans.get(request_id)
        if not ranges:
            return
        blocks = self.req_to_blocks.get(request_id, [])
        before = sum(b is not self._null_block for b in blocks)
        # Pages wholly inside a range and already processed (a recompute processes them again); a
        # range's last, partly filled page is kept: the next range or the window fills the rest.
        for r in ranges:
            self._remove_blocks_in_range(request_id, r.first_block,
                                         min(r.end_token, processed_computed_tokens) // self.block_size)
        freed = before - sum(b is not self._null_block for b in blocks)
        if freed:
            returned_pages += freed
            logger.info("sekv: %s returned %d of its %d pages to vLLM's pool (%d kept)",
                        request_id, freed, before, before - freed)

    def free(self, request_id: str) -> None:
        _forget(request_id)
        super().free(request_id)

    def pop_blocks_for_free(self, request_id: str):
        _forget(request_id)
        return super().pop_blocks_for_free(request_id)


def _forget(request_id: str) -> None:
    _plans.pop(request_id, None)
    for listener in _freed_listeners:
        listener(request_id, request_id in preempting)


def sekv_spec(spec: AttentionSpec, vllm_config) -> AttentionSpec:
    """The same spec as SeKVAttentionSpec when it is plain full attention; others unchanged."""
    if type(spec) is not FullAttentionSpec:
        return spec
    # The registry registers vLLM's built-in specs only while it is empty: fill it first.
    KVCacheSpecRegistry._ensure_registered(vllm_config)
    KVCacheSpecRegistry.register(SeKVAttentionSpec, PageReturningManager, uniform_type_base_spec=FullAttentionSpec)
    return SeKVAttentionSpec(**{f.name: getattr(spec, f.name) for f in fields(spec)})
