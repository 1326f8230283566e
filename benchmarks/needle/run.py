"""Needle / passkey retrieval at 1K-4K tokens: stock vLLM (full KV) vs sekv at several budgets.

    python -m benchmarks.needle.run                      # writes benchmarks/results/needle_cpu.json
    python -m benchmarks.needle.run --lengths 1000 --samples 1 --out /tmp/x.json   # quick look

Accuracy: every sample x budget in one batched `generate` per engine (continuous batching),
greedy, scored by string match. Speed: one sample per length at batch 1, prefill time
(max_tokens=1) and decode seconds per token ((t(1+N) - t(1)) / N), each sekv budget next to
stock vLLM in the same run, reported as ratios. Fast-tier bytes come from the plugin's
figures for each compressed request. Prefix caching is off in both engines.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

from benchmarks.engine import make_llm, run_in_subprocess, timed_generate
from benchmarks.tasks.ruler import make_sample, score

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "results" / "needle_cpu.json"
DECODE_TOKENS = 32


def worker(spec: dict) -> dict:
    from vllm import SamplingParams

    llm = make_llm(spec["model"], spec["sekv"], spec["max_model_len"])
    tok = llm.get_tokenizer()
    count = lambda text: len(tok(text, add_special_tokens=False).input_ids)  # noqa: E731

    def chat(text: str) -> str:
        return tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)

    samples = [make_sample(task, n, depth, seed, count)
               for task in spec["tasks"] for n in spec["lengths"]
               for seed, depth in enumerate(spec["depths"][: spec["samples"]])]
    budgets = spec["budgets"] or [None]

    def params(budget, max_tokens):
        extra = {"sekv_budget_ratio": budget} if budget is not None else None
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, extra_args=extra)

    jobs = [(s, b) for s in samples for b in budgets]
    outputs, seconds = timed_generate(llm, [chat(s.prompt) for s, _ in jobs], [params(b, 24) for _, b in jobs])
    figures = {}
    if spec["sekv"] is not None:
        from sekv_vllm.integration.vllm.runner_bridge import figures_by_request_id

        figures = figures_by_request_id()
    records = []
    for (s, b), out in zip(jobs, outputs):
        fig = figures.get(out.request_id)
        records.append({
            "task": s.task, "target_tokens": s.target_tokens, "depth": s.depth, "seed": s.seed,
            "prompt_tokens": len(out.prompt_token_ids), "budget_ratio": b, "answers": s.answers,
            "output": out.outputs[0].text, "score": score(s.answers, out.outputs[0].text),
            "fast_tier_bytes": fig["fast_tier_bytes"] if fig else None,
            "full_kv_bytes": fig["full_kv_bytes"] if fig else None,
            "host_pool_bytes": fig["host_pool_bytes"] if fig else None,
            "spans": fig["spans"] if fig else None,
            "mean_zoomed_spans": fig["mean_zoomed_spans"] if fig else None,
        })

    timings = []
    for n in spec["lengths"]:
        s = next(x for x in samples if x.target_tokens == n)
        for b in budgets:
            _, t_prefill = timed_generate(llm, [chat(s.prompt)], [params(b, 1)])
            _, t_total = timed_generate(llm, [chat(s.prompt)], [params(b, 1 + DECODE_TOKENS)])
            timings.append({"target_tokens": n, "budget_ratio": b, "prefill_s": t_prefill,
                            "decode_s_per_token": (t_total - t_prefill) / DECODE_TOKENS})
    return {"records": records, "timings": timings, "accuracy_batch_seconds": seconds}


def summarize(stock: dict, sekv: dict, budgets: list[float]) -> dict:
    rows = []
    for n in sorted({r["target_tokens"] for r in stock["records"]}):
        st = [r for r in stock["records"] if r["target_tokens"] == n]
        st_time = next(t for t in stock["timings"] if t["target_tokens"] == n)
        rows.append({"backend": "vllm full KV", "target_tokens": n, "budget_ratio": 1.0,
                     "accuracy": statistics.mean(r["score"] for r in st), "fast_tier_fraction": 1.0,
                     "prefill_ratio": 1.0, "decode_ratio": 1.0, "prefill_s": st_time["prefill_s"],
                     "decode_s_per_token": st_time["decode_s_per_token"]})
        for b in budgets:
            rs = [r for r in sekv["records"] if r["target_tokens"] == n and r["budget_ratio"] == b]
            t = next(t for t in sekv["timings"] if t["target_tokens"] == n and t["budget_ratio"] == b)
            frac = [r["fast_tier_bytes"] / r["full_kv_bytes"] for r in rs if r["fast_tier_bytes"]]
            rows.append({"backend": "sekv", "target_tokens": n, "budget_ratio": b,
                         "accuracy": statistics.mean(r["score"] for r in rs),
                         "fast_tier_fraction": statistics.mean(frac) if frac else None,
                         "host_pool_fraction": statistics.mean(r["host_pool_bytes"] / r["full_kv_bytes"] for r in rs if r["host_pool_bytes"]) if frac else None,
                         "mean_zoomed_spans": statistics.mean(r["mean_zoomed_spans"] for r in rs if r["mean_zoomed_spans"] is not None) if frac else None,
                         "prefill_s": t["prefill_s"], "decode_s_per_token": t["decode_s_per_token"],
                         "prefill_ratio": t["prefill_s"] / st_time["prefill_s"],
                         "decode_ratio": t["decode_s_per_token"] / st_time["decode_s_per_token"]})
    return {"rows": rows}


def print_table(summary: dict) -> None:
    print(f"{'backend':<14}{'tokens':>7}{'budget':>8}{'acc':>6}{'fast tier':>11}{'prefill x':>11}{'decode x':>10}")
    for r in summary["rows"]:
        ft = f"{100 * r['fast_tier_fraction']:.1f}%" if r["fast_tier_fraction"] is not None else "-"
        print(f"{r['backend']:<14}{r['target_tokens']:>7}{r['budget_ratio']:>8.3f}{r['accuracy']:>6.2f}{ft:>11}"
              f"{r['prefill_ratio']:>11.2f}{r['decode_ratio']:>10.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--model", default=None)
    parser.add_argument("--tasks", nargs="+", default=["needle", "passkey"])
    parser.add_argument("--lengths", nargs="+", type=int, default=[1000, 2000, 4000])
    parser.add_argument("--samples", type=int, default=3, help="samples per task and length (needle depths)")
    parser.add_argument("--budgets", nargs="+", type=float, default=[0.5, 0.25, 0.125])
    parser.add_argument("--sekv-config", default="{}", help="JSON SeKVConfig fields for the sekv engine")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    if args.worker:
        print("RESULT " + json.dumps(worker(json.loads(args.worker))))
        return 0
    for b in args.budgets:
        if not 0 < b <= 1:
            parser.error(f"--budgets: {b} is outside (0, 1]")
    from sekv_vllm.entrypoints.default_model import prepare_default_model

    model = args.model or str(prepare_default_model())
    spec = {"model": model, "tasks": args.tasks, "lengths": args.lengths, "samples": args.samples,
            "depths": [0.2, 0.5, 0.8, 0.35, 0.65][: max(args.samples, 1)], "max_model_len": max(args.lengths) + 512}
    start = time.time()
    stock = run_in_subprocess("benchmarks.needle.run", {**spec, "sekv": None, "budgets": []}, stock=True)
    print(f"stock vLLM done in {time.time() - start:.0f} s", file=sys.stderr)
    sekv = run_in_subprocess("benchmarks.needle.run",
                             {**spec, "sekv": json.loads(args.sekv_config), "budgets": args.budgets}, stock=False)
    summary = summarize(stock, sekv, args.budgets)
    result = {
        "command": "python -m benchmarks.needle.run " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {"cpu_count": __import__("os").cpu_count(), "platform": platform.platform()},
        "model": Path(model).name, "spec": spec, "sekv_config": json.loads(args.sekv_config),
        "seconds": round(time.time() - start), "summary": summary,
        "stock": stock, "sekv": sekv,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print_table(summary)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
