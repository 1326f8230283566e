"""RULER-style synthetic task families, built from a tokenizer and local text only.

Families (after NVIDIA/RULER, Apache-2.0; the templates are restated, not copied):
  needle, passkey                                                one needle, asked directly
  niah_single, niah_multikey, niah_multivalue, niah_multiquery   keyed needles in essay text
  vt                                                             variable tracking through noise
  cwe                                                            common words in a numbered list
  fwe                                                            frequent coded words (Zipf)

Every sample is deterministic in (task, target_tokens, depth, seed). Its user message is grown
unit by unit (essay sentences, noise lines, list words) and the unit count binary-searched so
that the message is the shortest one reaching `target_tokens` with the model's tokenizer.
The message is `context` then `question`; as RULER does, some families start the assistant's
turn with an answer prefix. Scoring is RULER's string_match_all: the share of expected strings
found in the output.
"""
from __future__ import annotations

import random
import re
import string
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

from sekv_vllm.tasks.haystack import sentences

CountTokens = Callable[[str], int]

# The benchmark suite evaluates on seeds >= EVAL_SEED_BASE; router training draws its seeds below
# DEV_SEED_BASE, so no evaluation sample is ever trained on (the same seed gives the same sample).
# Settings are tuned on the suite's dev split (seeds from DEV_SEED_BASE), never on its evaluation seeds.
EVAL_SEED_BASE = 1_000_000
DEV_SEED_BASE = 900_000


def token_counter(tokenizer) -> CountTokens:
    """Tokens of a text with the model's tokenizer, no special tokens added."""
    return lambda text: len(tokenizer(text, add_special_tokens=False).input_ids)


@dataclass(frozen=True)
class Sample:
    task: str
    seed: int
    target_tokens: int
    depth: float
    context: str  # the long part: instructions and haystack
    question: str
    answers: tuple[str, ...]
    answer_prefix: str = ""  # the assistant turn starts with it (RULER's answer prefix)

    @property
    def prompt(self) -> str:
        """The user message."""
        return f"{self.context}\n\n{self.question}"


