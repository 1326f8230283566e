"""Capacity of one KV pool: how many long requests run at once, and decode speed at that load.

    python -m benchmarks.perf.capacity                       # 4K prompts, 1 GiB pool, budget 0.125
    python -m benchmarks.perf.capacity --length 2000 --requests 12

Stock vLLM and sekv each get a fresh engine in its own process with the same pool
(`VLLM_CPU_KVCACHE_SPACE`). `--requests` distinct essay prompts of `--length` tokens are
submitted at once (ignore_eos, the same number of decode tokens each) and the engine is
stepped by hand. Measured per step: requests running with output (the concurrency), and
whether the step was pure decode (no request of the batch was prefilling before it and none
got its first token in it). Reported: the largest concurrency reached, decode tokens/s over the
pure-decode steps at that concurrency, output tokens/s over the whole run, and
`concurrency_ratio` = sekv's largest concurrency / stock's (same pool, same run).
Results: benchmarks/results/capacity_cpu.json (with each run's timeline of running requests;
`python -m benchmarks.perf.plot` draws it into capacity.png).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from benchmarks.engine import command_line, make_llm, run_in_subprocess, worker_or_model
from benchmarks.perf.run import add_engine_args, essay_prompts

RESULTS = Path(__file__).resolve().parents[1] / "results"


def worker(spec: dict) -> dict:
    from vllm import SamplingParams

    llm = make_llm(spec["model"], spec["sekv"], spec["length"] + spec["decode_tokens"] + 64)
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    params = SamplingParams(temperature=0.0, max_tokens=spec["decode_tokens"], ignore_eos=True)
    for i, prompt in enumerate(essay_prompts(llm.get_tokenizer(), spec["length"], spec["requests"])):
        engine.add_request(f"cap-{i}", {"prompt_token_ids": prompt}, params)
    produced: dict[str, int] = {}
    steps = []
    t_start = time.perf_counter()
    while engine.has_unfinished_requests():
        prefilling = any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running)
        t0 = time.perf_counter()
        outs = engine.step()
        seconds = time.perf_counter() - t0
        tokens, first_tokens = 0, 0
        for out in outs:
            n = len(out.outputs[0].token_ids)
            before = produced.get(out.request_id, 0)
            first_tokens += before == 0 and n > 0
            tokens += n - before
            produced[out.request_id] = n
        running = sum(1 for r in scheduler.running if r.num_output_tokens > 0)
        steps.append({"seconds": seconds, "tokens": tokens, "running": running,
                      "pure_decode": not prefilling and first_tokens == 0, "t": time.perf_counter() - t_start})
    wall = time.perf_counter() - t_start
    peak = max(s["running"] for s in steps)
    at_peak = [s for s in steps if s["pure_decode"] and s["running"] == peak]
    decode_s = sum(s["seconds"] for s in at_peak)
    out = {"requests": spec["requests"], "max_concurrent": peak, "pure_decode_steps_at_max": len(at_peak),
           "decode_tok_per_s_at_max": round(sum(s["tokens"] for s in at_peak) / decode_s, 2) if decode_s else None,
           "output_tok_per_s": round(sum(produced.values()) / wall, 2), "wall_s": round(wall, 1),
           "pool_blocks": llm.llm_engine.vllm_config.cache_config.num_gpu_blocks,
           "timeline": [[round(s["t"], 2), s["running"]] for s in steps]}
    if spec["sekv"] is not None:
        from sekv_vllm.integration.vllm.v0_32 import kv_pages

        out["pages_returned"] = kv_pages.returned_pages
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--length", type=int, default=4000)
    parser.add_argument("--requests", type=int, default=16)
    add_engine_args(parser, decode_tokens=64, out=RESULTS / "capacity_cpu.json")
    args = parser.parse_args(argv)
    model = worker_or_model(args.worker, worker)
    if model is None:
        return 0
    result = {"command": command_line("benchmarks.perf.capacity", argv),
              "model": Path(model).name, "length": args.length, "budget_ratio": args.budget,
              "decode_tokens": args.decode_tokens, "kv_cache_space_gib": args.kv_space_gib, "cores": os.cpu_count()}
    for backend in ("vllm", "sekv"):
        spec = {"model": model, "sekv": {"budget_ratio": args.budget} if backend == "sekv" else None,
                "length": args.length, "requests": args.requests, "decode_tokens": args.decode_tokens}
        result[backend] = run_in_subprocess("benchmarks.perf.capacity", spec, stock=backend == "vllm",
                                            env={"VLLM_CPU_KVCACHE_SPACE": str(args.kv_space_gib)})
        print(f"{backend}: {json.dumps(result[backend])}", flush=True)
    stock, sekv = result["vllm"], result["sekv"]
    result["concurrency_ratio"] = round(sekv["max_concurrent"] / stock["max_concurrent"], 3)
    if stock["decode_tok_per_s_at_max"] and sekv["decode_tok_per_s_at_max"]:
        result["decode_throughput_ratio_at_capacity"] = round(sekv["decode_tok_per_s_at_max"] / stock["decode_tok_per_s_at_max"], 3)
    result["output_throughput_ratio"] = round(sekv["output_tok_per_s"] / stock["output_tok_per_s"], 3)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k.endswith("ratio") or k.endswith("capacity")}))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
