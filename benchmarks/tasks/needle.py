"""Needle-in-a-haystack and passkey samples of an exact token length, deterministic by seed."""
from __future__ import annotations

import random
from dataclasses import dataclass

from benchmarks.tasks.haystack import sentences


@dataclass(frozen=True)
class Sample:
    task: str
    seed: int
    target_tokens: int
    depth: float
    prompt: str  # the user message (the chat template is applied by the runner)
    answer: str


QUESTION = {
    "needle": "What is the special magic number mentioned in the text above? Answer with the number only.",
    "passkey": "What is the pass key? The pass key is",
}


def _needle(task: str, rng: random.Random) -> tuple[str, str]:
    value = str(rng.randint(1_000_000, 9_999_999))
    if task == "passkey":
        return f"The pass key is {value}. Remember it. {value} is the pass key.", value
    return f"The special magic number is: {value}.", value


def make_sample(task: str, target_tokens: int, depth: float, seed: int, count_tokens) -> Sample:
    """A haystack of essay sentences (random start) with the needle at `depth` (0..1).

    count_tokens(text) -> int measures the user message with the model's tokenizer; the
    haystack is grown sentence by sentence until the message reaches `target_tokens`.
    """
    if task not in QUESTION:
        raise ValueError(f"task: {task!r} is not one of {sorted(QUESTION)}")
    rng = random.Random(f"{task}:{target_tokens}:{depth}:{seed}")
    needle, answer = _needle(task, rng)
    pool = sentences()
    start = rng.randrange(len(pool))
    chosen: list[str] = []

    def render(parts: list[str]) -> str:
        at = round(depth * len(parts))
        body = " ".join(parts[:at] + [needle] + parts[at:])
        return f"Read the text below and answer the question.\n\n{body}\n\n{QUESTION[task]}"

    # Grow by doubling, then binary-search the length: few tokenizer calls.
    step = 16
    while count_tokens(render(chosen)) < target_tokens:
        chosen.extend(pool[(start + len(chosen) + i) % len(pool)] for i in range(step))
        step *= 2
    lo, hi = 0, len(chosen)
    while lo < hi:  # fewest sentences that reach the target
        mid = (lo + hi) // 2
        if count_tokens(render(chosen[:mid])) >= target_tokens:
            hi = mid
        else:
            lo = mid + 1
    chosen = chosen[:lo]
    return Sample(task, seed, target_tokens, depth, render(chosen), answer)


def score(answer: str, output: str) -> float:
    """RULER-style string match: 1.0 if the expected value appears in the output."""
    return float(answer in output)
