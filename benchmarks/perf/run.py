"""Performance of stock vLLM vs sekv, side by side in one run: prefill, decode, memory.

    python -m benchmarks.perf.run                       # 1K-8K, batch 1, 8 and the pool's full-KV max
    python -m benchmarks.perf.run --lengths 2000 --kv-space-gib 1 --decode-tokens 16

For each backend and context length, a fresh engine in its own process (so peak memory is that
engine's own) with the same KV pool (`VLLM_CPU_KVCACHE_SPACE`). Prompts are distinct essay
passages of exactly N tokens. For each batch size B (1, 8, and the largest batch whose prompts
and decode tokens fit the pool at once at full KV: the same B for both, so speeds compare at
equal load; how many more sekv runs at once is benchmarks.perf.capacity's measure) B requests
are added together and the engine stepped:
prefill time is the time to the last first token, decode tokens/s counts the tokens produced
after every request has its first token (ignore_eos, so all decode the same number). Batch
sizes above the pool's capacity are skipped and recorded as such. Fast-tier and host-pool bytes
per request are sekv's own figures, with the bytes of vLLM pages the request still holds (all
of its prompt's, until pages are returned to the pool); stock's fast tier is the full KV (layers x 2 x KV heads x
head dim x 4 bytes per token, float32). Results: benchmarks/results/perf_cpu.json (+ PNG plots
with benchmarks.perf.plot); ratios are sekv / stock from this same run.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

from benchmarks.engine import command_line, make_llm, run_in_subprocess, worker_or_model

RESULTS = Path(__file__).resolve().parents[1] / "results"
BATCHES = (1, 8)


def essay_prompts(tokenizer, n_tokens: int, count: int) -> list[list[int]]:
    """`count` distinct essay passages of exactly n_tokens tokens each (token ids)."""
    from sekv_vllm.tasks.haystack import sentences

    ids = tokenizer(" ".join(sentences()), add_special_tokens=False).input_ids
    stride = max((len(ids) - n_tokens) // max(count, 1), 1)
    return [ids[(i * stride) % (len(ids) - n_tokens):][:n_tokens] for i in range(count)]


def measure_batch(llm, prompts: list[list[int]], decode_tokens: int, budget: float | None) -> dict:
    from vllm import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=1 + decode_tokens, ignore_eos=True,
                            extra_args={"sekv_budget_ratio": budget} if budget is not None else None)
    tag = f"perf{time.monotonic_ns()}"
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": p}, params)
    produced: dict[str, int] = {}
    at_all_first: dict[str, int] | None = None
    t_first = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            produced[out.request_id] = len(out.outputs[0].token_ids)
        if at_all_first is None and len(produced) == len(prompts) and all(produced.values()):
            t_first, at_all_first = time.perf_counter(), dict(produced)
    t_end = time.perf_counter()
    decoded = sum(produced[r] - at_all_first[r] for r in produced)
    return {"batch": len(prompts), "prefill_s": round(t_first - t0, 3),
            "decode_tokens": decoded, "decode_s": round(t_end - t_first, 3),
            "decode_tok_per_s": round(decoded / max(t_end - t_first, 1e-9), 2)}


def add_engine_args(parser: argparse.ArgumentParser, decode_tokens: int, out: Path) -> None:
    """The flags both perf benchmarks share: sekv's budget, decode length, the pool, the output."""
    parser.add_argument("--budget", type=float, default=0.125, help="sekv budget_ratio")
    parser.add_argument("--decode-tokens", type=int, default=decode_tokens)
    parser.add_argument("--kv-space-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE (whole GiB) for both")
    parser.add_argument("--out", type=Path, default=out)


