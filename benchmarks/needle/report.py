"""Markdown table from a needle results file, written into the README between markers.

    python -m benchmarks.needle.report                 # README.md <- benchmarks/results/needle_cpu.json
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BEGIN, END = "<!-- needle-results:begin -->", "<!-- needle-results:end -->"


def table(result: dict) -> str:
    lines = [
        f"Command: `{result['command'].strip()}` ({result['seconds']} s on {result['machine']['cpu_count']} CPU cores, "
        f"{result['model']}, greedy, {len(result['spec']['tasks'])} tasks x {result['spec']['samples']} needle depths "
        f"per length). Source: `benchmarks/results/{result.get('file', 'needle_cpu.json')}`.",
        "",
        "| backend | prompt tokens | budget | accuracy | fast tier / full KV | host pool / full KV | zoomed spans per layer-step | prefill time vs stock | decode time per token vs stock |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["summary"]["rows"]:
        pct = lambda x: "-" if x is None else f"{100 * x:.1f}%"  # noqa: E731
        num = lambda x: "-" if x is None else f"{x:.1f}"  # noqa: E731
        lines.append(
            f"| {r['backend']} | ~{r['target_tokens']} | {r['budget_ratio']:.3g} | {r['accuracy']:.2f} | "
            f"{pct(r['fast_tier_fraction'])} | {pct(r.get('host_pool_fraction'))} | {num(r.get('mean_zoomed_spans'))} | "
            f"{r['prefill_ratio']:.2f}x | {r['decode_ratio']:.2f}x |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results" / "needle_cpu.json")
    parser.add_argument("--readme", type=Path, default=ROOT / "README.md")
    args = parser.parse_args()
    result = json.loads(args.results.read_text())
    result["file"] = args.results.name
    block = f"{BEGIN}\n{table(result)}\n{END}"
    text = args.readme.read_text()
    if BEGIN in text:
        text = re.sub(re.escape(BEGIN) + r".*?" + re.escape(END), lambda _: block, text, flags=re.S)
    else:
        raise SystemExit(f"{args.readme} has no {BEGIN} ... {END} block")
    args.readme.write_text(text)
    print(block)


if __name__ == "__main__":
    main()
