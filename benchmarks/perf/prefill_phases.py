"""Where a compressed prompt's prefill time goes, phase by phase, beside stock vLLM's prefill in the same run.

    python -m benchmarks.perf.prefill_phases                        # 1K-8K, budget 0.25
    python -m benchmarks.perf.prefill_phases --lengths 4000 --repeats 3
    python -m benchmarks.perf.prefill_phases --lengths 4000 --repeats 3 --running 8 --out benchmarks/results/prefill_phases_loaded_cpu.json

For each backend (stock vLLM with plugins off, sekv) one engine in its own process. Per prompt length
(distinct essay passages of exactly N tokens, one request alone, two output tokens: sekv compresses a prompt
at the step after its last forward pass, once its first token is out, so the figure is the prompt's forward,
its compression and one decode step, stock's the forward and one decode step) the prefill is timed `--repeats` times plainly (the median is the figure; the ratio is
sekv / stock) and once more under Python's cProfile, whose cumulative time per function splits it
into sekv's phases: prompt-token surprisal (the model's logits of every prompt row), row capture
(inside the attention), the plan (segmentation and the budget's split), span summaries, scoring
codes, the eigendecompositions the router's key gates need, bases (factors or rows, gated), router features, host-pool writes, the
rows kept at full resolution, their placement into the engine's pages and the page plan that returns
the rest; what is left is the model's forward and vLLM's own work. Shares are of the profiled run
(the profiler slows Python-heavy phases more than torch's). Results:
benchmarks/results/prefill_phases_cpu.json and prefill_phases.png (the plot beside the JSON, named after it).

`--running N`: the same prefills in a loaded engine, as a batch job or a server sees them: N requests of the
longest length are decoding (sekv: compressed) before each measured prompt comes, and the engine is stepped
until that prompt has its two tokens, the others' decode tokens riding in the same steps. Also timed there:
a decode-only step with the N requests (median of 10), `decode_step_seconds`.
"""
from __future__ import annotations

import argparse
import cProfile
import itertools
import json
import pstats
import statistics
import time
from pathlib import Path

from benchmarks.engine import command_line, machine, make_llm, run_in_subprocess, worker_or_model
from benchmarks.perf.run import essay_prompts

RESULTS = Path(__file__).resolve().parents[1] / "results"
OUT = RESULTS / "prefill_phases_cpu.json"

# phase -> the functions (file name, function name) whose cumulative time it is; disjoint call trees
PHASES: dict[str, tuple[tuple[str, str], ...]] = {
    "surprisal": (("runner_bridge.py", "_record_surprisal"),),
    "row capture": (("request_memory.py", "capture"),),
    "plan (segmentation)": (("span_budget.py", "plan_layout"),),
    "span summaries": (("span_summary.py", "summarize_spans"),),
    "scoring codes": (("span_keys.py", "span_keys"),),
    # the router's key gates: an eigendecomposition per span, KV head and layer (C++ kernel or LAPACK)
    "eigendecompositions": (("small_eigh.py", "small_eigh"), ("~", "<built-in method torch._C._linalg.linalg_eigh>")),
    "router features": (("span_compression.py", "_key_features"),),
    "host-pool writes": (("host_pool.py", "store"),),
    "rows kept": (("span_compression.py", "_keep_rows"),),
    "placement into pages": (("runner_bridge.py", "_place_rows"),),
    "page plan": (("page_plans.py", "after_compression"),),
}
# `compress_layer`'s time beyond its summaries, scoring codes and eigendecompositions: the bases
LAYER = ("span_memory.py", "compress_layer")
COMPRESS = ("span_compression.py", "compress_prompt")
# the phases inside `compress_prompt`: the rest of its time is "compression, other"
IN_COMPRESS = ("plan (segmentation)", "span summaries", "scoring codes", "eigendecompositions", "bases",
               "router features", "host-pool writes", "rows kept")
REST = "model forward and vLLM"


def cumulative(stats: dict, where: tuple[str, str]) -> tuple[float, int]:
    """(cumulative seconds, calls) of the functions named `where` in pstats' raw stats
    {(file, line, function): (primitive calls, calls, total time, cumulative time, callers)}."""
    seconds, calls = 0.0, 0
    for (path, _, name), (_, nc, _, ct, _) in stats.items():
        if name == where[1] and path.endswith(where[0]):
            seconds += ct
            calls += nc
    return seconds, calls


def split_phases(stats: dict, total: float) -> dict[str, float]:
    """Seconds per phase of one profiled prefill that took `total` seconds (phases absent: 0)."""
    phases = {name: sum(cumulative(stats, w)[0] for w in where) for name, where in PHASES.items()}
    layer, _ = cumulative(stats, LAYER)
    phases["bases"] = max(layer - phases["span summaries"] - phases["scoring codes"] - phases["eigendecompositions"], 0.0)
    compress, _ = cumulative(stats, COMPRESS)
    phases["compression, other"] = max(compress - sum(phases[p] for p in IN_COMPRESS), 0.0)
    phases[REST] = max(total - sum(phases.values()), 0.0)
    return phases


# output tokens of a request decoding beside the measured prefills (--running): enough to outlast them
RUNNING_TOKENS = 600


