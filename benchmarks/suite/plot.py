"""Accuracy against the fast-tier fraction, one panel per task, one line per policy, from a
suite summary; the dashed line is full KV. Accuracy is averaged over the run's lengths.

    python -m benchmarks.suite.plot --profile quick    # -> benchmarks/results/suite-quick/accuracy.png
    python -m benchmarks.suite.plot --run benchmarks/results/suite-zoom-1k-18   # any run's folder
"""
from __future__ import annotations

import argparse
import json
import statistics
import textwrap
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results"


# characters of a 9-point title per inch of figure width (DejaVu Sans, with a margin)
_CHARS_PER_INCH = 13


def title_lines(summary: dict, chars: int) -> list[str]:
    """The figure's title (model and the run's command) in lines of at most `chars` characters: a long command
    (a run's --tasks, --lengths, --out) is wrapped, not cut at the figure's edge."""
    return textwrap.wrap(f"{summary['model']}: {summary['command'].strip()}", width=chars, break_on_hyphens=False)


def plot(summary: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary["rows"]
    tasks = sorted({r["task"] for r in rows})
    policies = sorted({r["backend"] for r in rows if r["backend"] != "vllm"}, key=lambda b: (b != "sekv", b))
    fig, axes = plt.subplots(1, len(tasks), figsize=(4 * len(tasks), 3.6), sharey=True, squeeze=False)
    for ax, task in zip(axes[0], tasks):
        for i, policy in enumerate(policies):
            budgets = sorted({r["budget"] for r in rows if r["backend"] == policy and r["task"] == task})
            pts = []
            for b in budgets:
                cell = [r for r in rows if r["backend"] == policy and r["task"] == task and r["budget"] == b]
                fracs = [r["fast_tier_fraction"] for r in cell if r["fast_tier_fraction"]]
                if fracs:
                    pts.append((statistics.mean(fracs), statistics.mean(r["accuracy"] for r in cell)))
            if pts:
                ax.plot(*zip(*sorted(pts)), "o-", color=f"C{i}", label=policy)
        full = [r["accuracy"] for r in rows if r["task"] == task and r["backend"] == "vllm"]
        if full:
            ax.axhline(statistics.mean(full), color="k", linestyle="--", linewidth=1, label="full KV")
        ax.set_title(f"{task} (mean over {len({r['length'] for r in rows})} lengths)", fontsize=9)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("fast tier / full KV")
        ax.set_ylim(-0.05, 1.05)
    axes[0][0].set_ylabel("accuracy")
    axes[0][-1].legend(fontsize=7, loc="lower right")
    title = title_lines(summary, chars=int(_CHARS_PER_INCH * fig.get_figwidth()))
    fig.suptitle("\n".join(title), fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--profile", default="quick")
    parser.add_argument("--run", type=Path, default=None, help="a run's folder (its summary.json); default: the "
                        "profile's, benchmarks/results/suite-PROFILE")
    args = parser.parse_args()
    folder = args.run or RESULTS / f"suite-{args.profile}"
    if not (folder / "summary.json").exists():
        parser.error(f"{'--run' if args.run else '--profile'}: {folder} has no summary.json (a suite run's folder, "
                     "written by python -m benchmarks.suite.run)")
    out = folder / "accuracy.png"
    plot(json.loads((folder / "summary.json").read_text()), out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
