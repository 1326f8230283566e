"""Long outputs: what the window's spanification does to pages held, decode speed and the output.

    python -m benchmarks.perf.long_output                     # 4 x 2K-token prompts, 1024 output tokens each
    python -m benchmarks.perf.long_output --length 1000 --decode-tokens 512 --requests 2

Three engines, each in its own process, get the same prompts (distinct essay texts, greedy,
ignore_eos): stock vLLM; sekv with the output kept at full resolution (`window_growth: 0`); sekv
spanifying its window every `--growth` rows (the default setting, 256). Each engine is stepped
by hand. Per step: output tokens so far and the vLLM pages the requests hold (null pages, the
returned ones, excluded). Reported per engine: pages held per request at the end and over the
run, decode tokens/s over the pure-decode steps, and the outputs' agreement with stock vLLM's
(share of output positions with the same token, and the first position where they differ), and
for the spanifying engine with the output-kept one's (same budget: what spanification changes);
for sekv, the runtime's figures at the end (full-resolution rows, output spans, host-pool bytes).
Results: benchmarks/results/long_output_cpu.json and long_output.png.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from benchmarks.engine import command_line, make_llm, run_in_subprocess, worker_or_model
from benchmarks.perf.run import essay_prompts

RESULTS = Path(__file__).resolve().parents[1] / "results"
SETTINGS = ("vllm", "sekv_window_kept", "sekv_window_spanified")


def worker(spec: dict) -> dict:
    from vllm import SamplingParams

    llm = make_llm(spec["model"], spec["sekv"], spec["length"] + spec["decode_tokens"] + 64)
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    manager = scheduler.kv_cache_manager.coordinator.single_type_managers[0]
    params = SamplingParams(temperature=0.0, max_tokens=spec["decode_tokens"], ignore_eos=True)
    for i, prompt in enumerate(essay_prompts(llm.get_tokenizer(), spec["length"], spec["requests"])):
        engine.add_request(f"long-{i}", {"prompt_token_ids": prompt}, params)
    outputs: dict[str, list[int]] = {}
    trace, decode_s, decode_tokens = [], 0.0, 0
    figures = []
    while engine.has_unfinished_requests():
        prefilling = any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running)
        t0 = time.perf_counter()
        outs = engine.step()
        seconds = time.perf_counter() - t0
        new_tokens, first = 0, False
        for out in outs:
            ids = list(out.outputs[0].token_ids)
            before = len(outputs.get(out.request_id, ()))
            first |= before == 0 and len(ids) > 0
            new_tokens += len(ids) - before
            outputs[out.request_id] = ids
        if not prefilling and not first:
            decode_s += seconds
            decode_tokens += new_tokens
        live = [sum(b is not manager._null_block for b in blocks) for blocks in manager.req_to_blocks.values()]
        if live:
            trace.append([round(sum(len(o) for o in outputs.values()) / spec["requests"], 1),
                          round(sum(live) / len(live), 2)])
        if spec["sekv"] is not None and len(live) == spec["requests"]:
            from sekv_vllm.integration.vllm.runner_bridge import current_bridge

            rt = current_bridge().runtime
            figures = [rt.figures(r) for r in rt.requests]  # the last step all requests were live
    result = {
        "outputs": [outputs[f"long-{i}"] for i in range(spec["requests"])],
        "block_size": manager.block_size,
        "pages_per_request": trace,
        "decode_tok_per_s": round(decode_tokens / decode_s, 2) if decode_s else None,
    }
    if figures:
        keys = ("prompt_tokens", "spans", "output_spans", "output_span_tokens", "output_anchor_and_short_tokens",
                "full_resolution_rows", "host_pool_bytes", "host_pool_bytes_now", "vllm_pages_returned_bytes",
                "output_mean_surprisal", "mean_zoomed_spans")
        result["figures_at_end"] = [{k: f.get(k) for k in keys} for f in figures if f]
    return result


def agreement(ours: list[list[int]], stock: list[list[int]]) -> dict:
    """Share of output positions with stock's token, and the mean first position where they differ."""
    same = total = 0
    first_diff = []
    for a, b in zip(ours, stock):
        n = min(len(a), len(b))
        same += sum(x == y for x, y in zip(a[:n], b[:n]))
        total += n
        first_diff.append(next((i for i in range(n) if a[i] != b[i]), n))
    return {"token_match_rate": round(same / max(total, 1), 4), "mean_first_difference": sum(first_diff) / len(first_diff)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--length", type=int, default=2000)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--decode-tokens", type=int, default=1024)
    parser.add_argument("--budget", type=float, default=0.125, help="sekv budget_ratio")
    parser.add_argument("--growth", type=int, default=256, help="sekv window_growth of the spanifying engine")
    parser.add_argument("--out", type=Path, default=RESULTS / "long_output_cpu.json")
    args = parser.parse_args(argv)
    model = worker_or_model(args.worker, worker)
    if model is None:
        return 0
    result = {"command": command_line("benchmarks.perf.long_output", argv),
              "model": Path(model).name, "length": args.length, "requests": args.requests,
              "decode_tokens": args.decode_tokens, "budget_ratio": args.budget, "window_growth": args.growth,
              "cores": os.cpu_count()}
    sekv = {"budget_ratio": args.budget}
    configs = {"vllm": None, "sekv_window_kept": {**sekv, "window_growth": 0},
               "sekv_window_spanified": {**sekv, "window_growth": args.growth}}
    for name, settings in configs.items():
        spec = {"model": model, "sekv": settings, "length": args.length, "requests": args.requests,
                "decode_tokens": args.decode_tokens}
        result[name] = run_in_subprocess("benchmarks.perf.long_output", spec, stock=settings is None)
        print(f"{name}: decode {result[name]['decode_tok_per_s']} tok/s, pages per request at the end "
              f"{result[name]['pages_per_request'][-1][1]}", flush=True)
    stock = result["vllm"]
    for name in SETTINGS:
        run = result[name]
        run["agreement_with_stock"] = agreement(run["outputs"], stock["outputs"])
        run["pages_per_request_at_end"] = run["pages_per_request"][-1][1]
        run["pages_ratio_to_stock"] = round(run["pages_per_request_at_end"] / stock["pages_per_request"][-1][1], 3)
        run["decode_ratio_to_stock"] = round(run["decode_tok_per_s"] / stock["decode_tok_per_s"], 3)
    # greedy outputs part from stock's within a few tokens at a small budget whatever the window does;
    # what the spanification itself changes shows against the same budget with the output kept
    kept = result["sekv_window_kept"]
    result["sekv_window_spanified"]["agreement_with_window_kept"] = agreement(
        result["sekv_window_spanified"]["outputs"], kept["outputs"])
    for name in SETTINGS:
        run = result[name]
        shown = ("agreement_with_stock", "agreement_with_window_kept", "pages_ratio_to_stock", "decode_ratio_to_stock")
        print(f"{name}: {json.dumps({k: run[k] for k in shown if k in run})}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    from benchmarks.perf.plot import plot_long_output

    print(f"wrote {args.out} and {plot_long_output(result, args.out.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
