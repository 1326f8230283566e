"""How much of the cwe list's start each output copies, per run, backend and budget.

The default model answers cwe ("the 5 most common words in the numbered list") mostly by copying the
list's first items in order ("1. sister 2. arranged 3. ..."): its score is then whether those items
happen to be common words. This counts, for every cwe record of the runs given, the output's numbered
items that equal the list's items from the first on, and prints a markdown table (samples, mean items
copied, samples copying 0 / 1 / 2 / 3+ items, accuracy) per run, backend, budget and length.

    python -m benchmarks.suite.list_copy benchmarks/results/suite-dev-1k/cwe-18
"""
from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path

from sekv_vllm.tasks.ruler import make_sample, token_counter

_ITEM = re.compile(r"\d+\.\s*([A-Za-z]+)")


def items(text: str) -> list[str]:
    """The words of a numbered list ("1. word 2. word"), lower-cased, in order."""
    return [w.lower() for w in _ITEM.findall(text)]


def copied_head(listed: list[str], output: str) -> int:
    """How many of the output's numbered items equal the list's, from the first item on."""
    n = 0
    for got, want in zip(items(output), listed):
        if got != want:
            break
        n += 1
    return n


def table(rows: dict[tuple, list[tuple[int, float]]]) -> str:
    """rows: (run, backend, budget, length) -> [(items copied, score)] per sample."""
    out = ["| run | backend | budget | tokens | samples | items copied (mean) | 0 / 1 / 2 / 3+ | accuracy |",
           "|---|---|---|---|---|---|---|---|"]
    for (run, backend, budget, length), v in sorted(rows.items(), key=lambda kv: (kv[0][0], kv[0][3], -kv[0][2])):
        hist = [sum(1 for k, _ in v if k == i) for i in range(3)] + [sum(1 for k, _ in v if k >= 3)]
        out.append(f"| {run} | {backend} | {budget:g} | {length} | {len(v)} | {sum(k for k, _ in v) / len(v):.2f} "
                   f"| {' / '.join(map(str, hist))} | {sum(s for _, s in v) / len(v):.3f} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path, help="suite run folders (each with a records.jsonl)")
    ap.add_argument("--model", default=None, help="the tokenizer the samples were sized with (default model)")
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    from sekv_vllm.entrypoints.default_model import default_model_dir

    count = token_counter(AutoTokenizer.from_pretrained(args.model or str(default_model_dir())))
    rows: dict[tuple, list[tuple[int, float]]] = defaultdict(list)
    for run in args.runs:
        for line in (run / "records.jsonl").read_text().splitlines():
            r = json.loads(line)
            if r["task"] != "cwe":
                continue
            sample = make_sample("cwe", r["length"], r["depth"], r["seed"], count)
            rows[(run.name, r["backend"], r["budget"], r["length"])].append(
                (copied_head(items(sample.context), r["output"]), r["score"]))
    if not rows:
        raise SystemExit(f"no cwe records in {', '.join(map(str, args.runs))}")
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