def chat_prompt(sample: Sample, tokenizer) -> str:
    """The full prompt text: chat template (BOS as the template has it) plus the answer prefix."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": sample.prompt}], tokenize=False,
                                         add_generation_prompt=True)
    return text + sample.answer_prefix


def split_after_question(sample: Sample, tokenizer) -> tuple[str, str]:
    """chat_prompt cut where the user's turn ends: (the part a peer compresses, the rest).

    The compressed part holds the question too, as sekv's compressed prompt does; the rest is
    the end of the turn, the assistant header and the answer prefix.
    """
    text = chat_prompt(sample, tokenizer)
    cut = text.rindex(sample.question) + len(sample.question)
    return text[:cut], text[cut:]


@lru_cache(maxsize=1)
def _essay_words() -> tuple[str, ...]:
    """Distinct lowercase words of 5-10 letters from the essays: keys and list words."""
    seen: dict[str, None] = {}
    for sentence in sentences():
        for w in re.findall(r"\b[a-z]{5,10}\b", sentence):
            seen.setdefault(w, None)
    return tuple(seen)


def _key(rng: random.Random) -> str:
    words = _essay_words()
    return f"{rng.choice(words)}-{rng.choice(words)}"


def _number(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def _essay_units(rng: random.Random) -> Callable[[int], list[str]]:
    pool = sentences()
    start = rng.randrange(len(pool))
    return lambda n: [pool[(start + i) % len(pool)] for i in range(n)]


def _place(units: list[str], items: list[str], positions: list[int]) -> list[str]:
    """units with items[i] inserted before units[positions[i]] (at the end if past it), order kept."""
    slots: dict[int, list[str]] = {}
    for pos, item in zip(positions, items):
        slots.setdefault(min(pos, len(units)), []).append(item)
    out: list[str] = []
    for i in range(len(units) + 1):
        out.extend(slots.get(i, ()))
        if i < len(units):
            out.append(units[i])
    return out


def _spots(n: int, count: int, depth: float, seed: int) -> list[int]:
    """The first spot at `depth` of n units, the others later and random, ascending."""
    first = round(depth * n)
    rng = random.Random(seed * 7919 + n)
    return [first] + sorted(rng.randint(first, n) for _ in range(count - 1))


# -- families: each returns render(n_units) -> (context, question, answers, answer_prefix) --
def _niah(num_keys: int, num_values: int, num_queries: int):
    def family(rng: random.Random, depth: float):
        keys = [_key(rng) for _ in range(num_keys)]
        values = {k: [_number(rng) for _ in range(num_values)] for k in keys}
        needles = [f"One of the special magic numbers for {k} is: {v}." for k in keys for v in values[k]]
        rng.shuffle(needles)
        queried = keys[:num_queries]
        units = _essay_units(rng)
        if num_queries == 1:
            question = f"What are all the special magic numbers for {queried[0]} mentioned in the provided text?"
        else:
            question = ("What are all the special magic numbers for " + ", ".join(queried[:-1])
                        + f" and {queried[-1]} mentioned in the provided text?")
        answers = tuple(v for k in queried for v in values[k])
        # The first queried needle goes to the requested depth.
        first = next(i for i, n in enumerate(needles) if queried[0] in n)
        needles.insert(0, needles.pop(first))

        def render(n: int):
            body = " ".join(_place(units(n), needles, _spots(n, len(needles), depth, len(needles))))
            return (
                "Some special magic numbers are hidden within the following text. Make sure to memorize them. "
                f"I will quiz you about the numbers afterwards.\n\n{body}",
                question, answers, "",
            )

        return render

    return family


def _single(task: str):
    """One needle in essay text, asked for directly: the project's first benchmark tasks."""
    question, intro = {
        "needle": ("What is the special magic number mentioned in the text above? Answer with the number only.",
                   "Read the text below and answer the question."),
        "passkey": ("What is the pass key? Answer with the number only.",
                    "There is an important piece of information hidden inside a lot of irrelevant text. "
                    "Find it and memorize it. I will quiz you about it afterwards."),
    }[task]

    def family(rng: random.Random, depth: float):
        value = _number(rng)
        needle = (f"The pass key is {value}. Remember it. {value} is the pass key." if task == "passkey"
                  else f"The special magic number is: {value}.")
        units = _essay_units(rng)

        def render(n: int):
            body = " ".join(_place(units(n), [needle], [round(depth * n)]))
            return f"{intro}\n\n{body}", question, (value,), ""

        return render

    return family


_NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."


def _vt(rng: random.Random, depth: float, hops: int = 4):
    value = str(rng.randint(10_000, 99_999))
    names = ["".join(rng.choices(string.ascii_uppercase, k=5)) for _ in range(hops + 1)]
    chain = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i + 1]} = VAR {names[i]}." for i in range(hops)]
    # A one-line worked example, as RULER's template gives: without it the 135M model continues the
    # noise (full KV 0.00 at 1K-2K); with it, 0.24-0.36 at 1K-4K.
    example = ("For example, in \"VAR QPRTZ = 12345. VAR LMNOB = VAR QPRTZ. VAR WXYAC = VAR LMNOB.\" the "
               "variables assigned the value 12345 are QPRTZ, LMNOB, WXYAC.")

    def render(n: int):
        text = "\n".join(_place([_NOISE] * n, chain, _spots(n, len(chain), depth, hops)))
        question = (f"Find all variables that are assigned the value {value} in the text above. "
                    "Answer with the variable names only, separated by commas.")
        return (f"Memorize and track the chain(s) of variable assignment hidden in the following text. "
                f"{example}\n\n{text}", question, tuple(names), "")

    return render


