"""The benchmark suite: a grid of backends x budgets x tasks x lengths, one engine per backend.

    python -m benchmarks.suite.run --profile quick              # resumes where it stopped
    python -m benchmarks.suite.run --profile ci --out /tmp/ci   # a minute or two
    python -m benchmarks.suite.run --tasks vt cwe --lengths 2000 --samples 5 --budgets 0.25
    python -m benchmarks.suite.run --profile ci --via server --concurrency 4
    python -m benchmarks.suite.run --backends vllm kvpress:snapkv --tasks needle --lengths 2000

Writes OUT/records.jsonl (one JSON record per sample, appended as each batch finishes, so an
interrupted run resumes without redoing finished samples) and OUT/summary.json. Offline, samples
run in batches of one task and length (continuous batching does the scheduling) and each record
carries its batch's wall time and size; through the server each record carries its own request
latency and the concurrency. Stock vLLM runs with plugins off in its own process; kvpress runs in
its own virtual environment (benchmarks.peers.kvpress_run).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

from benchmarks.engine import make_llm, run_in_subprocess
from benchmarks.suite.batches import run_batches
from benchmarks.suite.grid import PROFILES, Grid, GridError, job_key, make_grid
from benchmarks.suite.records import make_record
from sekv_vllm.tasks.ruler import chat_prompt, make_sample, split_after_question, token_counter

RESULTS = Path(__file__).resolve().parents[1] / "results"
# A task whose full-KV accuracy stays below this at every length is beyond the model, so it
# says nothing about compression: it is kept out of the averages (and named in the summary).
INFORMATIVE_FLOOR = 0.2
# The least share of full KV's accuracy a method should keep in every (family, length) cell the model can do.
CELL_TARGET = 0.85


def load_records(path: Path) -> list[dict]:
    """Records written so far; a line cut short by an interruption is dropped."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def pending_jobs(grid: Grid, records: list[dict]) -> list[dict]:
    done = {job_key(r) for r in records}
    return [j for j in grid.jobs() if job_key(j) not in done]


def worker(spec: dict) -> dict:
    """Offline vLLM (stock or sekv) in this process: LLM.generate per batch (`run_batches`: a sekv sample its
    request kept at full KV beside its batch runs again in a smaller one)."""
    from tqdm import tqdm
    from vllm import SamplingParams

    grid = Grid(**spec["grid"])
    sekv = grid.sekv_settings(spec["backend"])
    llm = make_llm(spec["model"], sekv, max(grid.lengths) + max(j["max_tokens"] for j in spec["jobs"]) + 256)
    tok = llm.get_tokenizer()
    count = token_counter(tok)

    def inputs(batch: list[dict]) -> tuple[list, list[str], list]:
        samples = [make_sample(j["task"], j["length"], j["depth"], j["seed"], count) for j in batch]
        params = [SamplingParams(temperature=0.0, max_tokens=j["max_tokens"],
                                 extra_args={"sekv_budget_ratio": j["budget"]} if sekv is not None else None)
                  for j in batch]
        return samples, [chat_prompt(s, tok) for s in samples], params

    written = retried = 0
    with tqdm(total=len(spec["jobs"]), desc=spec["backend"], unit="sample", file=sys.stderr) as bar, \
            Path(spec["records"]).open("a") as out:
        for done in run_batches(llm, spec["jobs"], inputs, sekv is not None, spec["backend"]):
            for job, sample, o, fig in zip(done.jobs, done.items, done.outputs, done.figures):
                out.write(json.dumps(make_record(job, sample.answers, o.outputs[0].text, len(o.prompt_token_ids),
                                                 done.seconds, done.size, fig)) + "\n")
            out.flush()
            written += len(done.jobs)
            retried += done.again
            bar.update(len(done.jobs))
    return {"written": written, "retried": retried}


def run_kvpress(grid: Grid, backend: str, jobs: list[dict], model: str, records: Path) -> None:
    from transformers import AutoTokenizer

    from benchmarks.peers import kvpress_run

    tok = AutoTokenizer.from_pretrained(model)
    count = token_counter(tok)
    items = []
    for job in jobs:
        sample = make_sample(job["task"], job["length"], job["depth"], job["seed"], count)
        compressed, rest = split_after_question(sample, tok)
        items.append({"job": job, "compressed": compressed, "rest": rest, "answers": list(sample.answers)})
    kvpress_run.run({"model": model, "press": backend.split(":", 1)[1], "press_settings": grid.press_settings,
                     "records": str(records), "items": items})


def summarize(records: list[dict]) -> list[dict]:
    cells: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        cells[(r["backend"], r["budget"], r["task"], r["length"])].append(r)
    rows = []
    for (backend, budget, task, length), rs in sorted(cells.items(), key=lambda kv: (kv[0][2], kv[0][3], kv[0][0] != "vllm", kv[0][0], -kv[0][1])):
        fractions = [r["fast_tier_fraction"] for r in rs if r["fast_tier_fraction"] is not None]
        rows.append({"backend": backend, "budget": budget, "task": task, "length": length, "samples": len(rs),
                     "accuracy": statistics.mean(r["score"] for r in rs),
                     "fast_tier_fraction": statistics.mean(fractions) if fractions else (1.0 if backend == "vllm" else None),
                     # sekv samples served at full KV (no compression figures): counted, never hidden in the mean
                     "kept_full_kv": len(rs) - len(fractions) if backend.startswith("sekv") else 0,
                     "mean_seconds": statistics.mean(r["batch_seconds"] / (1 if r.get("via") == "server" else r["batch_size"]) for r in rs)})
    return rows


