"""The main job on the default model: a needle question in a ~2K-token essay haystack,
answered by stock vLLM (full KV) and by sekv at a 25% budget, with sekv's figures.

    bash scripts/demo.sh            (set-up included)
    python -m benchmarks.demo --tokens 4000 --budget 0.125
"""
from __future__ import annotations

import argparse
import sys

from benchmarks.engine import make_llm, run_in_subprocess, timed_generate, worker_or_model
from sekv_vllm.tasks.ruler import chat_prompt, make_sample, score, token_counter


def worker(spec: dict) -> dict:
    from vllm import SamplingParams

    llm = make_llm(spec["model"], spec["sekv"], spec["tokens"] + 512)
    tok = llm.get_tokenizer()
    sample = make_sample("needle", spec["tokens"], spec["depth"], 0, token_counter(tok))
    prompt = chat_prompt(sample, tok)
    outputs, seconds = timed_generate(llm, [prompt], [SamplingParams(temperature=0.0, max_tokens=24)])
    figures = None
    if spec["sekv"] is not None:
        from sekv_vllm.integration.vllm.runner_bridge import request_figures

        figures = next(iter(request_figures()), None)
    out = outputs[0]
    return {"prompt_tokens": len(out.prompt_token_ids), "needle": sample.answers[0], "answer": out.outputs[0].text,
            "found": score(sample.answers, out.outputs[0].text) == 1.0, "seconds": round(seconds, 1), "sekv": figures}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--depth", type=float, default=0.5)
    parser.add_argument("--budget", type=float, default=0.25)
    args = parser.parse_args(argv)
    model = worker_or_model(args.worker, worker)
    if model is None:
        return 0
    spec = {"model": model, "tokens": args.tokens, "depth": args.depth}
    print(f"needle at depth {args.depth} of a ~{args.tokens}-token essay haystack (SmolLM2-135M-Instruct, CPU)\n")
    stock = run_in_subprocess("benchmarks.demo", {**spec, "sekv": None}, stock=True)
    print(f"stock vLLM, full KV   ({stock['seconds']} s): {stock['answer']!r}  needle {stock['needle']} "
          f"{'found' if stock['found'] else 'NOT found'}")
    sekv = run_in_subprocess("benchmarks.demo", {**spec, "sekv": {"budget_ratio": args.budget}}, stock=False)
    print(f"sekv, budget {args.budget:.0%} ({sekv['seconds']} s): {sekv['answer']!r}  needle {sekv['needle']} "
          f"{'found' if sekv['found'] else 'NOT found'}")
    fig = sekv["sekv"]
    if fig:
        print(f"\nsekv figures for the {fig['prompt_tokens']}-token prompt:")
        print(f"  {fig['spans']} spans holding {fig['span_tokens']} tokens; {fig['anchor_and_short_tokens']} anchor/short "
              f"tokens and {fig['window_tokens']} window tokens at full resolution")
        print(f"  fast tier needed: {fig['fast_tier_bytes'] / 2**20:.2f} MiB = {fig['fast_tier_fraction']:.1%} of full KV "
              f"({fig['full_kv_bytes'] / 2**20:.2f} MiB)")
        print(f"  host pool (span bases): {fig['host_pool_bytes'] / 2**20:.2f} MiB")
        print(f"  vLLM pages kept: {fig['vllm_pages_held_bytes'] / 2**20:.2f} MiB; "
              f"returned to vLLM's pool: {fig['vllm_pages_returned_bytes'] / 2**20:.2f} MiB")
        print(f"  mean spans zoomed per layer and step: {fig['mean_zoomed_spans']:.1f} of {fig['spans']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