# 5 common words 20 times each, not RULER's 10 x 10: the 135M model names two or three of the most
# common words before it repeats one (full KV 0.10 at 1K with 10 x 10, 0.30 with 5 x 20).
def _cwe(rng: random.Random, depth: float, common: int = 5, freq_common: int = 20, freq_rare: int = 2):
    words = list(_essay_words())
    rng.shuffle(words)
    common_words, rare_pool = words[:common], words[common:]

    def render(n: int):
        lst = [w for w in common_words for _ in range(freq_common)]
        lst += [w for w in rare_pool[:n] for _ in range(freq_rare)]
        random.Random(n).shuffle(lst)
        numbered = " ".join(f"{i + 1}. {w}" for i, w in enumerate(lst))
        question = (f"What are the {common} most common words in the list above? "
                    f"Answer with {common} different words, separated by commas.")
        return (f"Below is a numbered list of words. Memorize the ones that appear most often.\n\n{numbered}",
                question, tuple(common_words), "")

    return render


def _fwe(rng: random.Random, depth: float, alpha: float = 2.0, top: int = 3):
    vocab = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(3, 6))) for _ in range(2000)]

    def render(n: int):
        # Zipf counts over a fixed vocabulary, scaled to n words in all; the top words keep
        # strictly decreasing counts so the answer is unique.
        weights = [1 / (r + 1) ** alpha for r in range(len(vocab))]
        total = sum(weights)
        counts = [max(int(n * w / total), 0) for w in weights]
        counts[:top] = [max(c, counts[top] + top - i) for i, c in enumerate(counts[:top])]
        text = [w for w, c in zip(vocab, counts) for _ in range(c)]
        random.Random(n).shuffle(text)
        question = f"What are the {top} most frequently appearing coded words in the text above?"
        return (f"Read the following coded text and track the frequency of each coded word.\n\n{' '.join(text)}",
                question, tuple(vocab[:top]), f"The {top} most frequently appearing coded words are:")

    return render


# Answer lengths in tokens, per family, as RULER sets one per task: the instruct model restates
# the question before multi-key answers, so those need room.
MAX_TOKENS = {
    "needle": 24, "passkey": 24, "niah_single": 48, "niah_multikey": 48, "niah_multivalue": 80,
    "niah_multiquery": 80, "vt": 40, "cwe": 120, "fwe": 50,
}

FAMILIES = {
    "needle": _single("needle"),
    "passkey": _single("passkey"),
    "niah_single": _niah(1, 1, 1),
    "niah_multikey": _niah(4, 1, 1),
    "niah_multivalue": _niah(1, 4, 1),
    "niah_multiquery": _niah(4, 1, 4),
    "vt": _vt,
    "cwe": _cwe,
    "fwe": _fwe,
}


def make_sample(task: str, target_tokens: int, depth: float, seed: int, count_tokens: CountTokens) -> Sample:
    """The shortest message of `task` reaching `target_tokens` (model tokenizer), deterministic."""
    if task not in FAMILIES:
        raise ValueError(f"task: {task!r} is not one of {sorted(FAMILIES)}")
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth: {depth} is outside [0, 1]")
    render = FAMILIES[task](random.Random(f"{task}:{target_tokens}:{depth}:{seed}"), depth)
    def sample(n: int) -> Sample:
        return Sample(task, seed, target_tokens, depth, *render(n))

    hi = 16
    while count_tokens(sample(hi).prompt) < target_tokens:
        hi *= 2
    lo = 0
    while lo < hi:  # fewest units that reach the target
        mid = (lo + hi) // 2
        if count_tokens(sample(mid).prompt) >= target_tokens:
            hi = mid
        else:
            lo = mid + 1
    return sample(lo)


def score(answers: tuple[str, ...], output: str) -> float:
    """RULER string_match_all: share of expected strings in the output (case-insensitive)."""
    out = output.lower()
    return sum(a.lower() in out for a in answers) / len(answers)
