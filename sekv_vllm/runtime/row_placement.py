"""Where a compressed request's full-resolution rows live: the engine's pages once it hands them over,
pages of sekv's own before that, while preempted, or when the engine's ran out (torch only)."""
from __future__ import annotations

import logging

import torch

from sekv_vllm.runtime.request_state import RequestMemory

logger = logging.getLogger("sekv_vllm")
# Rows per page of a request's own pages (before the engine's are handed over, and in tests).
OWN_BLOCK = 64


def place_rows(mem: RequestMemory, pages: dict[str, torch.Tensor], table: torch.Tensor) -> bool:
    """Move the rows of every layer into the engine's pages: pages[layer] [P, 2, block, Hkv, D] (the engine's
    KV cache of that layer, reinterpreted), table [m] int64 the request's pages in the order its rows fill
    them (the kept ones; later ones come with `add_pages`). False (rows left where they are, logged) when
    they do not fit."""
    name, first = next(iter(mem.rows.items()))
    if not first.fits(pages[name], table):
        logger.warning("sekv: %s: %d rows do not fit its %d kept pages; they stay in sekv's own memory",
                       mem.req_id, first.length, table.numel())
        return False
    for name, rows in mem.rows.items():
        mem.rows[name] = rows.place(pages[name], table)
    return True


def add_pages(mem: RequestMemory, table: torch.Tensor) -> None:
    """More engine pages for rows in the engine's pages (the output grows): table [m] int64."""
    for rows in mem.rows.values():
        if not rows.own:
            rows.table = torch.cat([rows.table, table.to(torch.int64)])


def in_engine_pages(mem: RequestMemory | None) -> bool:
    return mem is not None and bool(mem.rows) and not next(iter(mem.rows.values())).own


def make_room(mem: RequestMemory, layer_name: str, n: int, spare: int) -> None:
    """Room for n more rows in a layer; engine pages that ran out (the engine handed none over in time) are
    left for pages of sekv's own with `spare` more rows, logged: the request goes on."""
    rows = mem.rows[layer_name]
    if rows.own or rows.length + n <= rows.capacity:
        return
    logger.warning("sekv: %s: its engine pages are full; its rows move to sekv's own memory", mem.req_id)
    rows_to_own_pages(mem, spare=spare + n)


def rows_to_own_pages(mem: RequestMemory, spare: int) -> None:
    """Copy the rows out of the engine's pages into pages of the request's own (room for `spare` more)."""
    for name, rows in mem.rows.items():
        if not rows.own:
            mem.rows[name] = rows.to_own(OWN_BLOCK, spare)
            rows.scrub()


def leave_engine_pages(mem: RequestMemory) -> None:
    """The request's rows no longer live in the engine's pages they are in (it ended, or they are rebuilt in
    pages of its own): those pages go back to vLLM holding values it can read (`RowPages.scrub`)."""
    for rows in mem.rows.values():
        rows.scrub()