def worker(spec: dict) -> dict:
    from vllm import SamplingParams

    sekv = spec["sekv"]
    lengths, repeats, running = spec["lengths"], spec["repeats"], spec.get("running", 0)
    llm = make_llm(spec["model"], sekv, max(lengths) + (RUNNING_TOKENS + 64 if running else 64))
    prompts = essay_prompts(llm.get_tokenizer(), max(lengths), len(lengths) * (repeats + 1) + 1 + running)
    extra = {"sekv_budget_ratio": spec["budget"]} if sekv is not None else None
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, extra_args=extra)
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    measured = itertools.count()

    def prefill(ids: list[int]) -> float:
        t0 = time.perf_counter()
        if not running:
            llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
            return time.perf_counter() - t0
        # llm.generate would wait for the running requests too: step until this one is done
        req_id = f"measured-{next(measured)}"
        engine.add_request(req_id, {"prompt_token_ids": ids}, params)
        while not any(out.request_id == req_id and out.finished for out in engine.step()):
            pass
        return time.perf_counter() - t0

    if running:
        long = SamplingParams(temperature=0.0, max_tokens=RUNNING_TOKENS, ignore_eos=True, extra_args=extra)
        for i in range(running):
            engine.add_request(f"running-{i}", {"prompt_token_ids": prompts[-2 - i]}, long)
        while scheduler.waiting or any(r.num_output_tokens < 2 for r in scheduler.running):
            engine.step()
    prefill(prompts[-1][:lengths[0]])  # warm-up: first-use compilation, allocations
    rows, used = [], 0
    for n in lengths:
        plain = [prefill(prompts[used + i][:n]) for i in range(repeats)]
        profiler = cProfile.Profile()
        profiler.enable()
        profiled = prefill(prompts[used + repeats][:n])
        profiler.disable()
        used += repeats + 1
        stats = pstats.Stats(profiler).stats
        compressions = cumulative(stats, COMPRESS)[1]
        if sekv is not None and compressions != 1:
            raise RuntimeError(f"{n} tokens: the profiled prefill compressed {compressions} prompts, not 1")
        rows.append({"length": n, "prefill_seconds": statistics.median(plain), "runs": plain,
                     "profiled_seconds": profiled, "phases": split_phases(stats, profiled)})
    if not running:
        return {"rows": rows}
    steps = []
    for _ in range(10):
        t0 = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t0)
    if len(scheduler.running) != running:
        raise RuntimeError(f"the decode steps ran {len(scheduler.running)} requests, "
                           f"not {running}: raise {RUNNING_TOKENS=} or lower --repeats")
    return {"rows": rows, "decode_step_seconds": statistics.median(steps), "decode_step_runs": steps}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--lengths", nargs="+", type=int, default=[1000, 2000, 4000, 8000])
    parser.add_argument("--repeats", type=int, default=2, help="plain timings per length (median)")
    parser.add_argument("--budget", type=float, default=0.25, help="sekv budget_ratio")
    parser.add_argument("--sekv-config", type=json.loads, default={},
                        help='sekv settings besides the budget, as JSON (e.g. \'{"key_gate_strength": 0}\')')
    parser.add_argument("--running", type=int, default=0,
                        help="requests of the longest length decoding beside each measured prefill (0: alone)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    if args.running < 0:
        parser.error(f"--running: at least 0 (got {args.running})")
    model = worker_or_model(args.worker, worker)
    if model is None:
        return 0
    spec = {"model": model, "lengths": args.lengths, "repeats": args.repeats, "budget": args.budget,
            "running": args.running}
    runs = {backend: run_in_subprocess("benchmarks.perf.prefill_phases", {**spec, "sekv": sekv},
                                       stock=backend == "vllm")
            for backend, sekv in (("vllm", None), ("sekv", args.sekv_config))}
    rows = []
    for i, n in enumerate(args.lengths):
        stock, sekv = runs["vllm"]["rows"][i], runs["sekv"]["rows"][i]
        rows.append({"length": n, "vllm": stock, "sekv": sekv,
                     "prefill_time_ratio": sekv["prefill_seconds"] / stock["prefill_seconds"]})
        print(f"{n} tokens: stock {stock['prefill_seconds']:.2f} s, sekv {sekv['prefill_seconds']:.2f} s "
              f"({rows[-1]['prefill_time_ratio']:.2f}x)", flush=True)
    result = {"command": command_line("benchmarks.perf.prefill_phases", argv), "model": Path(model).name,
              "budget_ratio": args.budget, "sekv_config": args.sekv_config, "machine": machine(),
              "running": args.running, "rows": rows}
    if args.running:
        result["decode_step_seconds"] = {b: runs[b]["decode_step_seconds"] for b in runs}
        result["decode_step_runs"] = {b: runs[b]["decode_step_runs"] for b in runs}
        result["decode_step_ratio"] = runs["sekv"]["decode_step_seconds"] / runs["vllm"]["decode_step_seconds"]
    args.out.write_text(json.dumps(result, indent=1))
    from benchmarks.perf.plot import plot_prefill_phases

    print(f"wrote {args.out} and {plot_prefill_phases(result, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