def worker(spec: dict) -> dict:
    llm = make_llm(spec["model"], spec["sekv"], spec["length"] + spec["decode_tokens"] + 64)
    tok = llm.get_tokenizer()
    cache = llm.llm_engine.vllm_config.cache_config
    hf = llm.llm_engine.vllm_config.model_config.hf_config
    bytes_per_token = 2 * hf.num_hidden_layers * hf.num_key_value_heads * (hf.hidden_size // hf.num_attention_heads) * 4
    blocks_per_request = -(-(spec["length"] + spec["decode_tokens"] + 1) // cache.block_size)
    max_batch = cache.num_gpu_blocks // blocks_per_request
    budget = spec["budget"] if spec["sekv"] is not None else None
    # Warm-up (first-call allocations; a compressed request for sekv), not measured.
    measure_batch(llm, essay_prompts(tok, 600, 1), 2, budget)
    runs, skipped = [], []
    for b in sorted({*BATCHES, max_batch}):
        if b < 1 or b > max_batch:
            skipped.append(b)
            continue
        run = measure_batch(llm, essay_prompts(tok, spec["length"], b), spec["decode_tokens"], budget)
        run["is_pool_max"] = b == max_batch
        runs.append(run)
    out = {"pool_blocks": cache.num_gpu_blocks, "block_size": cache.block_size, "max_batch": max_batch,
           "skipped_batches_over_pool": skipped, "runs": runs, "full_kv_bytes": spec["length"] * bytes_per_token}
    if spec["sekv"] is not None:
        from sekv_vllm.integration.vllm.runner_bridge import request_figures

        figs = [f for f in request_figures() if f["prompt_tokens"] == spec["length"]]
        out["fast_tier_bytes"] = figs[0]["fast_tier_bytes"]
        out["host_pool_bytes"] = figs[0]["host_pool_bytes"]
        out["full_kv_bytes"] = figs[0]["full_kv_bytes"]
        out["vllm_pages_held_bytes"] = figs[0]["vllm_pages_held_bytes"]
    else:
        out["fast_tier_bytes"] = out["full_kv_bytes"]
        out["vllm_pages_held_bytes"] = blocks_per_request * cache.block_size * bytes_per_token
        out["host_pool_bytes"] = 0
    out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


def ratios(stock: dict, sekv: dict) -> dict:
    by_batch = {r["batch"]: r for r in stock["runs"]}
    out = {"fast_tier_bytes": sekv["fast_tier_bytes"] / stock["fast_tier_bytes"],
           "vllm_pages_held": sekv["vllm_pages_held_bytes"] / stock["vllm_pages_held_bytes"],
           "peak_rss": sekv["peak_rss_bytes"] / stock["peak_rss_bytes"]}
    for r in sekv["runs"]:
        s = by_batch.get(r["batch"])
        if s:
            out[f"prefill_b{r['batch']}"] = r["prefill_s"] / s["prefill_s"]
            out[f"decode_tok_per_s_b{r['batch']}"] = r["decode_tok_per_s"] / s["decode_tok_per_s"]
    return {k: round(v, 3) for k, v in out.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--lengths", nargs="+", type=int, default=[1000, 2000, 4000, 8000])
    add_engine_args(parser, decode_tokens=32, out=RESULTS / "perf_cpu.json")
    args = parser.parse_args(argv)
    model = worker_or_model(args.worker, worker)
    if model is None:
        return 0
    rows = []
    for n in args.lengths:
        row = {"length": n}
        for backend in ("vllm", "sekv"):
            sekv = {"budget_ratio": args.budget} if backend == "sekv" else None
            spec = {"model": model, "sekv": sekv, "length": n, "decode_tokens": args.decode_tokens, "budget": args.budget}
            t0 = time.time()
            row[backend] = run_in_subprocess("benchmarks.perf.run", spec, stock=backend == "vllm",
                                             env={"VLLM_CPU_KVCACHE_SPACE": f"{args.kv_space_gib}"})
            print(f"{n} tokens, {backend}: {json.dumps(row[backend])} ({time.time() - t0:.0f} s)", flush=True)
        row["ratio_sekv_to_stock"] = ratios(row["vllm"], row["sekv"])
        rows.append(row)
    result = {"command": command_line("benchmarks.perf.run", argv),
              "model": Path(model).name, "budget_ratio": args.budget, "decode_tokens": args.decode_tokens,
              "kv_cache_space_gib": args.kv_space_gib, "cores": os.cpu_count(), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    for row in rows:
        print(row["length"], json.dumps(row["ratio_sekv_to_stock"]))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
