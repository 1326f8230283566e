"""End to end, as a batch job or a server sees it: stock vLLM and sekv in one run, the same KV pool.

    python -m benchmarks.perf.end_to_end                  # 32 x 4K prompts, 128 and 512 output tokens; 1K/4K/8K alone
    python -m benchmarks.perf.end_to_end --requests 8 --outputs 64 --single-lengths 1000
    python -m benchmarks.perf.end_to_end --variant 'sampled={"surprisal_exact_tokens": 8192}'   # + sekv so set
    python -m benchmarks.perf.end_to_end --outputs 512 --no-alone --max-num-batched-tokens 512   # smaller prefill chunks

Whole run: `--requests` distinct essay prompts of `--length` tokens are submitted at once
(ignore_eos: every request produces exactly its output length) to a fresh engine in its own
process, per backend and output length, and the engine is stepped until all are done. Measured:
wall time, output tokens/s over the whole run, per request time to first token (from submission,
queueing included) and time per output token after it (p50/p90), and the requests running with
output after each step (each engine first serves one short request, not measured: first-call costs
such as loading sekv's kernel stay out of both). Alone: one request at a time at each of `--single-lengths` (after a
warm-up request), `--single-repeats` distinct prompts each: time to first token, to the second one and
time per output token, the median run's. sekv compresses a prompt at the step after its last forward
pass, once its first token is out: its time to the second token holds the prompt's forward, its
compression and one decode step (stock's: the forward and one decode step), the whole cost of its prefill.

Results: benchmarks/results/end_to_end_cpu.json with, from this one run, `output_throughput_ratio`
(per output length), `ttft_ratio_single` (per prompt length) and `prefill_time_ratio_4k` (the
second token of a 4K prompt alone: its prefill, compression included), all sekv / stock; `--variant NAME=JSON`
runs sekv once more with those settings over its defaults, in the same run, its ratios to stock under
`variants.NAME`. `python -m benchmarks.perf.plot` draws end_to_end.png.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from benchmarks.engine import command_line, machine, make_llm, run_in_subprocess, worker_or_model
from benchmarks.perf.run import essay_prompts

RESULTS = Path(__file__).resolve().parents[1] / "results"


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) of values, linearly interpolated."""
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


