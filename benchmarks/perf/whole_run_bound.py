"""How fast a whole run could be at best: the end_to_end runs' time split into what any backend pays and what
sekv's attention adds, against the model's own step time with no KV to read.

    python -m benchmarks.perf.whole_run_bound                      # reads end_to_end_cpu.json
    python -m benchmarks.perf.whole_run_bound --batches 1 8 16 --steps 32   # a quick look

A whole run of `end_to_end` (vLLM's default prefill chunk holds a 4K prompt: one prompt per step) is a chain of
steps: prefill steps, each one prompt's forward plus one token for every running request (sekv: plus the
compression of the prompt before it), and decode-only steps. From each run's timeline (seconds and requests
running after every step; a step longer than `LONG_STEP` times the run's median step is a prefill step):

- stock_prefill_s: stock's prefill steps. sekv's forward is stock's: no backend's prefill steps take less.
- sekv_prefill_extra_s: what sekv's prefill steps take beyond stock's (compression, the attention of more running
  requests), in the same run.
- decode_floor_s: sekv's decode-only steps, each at the model's step time for as many requests with 64-token prompts
  (measured here on stock vLLM: its attention then reads almost nothing, so this is the linears, the output
  projection, sampling and vLLM's own step).
- decode_attention_s: what sekv's decode-only steps took beyond that floor: its attention and its Python.

bound_attention_free_s = stock_prefill_s + sekv_prefill_extra_s + decode_floor_s is sekv's wall time with the same
schedule and a decode attention that costs nothing; bound_model_only_s leaves out its prefill extra too. Their
`throughput_ceiling` (stock's wall / bound) is the most any decode kernel, or any compression, could make of the
run on this machine at sekv's concurrency. The steps are sekv's own: a whole run with at most M requests at once
needs, whatever the backend, at least about (N / M) x output tokens steps, since each request takes one step per
output token (`min_steps`, by a schedule that admits a prompt at every step a request can start);
bound_all_at_once_attention_free_s is the attention-free bound were the pool to hold every request at once (the
fewest steps, each decode-only step at the model's time with all of them).

The floor is measured now and the runs were measured when end_to_end ran: the machine's speed moves between hours
(stock's 4K prefill alone is measured here too, against the run's, to show by how much).
Results: benchmarks/results/whole_run_bound_cpu.json and whole_run_bound.png.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from benchmarks.engine import command_line, machine, make_llm, run_in_subprocess, worker_or_model
from benchmarks.perf.end_to_end import run_requests
from benchmarks.perf.run import essay_prompts

RESULTS = Path(__file__).resolve().parents[1] / "results"
LONG_STEP = 10  # a prefill step of a 4K prompt takes 5-10 s, a decode step 0.05-0.5 s
FLOOR_PROMPT_TOKENS = 64


def step_times(timeline: list[list[float]]) -> list[tuple[float, int]]:
    """(seconds, requests running) of every step of a run's timeline [[seconds since start, running], ...];
    a step's running count is the larger of before and after it (a request that finishes in a step ran in it)."""
    steps, last_t, last_n = [], 0.0, 0
    for t, n in timeline:
        steps.append((t - last_t, max(n, last_n)))
        last_t, last_n = t, n
    return steps


def split_steps(timeline: list[list[float]]) -> tuple[list[tuple[float, int]], list[tuple[float, int]]]:
    """The run's (prefill-like steps, decode-only steps): longer than LONG_STEP times the median step, or not."""
    steps = step_times(timeline)
    cut = LONG_STEP * statistics.median(s for s, _ in steps)
    return [s for s in steps if s[0] > cut], [s for s in steps if s[0] <= cut]


def floor_at(floors: dict[int, float], batch: int) -> float:
    """The model's step time at `batch` requests, linear between the measured batches (flat beyond them)."""
    known = sorted(floors)
    if batch <= known[0]:
        return floors[known[0]]
    for lo, hi in zip(known, known[1:]):
        if batch <= hi:
            return floors[lo] + (floors[hi] - floors[lo]) * (batch - lo) / (hi - lo)
    return floors[known[-1]]


def min_steps(requests: int, concurrency: int, output_tokens: int) -> int:
    """The fewest engine steps for `requests` requests of `output_tokens` tokens each with at most `concurrency`
    running, one prompt admitted per step (a 4K prompt fills vLLM's default step) and one token per running
    request per step (its first at its prefill step)."""
    waiting, running, steps = requests, [], 0
    while waiting or running:
        steps += 1
        if waiting and len(running) < concurrency:
            waiting -= 1
            running.append(0)
        running = [made + 1 for made in running if made + 1 < output_tokens]
    return steps