def averages(rows: list[dict]) -> dict:
    """Mean accuracy per (backend, budget) over the informative tasks' cells, and its ratio to full KV's."""
    full = {(r["task"], r["length"]): r["accuracy"] for r in rows if r["backend"] == "vllm"}
    tasks = sorted({r["task"] for r in rows})
    excluded = [t for t in tasks if full and max((a for (task, _), a in full.items() if task == t), default=1.0) < INFORMATIVE_FLOOR]
    out = []
    for backend, budget in sorted({(r["backend"], r["budget"]) for r in rows}):
        cells = [r for r in rows if (r["backend"], r["budget"]) == (backend, budget) and r["task"] not in excluded]
        if not cells:
            continue
        acc = statistics.mean(r["accuracy"] for r in cells)
        ref = [full[(r["task"], r["length"])] for r in cells if (r["task"], r["length"]) in full]
        rel = acc / statistics.mean(ref) if ref and statistics.mean(ref) > 0 else None
        out.append({"backend": backend, "budget": budget, "cells": len(cells), "accuracy": acc, "relative_to_full_kv": rel})
    return {"floor": INFORMATIVE_FLOOR, "excluded_tasks": excluded, "rows": out}


def _pairs(records: list[dict], backend: str, budget: float, task: str, length: int) -> list[tuple[float, float]]:
    """(score, full KV's score on the same sample) of each of a cell's samples that full KV also ran."""
    full = {r["seed"]: r["score"] for r in records if (r["backend"], r["task"], r["length"]) == ("vllm", task, length)}
    return [(r["score"], full[r["seed"]]) for r in records
            if (r["backend"], r["budget"], r["task"], r["length"]) == (backend, budget, task, length) and r["seed"] in full]


def _sign_test(pairs: list[tuple[float, float]]) -> dict:
    """How many samples scored lower than full KV's, how many higher, and the one-sided sign test's p-value of
    that many lower or more were each changed sample as likely to go either way."""
    lower = sum(a < b for a, b in pairs)
    changed = lower + sum(a > b for a, b in pairs)
    p = sum(math.comb(changed, k) for k in range(lower, changed + 1)) / 2 ** changed
    return {"samples_lower": lower, "samples_higher": changed - lower, "sign_test_p": p}


def paired(records: list[dict], backend: str, budget: float, task: str, length: int) -> dict:
    """A cell's samples scored against full KV's on the same sample (seed): `_sign_test`."""
    return _sign_test(_pairs(records, backend, budget, task, length))