def run_requests(llm, prompts: list[list[int]], max_tokens: int, tag: str) -> dict:
    """Submit every prompt at once and step the engine to the end: per-request and whole-run timings."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": prompt}, params)
    produced: dict[str, int] = {}
    first: dict[str, float] = {}
    second: dict[str, float] = {}
    last: dict[str, float] = {}
    timeline = []
    preemptions: dict[str, int] = {}
    while engine.has_unfinished_requests():
        outs = engine.step()
        for request in scheduler.running:
            if request.num_preemptions:
                preemptions[request.request_id] = request.num_preemptions
        now = time.perf_counter() - t0
        for out in outs:
            n = len(out.outputs[0].token_ids)
            if n > produced.get(out.request_id, 0):
                first.setdefault(out.request_id, now)
                if n >= 2:
                    second.setdefault(out.request_id, now)
                last[out.request_id] = now
                produced[out.request_id] = n
        timeline.append([round(now, 2), sum(1 for r in scheduler.running if r.num_output_tokens > 0)])
    wall = time.perf_counter() - t0
    ttft = [first[r] for r in produced]
    tpot = [(last[r] - first[r]) / (produced[r] - 1) for r in produced if produced[r] > 1]
    return {
        "requests": len(prompts), "output_tokens": sum(produced.values()), "wall_s": round(wall, 2),
        "output_tok_per_s": round(sum(produced.values()) / wall, 3),
        "ttft_s": {"p50": round(percentile(ttft, 0.5), 3), "p90": round(percentile(ttft, 0.9), 3)},
        "t2_s": {"p50": round(percentile(list(second.values()), 0.5), 3),
                 "p90": round(percentile(list(second.values()), 0.9), 3)} if second else None,
        "tpot_s": {"p50": round(percentile(tpot, 0.5), 4), "p90": round(percentile(tpot, 0.9), 4)} if tpot else None,
        "max_concurrent": max(n for _, n in timeline), "preemptions": sum(preemptions.values()), "timeline": timeline,
    }


def worker(spec: dict) -> dict:
    longest = max([spec["length"], *spec["single_lengths"]])
    llm = make_llm(spec["model"], spec["sekv"], longest + spec["max_tokens"] + 64, spec.get("max_num_batched_tokens"))
    tok = llm.get_tokenizer()
    out = {"pool_blocks": llm.llm_engine.vllm_config.cache_config.num_gpu_blocks}
    # first-call costs (allocations; sekv: loading its C++ kernel and router), not measured
    run_requests(llm, essay_prompts(tok, 600, 1), 4, "warm")
    if spec["mode"] == "single":
        out["single"] = {}
        for n in spec["single_lengths"]:
            # distinct prompts, one at a time; the median run is the figure (this machine moves between runs)
            runs = [run_requests(llm, [p], spec["max_tokens"], f"single{n}-{i}")
                    for i, p in enumerate(essay_prompts(tok, n, spec["single_repeats"]))]
            out["single"][str(n)] = {key: statistics.median(r[key]["p50"] if key != "wall_s" else r[key] for r in runs)
                                     for key in ("ttft_s", "t2_s", "tpot_s", "wall_s")}
            out["single"][str(n)]["ttft_runs_s"] = [r["ttft_s"]["p50"] for r in runs]
        return out
    out.update(run_requests(llm, essay_prompts(tok, spec["length"], spec["requests"]), spec["max_tokens"], "batch"))
    if spec["sekv"] is not None:
        from sekv_vllm.integration.vllm.runner_bridge import request_figures

        figs = [f for f in request_figures() if f.get("prompt_tokens") == spec["length"]]
        out["compressed_requests"] = len(figs)
        if figs:
            out["fast_tier_fraction"] = round(statistics.mean(f["fast_tier_fraction"] for f in figs), 4)
            exact = [f["mean_exact_heads"] for f in figs if "mean_exact_heads" in f]
            if exact:  # KV heads per layer and step that read every prompt row (`exact_fallback_coverage`)
                out["mean_exact_heads"] = round(statistics.mean(exact), 3)
    return out


def ratios(result: dict, length: int, backend: str = "sekv") -> dict:
    """`backend` / stock figures of a run with both: the whole runs', and the requests alone's where they ran."""
    out = {}
    if backend in result["alone"] and "vllm" in result["alone"]:
        stock_alone, alone = result["alone"]["vllm"]["single"], result["alone"][backend]["single"]
        out["ttft_ratio_single"] = {n: round(alone[n]["ttft_s"] / stock_alone[n]["ttft_s"], 3) for n in stock_alone}
        out["tpot_ratio_single"] = {n: round(alone[n]["tpot_s"] / stock_alone[n]["tpot_s"], 3) for n in stock_alone}
        if str(length) in stock_alone:
            n = str(length)
            out[f"prefill_time_ratio_{length // 1000}k"] = round(alone[n]["t2_s"] / stock_alone[n]["t2_s"], 3)
    runs = {n: r for n, r in result["whole_run"].items() if backend in r and "vllm" in r}
    out["output_throughput_ratio"] = {
        n: round(r[backend]["output_tok_per_s"] / r["vllm"]["output_tok_per_s"], 3) for n, r in runs.items()}
    out["wall_time_ratio"] = {n: round(r[backend]["wall_s"] / r["vllm"]["wall_s"], 3) for n, r in runs.items()}
    return out


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def variant(text: str) -> tuple[str, dict]:
    """--variant NAME=JSON -> (NAME, settings)."""
    name, sep, settings = text.partition("=")
    if not sep or not name or name in ("vllm", "sekv"):
        raise argparse.ArgumentTypeError(f"--variant: NAME=JSON with a NAME other than vllm and sekv, got {text!r}")
    try:
        return name, json.loads(settings)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"--variant {name}: settings are not JSON ({err})") from err


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--length", type=int, default=4000)
    parser.add_argument("--outputs", nargs="+", type=int, default=[128, 512], help="output tokens per request")
    parser.add_argument("--single-lengths", nargs="+", type=int, default=[1000, 4000, 8000])
    parser.add_argument("--single-tokens", type=int, default=32, help="output tokens of a request alone")
    parser.add_argument("--single-repeats", type=int, default=3, help="runs per length alone (the median is the figure)")
    parser.add_argument("--budget", type=float, default=0.125, help="sekv budget_ratio")
    parser.add_argument("--kv-space-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE (whole GiB) for both")
    parser.add_argument("--backends", nargs="+", choices=["vllm", "sekv"], default=["vllm", "sekv"],
                        help="both for the ratios; one alone for a quick look (no ratios then)")
    parser.add_argument("--variant", type=variant, action="append", default=[], metavar="NAME=JSON",
                        help="also sekv with these settings over the defaults, e.g. "
                        "'sampled={\"surprisal_exact_tokens\": 8192}': its figures and ratios to stock under variants.NAME")
    parser.add_argument("--max-num-batched-tokens", type=positive, default=None,
                        help="vLLM's tokens per step (its prefill chunk) for every backend; default vLLM's (4096 for an "
                        "offline engine on CPU: a 4K prompt in one step, the requests decoding beside it get one token)")
    parser.add_argument("--no-alone", action="store_true", help="skip the requests alone")
    parser.add_argument("--out", type=Path, default=RESULTS / "end_to_end_cpu.json")
    args = parser.parse_args(argv)
    model = worker_or_model(args.worker, worker)
    if model is None:
        return 0
    result: dict = {"command": command_line("benchmarks.perf.end_to_end", argv), "model": Path(model).name,
                    "requests": args.requests, "length": args.length, "budget_ratio": args.budget,
                    "kv_cache_space_gib": args.kv_space_gib, "max_num_batched_tokens": args.max_num_batched_tokens,
                    "cores": os.cpu_count(), "machine": machine(),
                    "whole_run": {}, "alone": {}}
    env = {"VLLM_CPU_KVCACHE_SPACE": str(args.kv_space_gib)}
    common = {"model": model, "length": args.length, "requests": args.requests,
              "max_num_batched_tokens": args.max_num_batched_tokens}
    backends = {b: {"budget_ratio": args.budget} if b == "sekv" else None for b in args.backends}
    backends.update({name: {"budget_ratio": args.budget, **settings} for name, settings in args.variant})
    for backend, sekv in backends.items():
        spec = {**common, "sekv": sekv, "mode": "single", "single_lengths": args.single_lengths,
                "max_tokens": args.single_tokens, "single_repeats": args.single_repeats}
        if not args.no_alone:
            result["alone"][backend] = run_in_subprocess("benchmarks.perf.end_to_end", spec, stock=sekv is None, env=env)
            print(f"{backend} alone: {json.dumps(result['alone'][backend])}", flush=True)
        for n_out in args.outputs:
            spec = {**common, "sekv": sekv, "mode": "batch", "single_lengths": [], "max_tokens": n_out}
            run = run_in_subprocess("benchmarks.perf.end_to_end", spec, stock=sekv is None, env=env)
            result["whole_run"].setdefault(str(n_out), {})[backend] = run
            print(f"{backend}, {n_out} output tokens: " + json.dumps({k: v for k, v in run.items() if k != "timeline"}),
                  flush=True)
    if "vllm" in backends:
        if "sekv" in backends:
            result.update(ratios(result, args.length))
        if args.variant:
            result["variants"] = {name: {"sekv_config": backends[name], **ratios(result, args.length, name)}
                                  for name, _ in args.variant}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if "ratio" in k}))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
