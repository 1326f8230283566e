"""What `surprisal_exact_tokens` (the surprisal's log-sum-exp with a sampled tail) costs and changes.

    python -m benchmarks.perf.surprisal_tail                       # 3 essay prompts of 4K tokens
    python -m benchmarks.perf.surprisal_tail --exact-tokens 4096 8192 16384 --budgets 0.125 0.25

No engine: the default model in float32 (transformers) gives each prompt's final hidden states and its exact
surprisal (float32 logits over the whole vocabulary). Against it, per setting (0: the bfloat16 copy of the
output projection over every token, what sekv computes by default on CPUs with bfloat16 dot products; N: its
sampled tail past token id N), in the same run: the time of the surprisal of the whole prompt as sekv computes
it (chunks of 256 rows in one reused buffer; median of 3), the error against the exact surprisal (mean, p99,
max over the prompt's tokens), and what it changes where sekv reads it: the prompt's layout at each budget
(`plan_layout` with the defaults and the shipped router's costs: the span starts and the rows kept at full
resolution that differ from the exact surprisal's, as a share of those) and the span summaries' weights
(the largest change of a token's weight within its span). Results: benchmarks/results/surprisal_tail_cpu.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.engine import command_line, machine
from benchmarks.perf.run import essay_prompts

RESULTS = Path(__file__).resolve().parents[1] / "results"
CHUNK = 256  # rows per product, as the runner bridge computes them


def prompt_surprisal(head, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """sekv's surprisal of one prompt's rows: [n] float32."""
    buffer = head.logit_buffer(min(CHUNK, hidden.shape[0]))
    return torch.cat([head.surprisal(hidden[a:a + CHUNK], targets[a:a + CHUNK], buffer)
                      for a in range(0, hidden.shape[0], CHUNK)])


def differing_share(a: torch.Tensor, b: torch.Tensor) -> float:
    """Share of the positions in either set that are not in both."""
    sa, sb = set(a.tolist()), set(b.tolist())
    return len(sa ^ sb) / max(len(sa | sb), 1)


def weight_change(s: torch.Tensor, exact: torch.Tensor, span_start: torch.Tensor, span_len: torch.Tensor) -> float:
    """The largest change of a token's summary weight (its surprisal's share of its span's) against exact."""
    from sekv_vllm.core.span_summary import span_token_index

    index, valid = span_token_index(span_start, span_len)

    def weights(x: torch.Tensor) -> torch.Tensor:
        w = x[index].clamp(min=0) * valid
        return w / w.sum(dim=1, keepdim=True).clamp(min=1e-30)

    return float((weights(s) - weights(exact)).abs().max()) if span_start.numel() else 0.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--length", type=int, default=4000)
    parser.add_argument("--exact-tokens", nargs="+", type=int, default=[4096, 8192, 16384])
    parser.add_argument("--budgets", nargs="+", type=float, default=[0.125, 0.25])
    parser.add_argument("--out", type=Path, default=RESULTS / "surprisal_tail_cpu.json")
    args = parser.parse_args(argv)
    if any(n < 0 for n in args.exact_tokens):
        parser.error("--exact-tokens: every value must be >= 0")

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sekv_vllm.config import SeKVConfig
    from sekv_vllm.core.surprisal import LogitHead, bfloat16_is_fast, token_surprisal
    from sekv_vllm.entrypoints.default_model import MODEL_NAME, prepare_default_model
    from sekv_vllm.policies import make_policy
    from sekv_vllm.router import ModelShape
    from sekv_vllm.runtime.span_budget import SpanCosts, plan_layout

    path = str(prepare_default_model())
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    shape = ModelShape(cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, head_dim)
    policy = make_policy("router", shape=shape, model_name=MODEL_NAME)
    costs = SpanCosts.of_rows(shape.num_kv_heads, head_dim, 4, policy.span_feature_nbytes(0))  # float32 rows
    config = SeKVConfig()
    dtype = torch.bfloat16 if bfloat16_is_fast(torch.device("cpu")) else torch.float32
    weight = model.lm_head.weight.detach().to(dtype).contiguous()
    settings = [0, *args.exact_tokens]
    rows: dict[str, dict[str, list[float]]] = {str(n): {} for n in settings}
    for ids in essay_prompts(tok, args.length, args.prompts):
        ids = torch.tensor(ids)
        with torch.no_grad():
            out = model(ids[None], output_hidden_states=True)
        hidden, targets = out.hidden_states[-1][0, :-1], ids[1:]
        exact = torch.cat([torch.zeros(1), token_surprisal(out.logits[0, :-1], targets)])  # s_0 = 0, as sekv's
        plans = {b: plan_layout(exact, b * args.length, config, costs).layout for b in args.budgets}
        for n in settings:
            head = LogitHead(weight, exact_tokens=n)
            prompt_surprisal(head, hidden, targets)  # first-call costs
            times = []
            for _ in range(3):
                start = time.perf_counter()
                s = prompt_surprisal(head, hidden, targets)
                times.append(time.perf_counter() - start)
            s = torch.cat([torch.zeros(1), s])
            err = (s - exact).abs()[1:]
            got = rows[str(n)]
            for key, value in (("seconds", statistics.median(times)), ("mean_abs_error", err.mean()),
                               ("p99_abs_error", err.quantile(0.99)), ("max_abs_error", err.max())):
                got.setdefault(key, []).append(float(value))
            for b, want in plans.items():
                layout = plan_layout(s, b * args.length, config, costs).layout
                got.setdefault(f"span_starts_differing_{b}", []).append(differing_share(layout.span_start, want.span_start))
                got.setdefault(f"full_rows_differing_{b}", []).append(differing_share(layout.fixed_pos, want.fixed_pos))
                got.setdefault(f"max_summary_weight_change_{b}", []).append(
                    weight_change(s, exact, want.span_start, want.span_len))
    result = {
        "command": command_line("benchmarks.perf.surprisal_tail", argv), "model": MODEL_NAME, "machine": machine(),
        "prompts": args.prompts, "length": args.length, "product_dtype": str(dtype).removeprefix("torch."),
        "vocabulary": int(weight.shape[0]),
        "settings": {n: {k: round(statistics.mean(v), 4) for k, v in r.items()} for n, r in rows.items()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result["settings"], indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