def bound(stock: dict, sekv: dict, floors: dict[int, float]) -> dict:
    """The split of one output length's whole runs (stock's and sekv's records of end_to_end) and its bounds."""
    stock_prefill, _ = split_steps(stock["timeline"])
    sekv_prefill, sekv_decode = split_steps(sekv["timeline"])
    stock_prefill_s = sum(s for s, _ in stock_prefill)
    extra_s = sum(s for s, _ in sekv_prefill) - stock_prefill_s
    floor_s = sum(floor_at(floors, n) for _, n in sekv_decode)
    decode_s = sum(s for s, _ in sekv_decode)
    target = stock["wall_s"] / 2
    attention_free = stock_prefill_s + extra_s + floor_s
    model_only = stock_prefill_s + floor_s
    # every request at once, were the pool to hold them: the fewest steps, each decode-only step at the model's time
    n, tokens = sekv["requests"], sekv["output_tokens"] // sekv["requests"]
    all_at_once = stock_prefill_s + extra_s + (min_steps(n, n, tokens) - n) * floor_at(floors, n)
    return {
        "stock_wall_s": stock["wall_s"], "sekv_wall_s": sekv["wall_s"], "target_2x_wall_s": round(target, 1),
        "stock_prefill_steps": len(stock_prefill), "stock_prefill_s": round(stock_prefill_s, 1),
        "sekv_prefill_steps": len(sekv_prefill), "sekv_prefill_extra_s": round(extra_s, 1),
        "sekv_decode_steps": len(sekv_decode), "sekv_decode_mean_running": round(
            statistics.mean(n for _, n in sekv_decode), 1),
        "sekv_decode_s": round(decode_s, 1), "decode_floor_s": round(floor_s, 1),
        "decode_attention_s": round(decode_s - floor_s, 1),
        "min_steps": min_steps(sekv["requests"], sekv["max_concurrent"], sekv["output_tokens"] // sekv["requests"]),
        "bound_attention_free_s": round(attention_free, 1), "bound_model_only_s": round(model_only, 1),
        "throughput_ceiling_attention_free": round(stock["wall_s"] / attention_free, 3),
        "throughput_ceiling_model_only": round(stock["wall_s"] / model_only, 3),
        "throughput_ratio_run": round(stock["wall_s"] / sekv["wall_s"], 3),
        "bound_all_at_once_attention_free_s": round(all_at_once, 1),
        "throughput_ceiling_all_at_once_attention_free": round(stock["wall_s"] / all_at_once, 3),
    }


def decode_step_seconds(llm, prompts: list[list[int]], steps: int) -> float:
    """The median time of an engine step in which every one of `prompts` decodes (after their prefill steps)."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"floor{len(prompts)}-{i}", {"prompt_token_ids": prompt}, params)
    started: set[str] = set()
    while len(started) < len(prompts):  # prefill steps: one or more prompts each
        started.update(out.request_id for out in engine.step() if out.outputs[0].token_ids)
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        outs = engine.step()
        if not any(out.finished for out in outs):
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def worker(spec: dict) -> dict:
    """On stock vLLM: the step time with B requests of short prompts decoding, for each B, and a 4K prompt's
    prefill alone (median of 3 prompts)."""
    llm = make_llm(spec["model"], None, 8192)
    tok = llm.get_tokenizer()
    run_requests(llm, essay_prompts(tok, 600, 1), 4, "warm")
    floors = {b: decode_step_seconds(llm, essay_prompts(tok, FLOOR_PROMPT_TOKENS, b), spec["steps"])
              for b in spec["batches"]}
    prefills = []
    for i, prompt in enumerate(essay_prompts(tok, spec["prefill_length"], 3)):
        start = time.perf_counter()
        run_requests(llm, [prompt], 1, f"prefill{i}")
        prefills.append(time.perf_counter() - start)
    return {"floors": floors, "prefill_alone_s": statistics.median(prefills)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--runs", type=Path, default=RESULTS / "end_to_end_cpu.json", help="an end_to_end results file")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 2, 4, 8, 12, 16, 20, 24, 32],
                        help="requests decoding at once, for the model's step time")
    parser.add_argument("--steps", type=int, default=96, help="decode steps per batch (the median step is the figure)")
    parser.add_argument("--out", type=Path, default=RESULTS / "whole_run_bound_cpu.json")
    args = parser.parse_args(argv)
    if min(args.batches) < 1 or args.steps < 2:
        parser.error(f"--batches must be at least 1 and --steps at least 2, got {args.batches} and {args.steps}")
    model = worker_or_model(args.worker, worker)
    if model is None:
        return 0
    runs = json.loads(args.runs.read_text())
    spec = {"model": model, "batches": args.batches, "steps": args.steps, "prefill_length": runs["length"]}
    measured = run_in_subprocess("benchmarks.perf.whole_run_bound", spec, stock=True,
                                 env={"VLLM_CPU_KVCACHE_SPACE": str(runs["kv_cache_space_gib"])})
    floors = {int(b): s for b, s in measured["floors"].items()}
    alone = runs["alone"].get("vllm", {}).get("single", {}).get(str(runs["length"]), {})
    result = {
        "command": command_line("benchmarks.perf.whole_run_bound", argv), "model": Path(model).name,
        "runs": str(args.runs.relative_to(RESULTS.parent.parent)) if args.runs.is_relative_to(RESULTS.parent.parent)
        else str(args.runs), "runs_note": runs.get("note"), "machine": machine(),
        "floor_prompt_tokens": FLOOR_PROMPT_TOKENS, "model_step_s": {str(b): round(s, 4) for b, s in floors.items()},
        "stock_prefill_alone_s": {"now": round(measured["prefill_alone_s"], 2), "runs": alone.get("t2_s")},
        "outputs": {n: bound(r["vllm"], r["sekv"], floors) for n, r in runs["whole_run"].items()
                    if "vllm" in r and "sekv" in r},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    from benchmarks.perf.plot import plot_whole_run_bound

    print(json.dumps(result["outputs"], indent=1))
    print(f"wrote {args.out} and {plot_whole_run_bound(result, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