def headline(rows: list[dict], avg: dict, backends: list[str], records: list[dict]) -> dict:
    """The method's figures the targets are read from: its first SeKV backend (the grid's default method), the
    families averaged, and per budget its fast tier (share of full KV's bytes, everything counted), its average
    accuracy over full KV's, its lowest ratio to full KV in any one (family, length) cell the model can do (full
    KV at least the informative floor there) and those cells below CELL_TARGET of full KV's, each with its
    samples compared to full KV's (`paired`), and every sample of those cells against full KV's on the same
    sample (`samples_against_full`: how many lower and higher, the sign test, the mean absolute difference of
    their scores: how closely the method follows full KV, wins and losses both counted)."""
    method = next((b for b in backends if b.startswith("sekv")), None)
    if method is None:
        return {}
    full = {(r["task"], r["length"]): r["accuracy"] for r in rows if r["backend"] == "vllm"}
    mine = [r for r in rows if r["backend"] == method and r["task"] not in avg["excluded_tasks"]]
    budgets = sorted({r["budget"] for r in mine})

    def cells(budget: float) -> list[dict]:
        return [{"task": r["task"], "length": r["length"], "accuracy": r["accuracy"],
                 "full_kv": full[(r["task"], r["length"])], "ratio": r["accuracy"] / full[(r["task"], r["length"])]}
                for r in mine if r["budget"] == budget and full.get((r["task"], r["length"]), 0) >= INFORMATIVE_FLOOR]

    def below(budget: float) -> list[dict]:
        return [c | paired(records, method, budget, c["task"], c["length"]) for c in cells(budget)
                if c["ratio"] < CELL_TARGET]

    def against_full(budget: float) -> dict:
        pairs = [pair for c in cells(budget) for pair in _pairs(records, method, budget, c["task"], c["length"])]
        diff = statistics.mean(abs(a - b) for a, b in pairs) if pairs else None
        return {"samples": len(pairs), **_sign_test(pairs), "mean_abs_difference": diff}

    def worst(budget: float) -> float | None:
        return min((c["ratio"] for c in cells(budget)), default=None)

    fractions = {b: [r["fast_tier_fraction"] for r in mine if r["budget"] == b and r["fast_tier_fraction"] is not None]
                 for b in budgets}
    return {
        "method": method,
        "families": sorted({r["task"] for r in mine}),
        "fast_tier_fraction": {str(b): statistics.mean(f) if f else None for b, f in fractions.items()},
        "ratio_to_full": {str(a["budget"]): a["relative_to_full_kv"] for a in avg["rows"] if a["backend"] == method},
        "lowest_cell_ratio_to_full": {str(b): worst(b) for b in budgets},
        "cells_below_target": {str(b): below(b) for b in budgets},
        "samples_against_full": {str(b): against_full(b) for b in budgets},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--profile", default=None, help=f"one of {sorted(PROFILES)}; other flags override its fields")
    parser.add_argument("--tasks", nargs="+", default=None)
    parser.add_argument("--lengths", nargs="+", type=int, default=None)
    parser.add_argument("--samples", type=int, default=None)
    parser.add_argument("--budgets", nargs="+", type=float, default=None)
    parser.add_argument("--backends", nargs="+", default=None, help="vllm, sekv, kvpress:PRESS")
    parser.add_argument("--via", default=None, help="offline (LLM.generate) or server (OpenAI HTTP)")
    parser.add_argument("--concurrency", type=int, default=None, help="requests in flight with --via server")
    parser.add_argument("--sekv-config", type=json.loads, default=None, help="JSON SeKVConfig fields")
    parser.add_argument("--press-settings", type=json.loads, default=None, help="JSON keyword settings of the "
                        "kvpress presses")
    parser.add_argument("--split", default=None, help="eval (default: the published samples) or dev (other "
                        "samples, to tune settings on)")
    parser.add_argument("--model", default=None)
    parser.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/suite-PROFILE")
    parser.add_argument("--fresh", action="store_true", help="discard earlier records instead of resuming")
    args = parser.parse_args(argv)
    if args.worker:
        print("RESULT " + json.dumps(worker(json.loads(args.worker))))
        return 0
    try:
        grid = make_grid(args.profile, tasks=args.tasks, lengths=args.lengths, samples=args.samples,
                         budgets=args.budgets, backends=args.backends, sekv_config=args.sekv_config,
                         press_settings=args.press_settings,
                         via=args.via, concurrency=args.concurrency, split=args.split)
    except GridError as err:
        parser.error(str(err))
    from sekv_vllm.entrypoints.default_model import prepare_default_model

    model = args.model or str(prepare_default_model())
    out_dir = args.out or RESULTS / f"suite-{args.profile or 'custom'}"
    out_dir.mkdir(parents=True, exist_ok=True)
    records_path = out_dir / "records.jsonl"
    if args.fresh and records_path.exists():
        records_path.unlink()
    start = time.time()
    for backend in grid.backends:
        jobs = [j for j in pending_jobs(grid, load_records(records_path)) if j["backend"] == backend]
        if not jobs:
            continue
        if backend.startswith("kvpress:"):
            run_kvpress(grid, backend, jobs, model, records_path)
        elif grid.via == "server":
            from benchmarks.suite.server import run_server

            run_server(grid, backend, jobs, model, records_path)
        else:
            spec = {"model": model, "grid": grid.model_dump(), "backend": backend, "jobs": jobs,
                    "records": str(records_path)}
            run_in_subprocess("benchmarks.suite.run", spec, stock=backend == "vllm", show_progress=True)
    records = [r for r in load_records(records_path) if job_key(r) in {job_key(j) for j in grid.jobs()}]
    rows = summarize(records)
    summary = {"command": "python -m benchmarks.suite.run " + " ".join(argv if argv is not None else sys.argv[1:]),
               "grid": grid.model_dump(), "model": Path(model).name, "seconds_this_run": round(time.time() - start),
               # Generation time of every record (a batch's time shared by its samples), resumed runs included.
               "sample_seconds": round(sum(r["batch_seconds"] / (1 if r.get("via") == "server" else r["batch_size"])
                                           for r in records)),
               "rows": rows, "averages": averages(rows)}
    summary.update(headline(rows, summary["averages"], grid.backends, records))
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"{'task':<16}{'tokens':>7}{'backend':>28}{'budget':>8}{'n':>4}{'acc':>7}{'fast tier':>11}{'s/sample':>10}")
    for r in rows:
        ft = "-" if r["fast_tier_fraction"] is None else f"{100 * r['fast_tier_fraction']:.1f}%"
        print(f"{r['task']:<16}{r['length']:>7}{r['backend']:>28}{r['budget']:>8.3f}{r['samples']:>4}"
              f"{r['accuracy']:>7.2f}{ft:>11}{r['mean_seconds']:>10.2f}")
    for r in rows:
        if r["kept_full_kv"]:
            print(f"warning: {r['backend']} {r['budget']} {r['task']} {r['length']}: {r['kept_full_kv']} of "
                  f"{r['samples']} samples served at full KV (kept_full_kv)", file=sys.stderr)
    print(f"records: {records_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
