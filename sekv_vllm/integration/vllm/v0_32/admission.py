"""Room for running requests to decode before a new one is admitted (written against vLLM 0.32).

vLLM admits a waiting request when its prompt fits the free pages (`scheduler_reserve_full_isl`); a
running request that then needs a page for its next token and finds none preempts the newest
request, which computes its whole prompt again. At full KV a request's output pages are few beside
its prompt's, so this is rare. A compressed request gives most of its prompt pages back, and the pages
its output takes become most of what it holds: the pool fills with requests whose next pages no one
kept room for, and the preemptions cost a prompt's forward pass each (32 requests of 4K tokens with 512
output tokens on a 1 GiB pool: 4 prompts computed twice).

Before each schedule the scheduler's watermark (the free pages a waiting or preempted request must
leave, vLLM's own admission knob) is set to the pages the running requests will still allocate over
their next `decode_room_tokens` tokens, up to each one's max_tokens and the model's length. Running
requests themselves allocate past it as before; a new request waits instead (it is queued, not lost).
"""
from __future__ import annotations

import logging

from vllm.v1.core.sched.scheduler import Scheduler

logger = logging.getLogger("sekv_vllm")


def pages_to_come(num_tokens: int, final_tokens: int, pages_in_table: int, room_tokens: int,
                  block_size: int) -> int:
    """Pages a request still allocates to grow from num_tokens by room_tokens, stopping at final_tokens.

    pages_in_table: its block table's length (pages given back stay listed, as the null block).
    """
    target = min(num_tokens + room_tokens, final_tokens)
    return max(-(-target // block_size) - pages_in_table, 0)


class DecodeRoom:
    """The admission gate of one scheduler: `before` sets the watermark, `after` logs when the first waiting
    request starts to wait because it fitted the free pages but not beside the room kept."""

    def __init__(self, room_tokens: int) -> None:
        self.room_tokens = room_tokens
        self.reserve = 0
        self._holding = False

    def before(self, scheduler: Scheduler) -> None:
        manager = scheduler.kv_cache_manager
        block_size = scheduler.cache_config.block_size
        tables = manager.coordinator.single_type_managers[0].req_to_blocks
        self.reserve = 0
        for request in scheduler.running:
            final = min(request.num_prompt_tokens + (request.max_tokens or 0), scheduler.max_model_len)
            self.reserve += pages_to_come(request.num_tokens, final, len(tables.get(request.request_id, ())),
                                          self.room_tokens, block_size)
        manager.watermark_blocks = self.reserve

    def after(self, scheduler: Scheduler) -> None:
        if not scheduler.waiting or not scheduler.running:
            self._holding = False
            return
        first = scheduler.waiting.peek_request()
        free = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
        pages = -(-first.num_tokens // scheduler.cache_config.block_size)
        held = pages <= free < pages + self.reserve
        if held and not self._holding:
            logger.info("sekv: %d requests wait: %d free pages, %d kept for the %d running requests' next "
                        "%d tokens (decode_room_tokens)", len(scheduler.waiting), free, self.reserve,
                        len(scheduler.running), self.room_tokens)
        self._holding = held
