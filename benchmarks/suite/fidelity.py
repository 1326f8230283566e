"""Teacher-forced fidelity to full KV: how closely a method follows full KV's own answer, token by token.

    python -m benchmarks.suite.fidelity --tasks vt cwe --lengths 1000 4000 --samples 10 --split dev \
        --budgets 0.125 0.25 --out benchmarks/results/fidelity-dev
    python -m benchmarks.suite.fidelity ... --sekv-config '{"window": 32}' --reference DIR --out DIR2

Full KV (stock vLLM) answers each sample greedily; its token ids are the reference (REF/reference.jsonl,
made once and reused by every run that names it). Each other backend then decodes the same prompt with
its output forced to the reference's tokens (a logits processor), so every step sees full KV's answer so
far, and vLLM's raw log-probabilities (before the processor) say what the method would have said there:
per sample `agreement` (share of steps whose top token is the reference's), `first_miss` (the first step
whose is not; the reference's length where none) and `nll` (mean negative log-probability of the
reference's tokens, nats). Accuracy flips whole samples on one token; these count every step, so a
setting that moves them does so on fewer samples. OUT/fidelity.jsonl holds one record per sample
(resumable), OUT/summary.json the means per cell.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from benchmarks.engine import command_line, make_llm, run_in_subprocess
from benchmarks.suite.grid import Grid, GridError, job_key, make_grid
from benchmarks.suite.records import prompt_id
from benchmarks.suite.batches import run_batches
from benchmarks.suite.run import load_records
from sekv_vllm.tasks.ruler import chat_prompt, make_sample, token_counter

FORCED_KEY = "forced_tokens"


def forced_tokens_processor():
    """vLLM's logits processor class that forces a request's output to the token ids of its
    `extra_args[FORCED_KEY]` (requests without them are left alone)."""
    import torch
    from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

    class ForcedTokens(AdapterLogitsProcessor):
        def is_argmax_invariant(self) -> bool:
            return False

        def new_req_logits_processor(self, params):
            forced = (params.extra_args or {}).get(FORCED_KEY)
            if forced is None:
                return None

            def force(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
                step = len(output_ids)
                if step < len(forced):
                    token = forced[step]
                    logits.fill_(float("-inf"))
                    logits[token] = 0.0
                return logits

            return force

    return ForcedTokens


def answer_steps(pieces: list[str], answers: tuple[str, ...]) -> list[int]:
    """The steps of a reference whose token (its text, pieces[i]) overlaps an occurrence of an expected
    answer in the reference's text (case-insensitive): the tokens that score."""
    text = "".join(pieces).lower()
    covered = [False] * len(text)
    for a in answers:
        at = text.find(a.lower())
        while at >= 0 and a:
            covered[at:at + len(a)] = [True] * len(a)
            at = text.find(a.lower(), at + 1)
    steps, pos = [], 0
    for i, p in enumerate(pieces):
        if any(covered[pos:pos + len(p)]):
            steps.append(i)
        pos += len(p)
    return steps


def step_metrics(ranks: list[int], logprobs: list[float], ref_logprobs: list[float], scored: list[int]) -> dict:
    """One forced sample's figures from each step's rank of the reference token under the method's raw
    distribution (1: its top token), that token's log-probability, and full KV's own (ref_logprobs):
    `nll_gap` is the mean of full KV's log-probability less the method's, nats per step (0: as sure);
    `answer_*` the same over the steps in `scored` (`answer_steps`; None where there are none)."""
    n = len(ranks)
    misses = [i for i, r in enumerate(ranks) if r != 1]
    gaps = [a - b for a, b in zip(ref_logprobs, logprobs)]
    return {"steps": n, "agreement": sum(r == 1 for r in ranks) / n if n else 1.0,
            "first_miss": misses[0] if misses else n, "nll": -sum(logprobs) / n if n else 0.0,
            "nll_gap": sum(gaps) / n if n else 0.0, "miss_steps": misses, "answer_steps": len(scored),
            "answer_agreement": sum(ranks[i] == 1 for i in scored) / len(scored) if scored else None,
            "answer_nll_gap": sum(gaps[i] for i in scored) / len(scored) if scored else None}


