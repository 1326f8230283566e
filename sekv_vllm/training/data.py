"""Training texts: a prompt to compress and a continuation whose tokens are the decode queries.

Sources: essay text (the prompt is a run of essay sentences, the continuation the essay's next
tokens) and the RULER-style task families (chat prompt + the gold answer as continuation).
Seeds are below the suite's EVAL_SEED_BASE, so no evaluation sample is ever trained on.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from sekv_vllm.tasks.haystack import sentences
from sekv_vllm.tasks.ruler import EVAL_SEED_BASE, chat_prompt, make_sample, token_counter
from sekv_vllm.training.config import ESSAY, TrainConfig


@dataclass(frozen=True)
class TrainingText:
    """ids: [T] int64 prompt then continuation; prompt_len: T0.

    Query candidates are the positions p in [T0, T - 1): p is decoded with the prompt
    compressed and predicts token p + 1.
    """

    source: str
    seed: int
    ids: torch.Tensor
    prompt_len: int
    budget_ratio: float


def _essay(rng: random.Random, length: int, continuation: int, tok) -> tuple[list[int], int]:
    pool = sentences()
    start = rng.randrange(len(pool))
    ids: list[int] = []
    i = 0
    while len(ids) < length + continuation:
        ids += tok((" " if ids else "") + pool[(start + i) % len(pool)], add_special_tokens=False).input_ids
        i += 1
    return ids[: length + continuation], length


def _task(task: str, rng: random.Random, length: int, seed: int, tok) -> tuple[list[int], int]:
    sample = make_sample(task, length, rng.choice((0.1, 0.3, 0.5, 0.7, 0.9)), seed, token_counter(tok))
    prompt = tok(chat_prompt(sample, tok), add_special_tokens=False).input_ids
    answer = (" " if sample.answer_prefix else "") + ", ".join(sample.answers) + ".<|im_end|>"
    return prompt + tok(answer, add_special_tokens=False).input_ids, len(prompt)


def build_texts(config: TrainConfig, tok, *, heldout: bool) -> list[TrainingText]:
    """Deterministic in the config: sample i uses seed first_seed + i, its source and length drawn from it."""
    first = config.first_heldout_seed if heldout else config.first_train_seed
    count = config.heldout_samples if heldout else config.train_samples
    out = []
    for seed in range(first, first + count):
        if seed >= EVAL_SEED_BASE:
            raise ValueError(f"training seed {seed} is an evaluation seed (>= {EVAL_SEED_BASE})")
        rng = random.Random(f"train:{seed}")
        source = config.sources[seed % len(config.sources)]
        length = rng.choice(config.lengths)
        if source == ESSAY:
            ids, prompt_len = _essay(rng, length, config.essay_continuation, tok)
        else:
            ids, prompt_len = _task(source, rng, length, seed, tok)
        out.append(TrainingText(source, seed, torch.tensor(ids, dtype=torch.int64), prompt_len,
                                rng.choice(config.budget_ratios)))
    return out
