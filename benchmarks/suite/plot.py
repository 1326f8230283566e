"""Accuracy against the fast-tier fraction, one panel per task, from a suite summary.

    python -m benchmarks.suite.plot --profile quick    # -> benchmarks/results/suite-quick/accuracy.png
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results"


def plot(summary: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary["rows"]
    tasks = sorted({r["task"] for r in rows})
    lengths = sorted({r["length"] for r in rows})
    fig, axes = plt.subplots(1, len(tasks), figsize=(4 * len(tasks), 3.4), sharey=True, squeeze=False)
    for ax, task in zip(axes[0], tasks):
        for i, n in enumerate(lengths):
            color = f"C{i}"
            pts = sorted((r["fast_tier_fraction"], r["accuracy"]) for r in rows
                         if r["task"] == task and r["length"] == n and r["backend"] == "sekv" and r["fast_tier_fraction"])
            if pts:
                ax.plot(*zip(*pts), "o-", color=color, label=f"sekv ~{n}")
            full = [r["accuracy"] for r in rows if r["task"] == task and r["length"] == n and r["backend"] == "vllm"]
            if full:
                ax.axhline(full[0], color=color, linestyle="--", linewidth=1, label=f"full KV ~{n}")
        ax.set_title(task)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("fast tier / full KV")
        ax.set_ylim(-0.05, 1.05)
    axes[0][0].set_ylabel("accuracy")
    axes[0][-1].legend(fontsize=7, loc="lower right")
    fig.suptitle(f"{summary['model']}: {summary['command'].strip()}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--profile", default="quick")
    args = parser.parse_args()
    folder = RESULTS / f"suite-{args.profile}"
    out = folder / "accuracy.png"
    plot(json.loads((folder / "summary.json").read_text()), out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
