"""Accuracy table (task x length by backend/budget) from a suite summary, into the README.

    python -m benchmarks.suite.report --profile quick    # block suite-results
    python -m benchmarks.suite.report --profile centroids  # block suite-centroids (any other profile: suite-PROFILE)
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.readme import table_head, write_block

ROOT = Path(__file__).resolve().parents[2]


def column_name(backend: str, budget: float) -> str:
    if backend == "vllm":
        return "full KV"
    return f"{backend} {budget:g}"


def column_order(columns: set[tuple[str, float]]) -> list[tuple[str, float]]:
    """Full KV first, then sekv (default policy first), then peers; tighter budgets to the right."""
    return sorted(columns, key=lambda c: (c[0] != "vllm", not c[0].startswith("sekv"), c[0] != "sekv", c[0], -c[1]))


def table(summary: dict, source: str) -> str:
    rows = summary["rows"]
    columns = column_order({(r["backend"], r["budget"]) for r in rows})
    head = ["task", "tokens"] + [column_name(*c) for c in columns]
    lines = [
        f"Command: `{summary['command'].strip()}` ({summary['grid']['samples']} samples per cell, "
        f"{summary['model']}; {summary.get('sample_seconds', summary['seconds_this_run']) / 60:.0f} min of generation "
        f"in all). Source: `{source}`. Accuracy (string_match_all):",
        "",
        *table_head(head),
    ]
    cells = {(r["task"], r["length"], r["backend"], r["budget"]): r for r in rows}
    for task, length in sorted({(r["task"], r["length"]) for r in rows}):
        vals = [cells.get((task, length, *c)) for c in columns]
        lines.append(f"| {task} | ~{length} | " + " | ".join("-" if v is None else f"{v['accuracy']:.2f}" for v in vals) + " |")
    fractions = [cells.get((rows[0]["task"], rows[0]["length"], *c)) for c in columns]
    lines.append("| fast tier / full KV | | " + " | ".join(
        "-" if v is None or v["fast_tier_fraction"] is None else f"{100 * v['fast_tier_fraction']:.1f}%" for v in fractions) + " |")
    avg = summary.get("averages")
    if avg:
        by = {(a["backend"], a["budget"]): a for a in avg["rows"]}
        lines.append("| **average** (informative tasks) | | " + " | ".join(
            f"**{by[c]['accuracy']:.2f}**" if c in by else "-" for c in columns) + " |")
        lines.append("| average / full KV | | " + " | ".join(
            f"{by[c]['relative_to_full_kv']:.2f}" if c in by and by[c]["relative_to_full_kv"] is not None else "-"
            for c in columns) + " |")
        if avg["excluded_tasks"]:
            lines += ["", f"Kept out of the averages (full KV below {avg['floor']:g} at every length, so they say "
                          f"nothing about compression): {', '.join(avg['excluded_tasks'])}."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--profile", default="quick")
    args = parser.parse_args()
    path = ROOT / "benchmarks" / "results" / f"suite-{args.profile}" / "summary.json"
    block = "suite-results" if args.profile == "quick" else f"suite-{args.profile}"
    print(write_block(block, table(json.loads(path.read_text()), str(path.relative_to(ROOT)))))


if __name__ == "__main__":
    main()