def worker(spec: dict) -> dict:
    """One engine: stock vLLM writes the references, a sekv backend the forced records (`run_batches`: a sample
    its request kept at full KV beside its batch runs again in a smaller one; `kept_full_kv` marks one that
    kept it alone)."""
    from vllm import SamplingParams

    grid = Grid(**spec["grid"])
    sekv = grid.sekv_settings(spec["backend"])
    refs = spec["references"]
    llm = make_llm(spec["model"], sekv, max(grid.lengths) + max(j["max_tokens"] for j in spec["jobs"]) + 256,
                   logits_processors=None if sekv is None else [forced_tokens_processor()])
    tok = llm.get_tokenizer()
    count = token_counter(tok)

    def inputs(batch: list[dict]) -> tuple[list, list[str], list]:
        samples = [make_sample(j["task"], j["length"], j["depth"], j["seed"], count) for j in batch]
        if sekv is None:
            params = [SamplingParams(temperature=0.0, max_tokens=j["max_tokens"], logprobs=0) for j in batch]
        else:
            params = [SamplingParams(temperature=0.0, max_tokens=len(refs[prompt_id(j)]["token_ids"]), logprobs=1,
                                     extra_args={"sekv_budget_ratio": j["budget"],
                                                 FORCED_KEY: refs[prompt_id(j)]["token_ids"]}) for j in batch]
        return samples, [chat_prompt(s, tok) for s in samples], params

    retried = 0
    with open(spec["out"], "a") as out:
        for done in run_batches(llm, spec["jobs"], inputs, sekv is not None, spec["backend"]):
            retried += done.again
            for job, sample, o, fig in zip(done.jobs, done.items, done.outputs, done.figures):
                got = o.outputs[0]
                record = {"prompt_id": prompt_id(job), **job}
                if sekv is None:
                    record["token_ids"] = list(got.token_ids)
                    record["logprobs"] = [lp[t].logprob for t, lp in zip(got.token_ids, got.logprobs)]
                else:
                    steps = [lp[t] for t, lp in zip(got.token_ids, got.logprobs)]
                    # the method's own top token where it differs from the reference's
                    record["miss_tokens"] = [next(t for t, x in lp.items() if x.rank == 1)
                                             for t, lp in zip(got.token_ids, got.logprobs) if lp[t].rank != 1]
                    scored = answer_steps([tok.decode([t]) for t in got.token_ids], sample.answers)
                    record |= step_metrics([s.rank for s in steps], [s.logprob for s in steps],
                                           refs[prompt_id(job)]["logprobs"], scored)
                    record["sekv_config"] = grid.sekv_config
                    record["kept_full_kv"] = fig is None
                out.write(json.dumps(record) + "\n")
            out.flush()
    return {"written": len(spec["jobs"]), "retried": retried}


