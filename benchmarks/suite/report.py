"""Accuracy table (task x length by backend/budget) from a suite summary, into the README.

    python -m benchmarks.suite.report --profile quick
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BEGIN, END = "<!-- suite-results:begin -->", "<!-- suite-results:end -->"


def table(summary: dict, source: str) -> str:
    rows = summary["rows"]
    columns = sorted({(r["backend"], r["budget"]) for r in rows}, key=lambda c: (c[0] == "sekv", -c[1]))
    head = ["task", "tokens"] + [("full KV" if b == "vllm" else f"sekv {budget:g}") for b, budget in columns]
    lines = [
        f"Command: `{summary['command'].strip()}` ({summary['grid']['samples']} samples per cell, "
        f"{summary['model']}). Source: `{source}`. Accuracy (string_match_all):",
        "",
        "| " + " | ".join(head) + " |",
        "| " + " | ".join("---" for _ in head) + " |",
    ]
    cells = {(r["task"], r["length"], r["backend"], r["budget"]): r["accuracy"] for r in rows}
    for task, length in sorted({(r["task"], r["length"]) for r in rows}):
        vals = [cells.get((task, length, b, budget)) for b, budget in columns]
        lines.append(f"| {task} | ~{length} | " + " | ".join("-" if v is None else f"{v:.2f}" for v in vals) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--profile", default="quick")
    parser.add_argument("--readme", type=Path, default=ROOT / "README.md")
    args = parser.parse_args()
    path = ROOT / "benchmarks" / "results" / f"suite-{args.profile}" / "summary.json"
    block = f"{BEGIN}\n{table(json.loads(path.read_text()), str(path.relative_to(ROOT)))}\n{END}"
    text = args.readme.read_text()
    if BEGIN not in text:
        raise SystemExit(f"{args.readme} has no {BEGIN} ... {END} block")
    args.readme.write_text(re.sub(re.escape(BEGIN) + r".*?" + re.escape(END), lambda _: block, text, flags=re.S))
    print(block)


if __name__ == "__main__":
    main()
