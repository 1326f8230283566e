"""The suite's offline jobs run batch by batch in one engine, every sekv sample compressed.

A batch's requests share the engine's host pool; when it is full, the runtime serves a request at
full KV (it degrades, logs it and gives no compression figures). Such a sample measures nothing of
the method, so it runs again in a batch half as large, and is kept as it is only when it ran alone
(8K prompts: ~370 MB each, so a batch of 16 needs ~5.9 GB of host pool; the engine's default is 4 GiB). The suite's
records (`benchmarks.suite.run`) and the forced fidelity runs (`benchmarks.suite.fidelity`) both run
their jobs through `run_batches`.
"""
from __future__ import annotations

import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

BATCH = 16


def batches(jobs: list[dict]) -> list[list[dict]]:
    """Jobs grouped by (task, length), cut into batches of at most BATCH."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for job in jobs:
        groups[(job["task"], job["length"])].append(job)
    return [g[i : i + BATCH] for g in groups.values() for i in range(0, len(g), BATCH)]


@dataclass(frozen=True)
class BatchDone:
    """One batch's samples to record: jobs[i] with its input's `item` (what `inputs` gave beside its prompt), its
    vLLM RequestOutput and its compression figures (None: it kept full KV, or the engine is stock vLLM);
    seconds and size: the batch's wall time and requests; again: its samples left to run again."""

    jobs: list[dict]
    items: list[Any]
    outputs: list[Any]
    figures: list[dict | None]
    seconds: float
    size: int
    again: int


def run_batches(llm, jobs: list[dict], inputs: Callable[[list[dict]], tuple[list, list[str], list]],
                compressed: bool, label: str) -> Iterator[BatchDone]:
    """LLM.generate per batch of `jobs`; inputs(batch) -> (items, prompts, sampling params), one each per job.
    compressed: the engine runs sekv, whose samples served at full KV beside their batch run again."""
    pending = batches(jobs)
    while pending:
        batch = pending.pop(0)
        items, prompts, params = inputs(batch)
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        figures: dict = {}
        if compressed:
            from sekv_vllm.integration.vllm.runner_bridge import figures_by_request_id

            figures = figures_by_request_id()
        kept = [compressed and len(batch) > 1 and o.request_id not in figures for o in outputs]
        again = [j for j, k in zip(batch, kept) if k]
        if again:
            half = max(len(batch) // 2, 1)
            pending[:0] = [again[i : i + half] for i in range(0, len(again), half)]
            print(f"{label}: {len(again)} of {len(batch)} samples kept full KV beside their batch "
                  f"(host pool full); running them again in batches of {half}", file=sys.stderr)
        done = [i for i, k in enumerate(kept) if not k]
        yield BatchDone([batch[i] for i in done], [items[i] for i in done], [outputs[i] for i in done],
                        [figures.get(outputs[i].request_id) for i in done], seconds, len(batch), len(again))
