"""Several suite runs side by side (same grid of tasks, lengths and seeds), one column per sekv setting.

    python -m benchmarks.suite.compare benchmarks/results/suite-sweep/* --full benchmarks/results/suite-window64-s6 \
        --block suite-sweep

Each run directory holds a `summary.json` of `benchmarks.suite.run`; a column is one (run, backend,
budget) with the run's `--sekv-config` in its name. Full KV's accuracy comes from `--full` (a run
with the `vllm` backend on the same seeds: stock vLLM is deterministic, so it is not rerun for every
setting). The average is over every cell; its ratio is to full KV's average over the same cells.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.readme import table_head, write_block


def load(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


def columns_of(run: Path, summary: dict) -> dict[str, dict[tuple[str, int], dict]]:
    """Column name -> cells (task, length) -> row, for every sekv backend and budget of one run."""
    settings = json.dumps(summary["grid"].get("sekv_config") or {}, separators=(", ", ": "))
    out: dict[str, dict] = {}
    for r in summary["rows"]:
        if r["backend"] == "vllm":
            continue
        name = f"{run.name}: {r['backend']} {r['budget']:g}" + (f" {settings}" if settings != "{}" else "")
        out.setdefault(name, {})[(r["task"], r["length"])] = r
    return out


def table(runs: list[Path], full_run: Path) -> str:
    full = {(r["task"], r["length"]): r["accuracy"] for r in load(full_run)["rows"] if r["backend"] == "vllm"}
    if not full:
        raise SystemExit(f"{full_run} has no stock vLLM (`vllm`) rows")
    columns: dict[str, dict] = {}
    commands = []
    for run in runs:
        summary = load(run)
        columns.update(columns_of(run, summary))
        commands.append(f"`{summary['command'].strip()}`")
    cells = sorted({cell for col in columns.values() for cell in col} & set(full))
    lines = [
        f"Full KV: `{full_run}`; runs: " + "; ".join(commands) + ". Accuracy (string_match_all) per cell:",
        "",
        *table_head(["task", "tokens", "full KV", *columns]),
    ]
    for cell in cells:
        vals = [columns[c].get(cell) for c in columns]
        lines.append(f"| {cell[0]} | ~{cell[1]} | {full[cell]:.2f} | "
                     + " | ".join("-" if v is None else f"{v['accuracy']:.2f}" for v in vals) + " |")
    full_avg = sum(full[c] for c in cells) / len(cells)
    avgs = [sum(col[c]["accuracy"] for c in cells if c in col) / len(cells) if all(c in col for c in cells) else None
            for col in columns.values()]
    fractions = [sum(r["fast_tier_fraction"] for r in col.values()) / len(col) for col in columns.values()]
    lines.append("| fast tier / full KV (mean) | | 100% | " + " | ".join(f"{100 * f:.1f}%" for f in fractions) + " |")
    lines.append(f"| **average** | | **{full_avg:.2f}** | "
                 + " | ".join("-" if a is None else f"**{a:.2f}**" for a in avgs) + " |")
    lines.append("| average / full KV | | 1.00 | " + " | ".join("-" if a is None else f"{a / full_avg:.2f}" for a in avgs) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="suite output directories (each with summary.json)")
    parser.add_argument("--full", type=Path, required=True, help="a run with stock vLLM on the same seeds")
    parser.add_argument("--block", default=None, help="README block to write the table into")
    args = parser.parse_args()
    body = table(args.runs, args.full)
    print(write_block(args.block, body) if args.block else body)


if __name__ == "__main__":
    main()
