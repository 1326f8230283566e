"""Teacher-forced fidelity runs side by side (`benchmarks.suite.fidelity`): per cell, each run's gap to full
KV in nats per step, over every step and over the answer's tokens, as a bar chart and a markdown table.

    python -m benchmarks.suite.fidelity_plot benchmarks/results/fidelity-dev/{defaults,gates-0} \
        --out benchmarks/results/fidelity-dev/gaps.png
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.suite.plot import title_lines

FIGURES = (("nll_gap", "every step"), ("answer_nll_gap", "answer tokens"))


def load(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


def label(run: Path, summary: dict) -> str:
    config = summary["grid"].get("sekv_config") or {}
    return run.name + (" " + json.dumps(config, separators=(",", ":")) if config else "")


def cells(summaries: list[dict]) -> list[tuple]:
    """(task, length, backend, budget) of every row of any run, in the order the table lists them."""
    keys = {(r["task"], r["length"], r["backend"], r["budget"]) for s in summaries for r in s["rows"]}
    return sorted(keys, key=lambda k: (k[0], k[1], k[2], -k[3]))


def table(runs: list[Path]) -> str:
    summaries = [load(r) for r in runs]
    names = [label(r, s) for r, s in zip(runs, summaries)]
    head = "| cell | " + " | ".join(names) + " |\n| --- |" + " --- |" * len(names) + "\n"
    lines = []
    for cell in cells(summaries):
        out = []
        for s in summaries:
            row = next((r for r in s["rows"] if (r["task"], r["length"], r["backend"], r["budget"]) == cell), None)
            out.append("-" if row is None else " / ".join(
                "-" if row[k] is None else f"{row[k]:.3f}" for k, _ in FIGURES) + f" ({row['agreement']:.3f})")
        lines.append(f"| {cell[0]} {cell[1]} {cell[3]:g} | " + " | ".join(out) + " |")
    return head + "\n".join(lines) + "\n"


def plot(runs: list[Path], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summaries = [load(r) for r in runs]
    keys = cells(summaries)
    fig, axes = plt.subplots(1, len(FIGURES), figsize=(max(8, 1.2 * len(keys) * len(FIGURES)), 4), squeeze=False)
    width = 0.8 / len(runs)
    for ax, (field, what) in zip(axes[0], FIGURES):
        for i, (run, s) in enumerate(zip(runs, summaries)):
            rows = {(r["task"], r["length"], r["backend"], r["budget"]): r for r in s["rows"]}
            ys = [rows[k][field] if k in rows and rows[k][field] is not None else 0.0 for k in keys]
            ax.bar([j + i * width for j in range(len(keys))], ys, width, color=f"C{i}", label=label(run, s))
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(keys))])
        ax.set_xticklabels([f"{t}\n{n // 1000}K {b:g}" for t, n, _, b in keys], fontsize=8)
        ax.set_ylabel(f"nats per step below full KV ({what})")
        ax.axhline(0, color="k", linewidth=0.8)
    axes[0][-1].legend(fontsize=7)
    fig.suptitle("\n".join(title_lines({"model": summaries[0].get("model", ""), "command": summaries[0]["command"]},
                                       chars=int(13 * fig.get_figwidth()))), fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="folders of fidelity runs (their summary.json)")
    parser.add_argument("--out", type=Path, default=None, help="the bar chart's PNG (default: none, the table only)")
    args = parser.parse_args(argv)
    missing = [str(r) for r in args.runs if not (r / "summary.json").exists()]
    if missing:
        parser.error(f"runs: {missing} hold no summary.json (written by python -m benchmarks.suite.fidelity)")
    print(table(args.runs), end="")
    if args.out:
        plot(args.runs, args.out)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