def summarize(records: list[dict]) -> list[dict]:
    """Means per (backend, budget, task, length) cell; the answer figures over the samples whose reference
    holds an answer (`answer_samples`); `kept_full_kv`: samples whose request was served at full KV even alone
    (records before that was counted have no such field)."""
    cells: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        cells[(r["backend"], r["budget"], r["task"], r["length"])].append(r)

    def mean(rs: list[dict], key: str) -> float | None:
        xs = [r[key] for r in rs if r[key] is not None]
        return statistics.mean(xs) if xs else None

    return [{"backend": b, "budget": x, "task": t, "length": n, "samples": len(rs),
             **{k: mean(rs, k) for k in ("agreement", "first_miss", "nll", "nll_gap", "steps", "answer_agreement",
                                         "answer_nll_gap")},
             "answer_samples": sum(r["answer_agreement"] is not None for r in rs),
             "kept_full_kv": sum(bool(r.get("kept_full_kv")) for r in rs)}
            for (b, x, t, n), rs in sorted(cells.items(), key=lambda kv: (kv[0][2], kv[0][3], kv[0][0], -kv[0][1]))]


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--tasks", nargs="+")
    parser.add_argument("--lengths", nargs="+", type=int)
    parser.add_argument("--samples", type=int)
    parser.add_argument("--budgets", nargs="+", type=float)
    parser.add_argument("--backends", nargs="+", default=["sekv:router"], help="sekv backends (suite names)")
    parser.add_argument("--sekv-config", type=json.loads, default=None, help="JSON SeKVConfig fields")
    parser.add_argument("--split", default="dev", help="dev (default) or eval")
    parser.add_argument("--model", default=None)
    parser.add_argument("--out", type=Path, default=None, help="required: the run's folder")
    parser.add_argument("--reference", type=Path, default=None, help="folder of full KV's reference.jsonl "
                        "(made there when missing); default: OUT")
    args = parser.parse_args(argv)
    if args.worker:
        print("RESULT " + json.dumps(worker(json.loads(args.worker))))
        return 0
    if args.out is None:
        parser.error("--out: required (the run's folder)")
    bad = [b for b in args.backends if not b.startswith("sekv")]
    if bad:
        parser.error(f"--backends: {bad} are not sekv backends; full KV is the reference, kvpress is not forced")
    try:
        grid = make_grid(None, tasks=args.tasks, lengths=args.lengths, samples=args.samples, budgets=args.budgets,
                         backends=("vllm", *args.backends), sekv_config=args.sekv_config, split=args.split)
    except GridError as err:
        parser.error(str(err))
    from sekv_vllm.entrypoints.default_model import prepare_default_model

    model = args.model or str(prepare_default_model())
    args.out.mkdir(parents=True, exist_ok=True)
    ref_dir = args.reference or args.out
    ref_dir.mkdir(parents=True, exist_ok=True)
    ref_path, out_path = ref_dir / "reference.jsonl", args.out / "fidelity.jsonl"
    jobs = grid.jobs()

    def pending(path: Path, backend: str) -> list[dict]:
        done = {job_key(r) for r in load_records(path)}
        return [j for j in jobs if j["backend"] == backend and job_key(j) not in done]

    base = {"model": model, "grid": grid.model_dump()}
    todo = pending(ref_path, "vllm")
    if todo:
        run_in_subprocess("benchmarks.suite.fidelity", {**base, "backend": "vllm", "jobs": todo, "references": {},
                                                        "out": str(ref_path)}, stock=True, show_progress=True)
    refs = {r["prompt_id"]: {"token_ids": r["token_ids"], "logprobs": r["logprobs"]} for r in load_records(ref_path)}
    for backend in args.backends:
        todo = pending(out_path, backend)
        if todo:
            run_in_subprocess("benchmarks.suite.fidelity", {**base, "backend": backend, "jobs": todo,
                                                            "references": refs, "out": str(out_path)},
                              stock=False, show_progress=True)
    keys = {job_key(j) for j in jobs}
    records = [r for r in load_records(out_path) if job_key(r) in keys]
    rows = summarize(records)
    (args.out / "summary.json").write_text(json.dumps(
        {"command": command_line("benchmarks.suite.fidelity", argv), "model": Path(model).name, "grid": grid.model_dump(),
         "reference": str(ref_path), "rows": rows}, indent=1))
    print(f"{'task':<16}{'tokens':>7}{'backend':>16}{'budget':>8}{'n':>4}{'agree':>7}{'1st miss':>9}{'nll':>7}"
          f"{'gap':>7}{'ans agree':>10}{'ans gap':>8}")
    for r in rows:
        print(f"{r['task']:<16}{r['length']:>7}{r['backend']:>16}{r['budget']:>8.3f}{r['samples']:>4}"
              f"{r['agreement']:>7.3f}{r['first_miss']:>9.1f}{r['nll']:>7.3f}{r['nll_gap']:>7.3f}"
              f"{_fmt(r['answer_agreement']):>10}{_fmt(r['answer_nll_gap']):>8}")
        if r["kept_full_kv"]:
            print(f"warning: {r['backend']} {r['budget']} {r['task']} {r['length']}: {r['kept_full_kv']} of "
                  f"{r['samples']} samples served at full KV (kept_full_kv)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
