"""Teacher-forced fidelity runs side by side (`benchmarks.suite.fidelity`): per cell, each setting's gap to
full KV in nats per step, over every step and over the answer's tokens, as a bar chart and a markdown table.
Runs with the same sekv settings (`--sekv-config`) are one series: a setting's cells may come from several runs.

    python -m benchmarks.suite.fidelity_plot benchmarks/results/fidelity-dev/* \
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


def series(runs: list[Path]) -> dict[str, dict[tuple, dict]]:
    """Series label (the sekv settings, "defaults" for none) -> its rows by (task, length, backend, budget), the
    runs with the same settings merged (a later run's row replaces an earlier one's)."""
    out: dict[str, dict[tuple, dict]] = {}
    for run in runs:
        summary = load(run)
        config = summary["grid"].get("sekv_config") or {}
        name = json.dumps(config, separators=(",", ":")) if config else "defaults"
        for r in summary["rows"]:
            out.setdefault(name, {})[(r["task"], r["length"], r["backend"], r["budget"])] = r
    return out


def cells(by_series: dict[str, dict[tuple, dict]]) -> list[tuple]:
    """(task, length, backend, budget) of every row of any series, in the order the table lists them."""
    keys = {k for rows in by_series.values() for k in rows}
    return sorted(keys, key=lambda k: (k[0], k[1], k[2], -k[3]))


def table(runs: list[Path]) -> str:
    """Per cell and series: nats per step below full KV over every step / over the answer's tokens (agreement)."""
    by_series = series(runs)
    head = "| cell | " + " | ".join(by_series) + " |\n| --- |" + " --- |" * len(by_series) + "\n"
    lines = []
    for cell in cells(by_series):
        out = []
        for rows in by_series.values():
            row = rows.get(cell)
            out.append("-" if row is None else " / ".join(
                "-" if row[k] is None else f"{row[k]:.3f}" for k, _ in FIGURES) + f" ({row['agreement']:.3f})")
        lines.append(f"| {cell[0]} {cell[1]} {cell[3]:g} | " + " | ".join(out) + " |")
    return head + "\n".join(lines) + "\n"


def plot(runs: list[Path], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_series = series(runs)
    keys = cells(by_series)
    fig, axes = plt.subplots(len(FIGURES), 1, figsize=(min(18, max(8, 0.25 * len(keys) * len(by_series))), 7), squeeze=False)
    width = 0.8 / len(by_series)
    for ax, (field, what) in zip(axes[:, 0], FIGURES):
        for i, (name, rows) in enumerate(by_series.items()):
            ys = [rows[k][field] if k in rows and rows[k][field] is not None else 0.0 for k in keys]
            ax.bar([j + i * width for j in range(len(keys))], ys, width, color=f"C{i}", label=name)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(keys))])
        ax.set_xticklabels([f"{t.removeprefix('niah_')}\n{n // 1000}K {b:g}" for t, n, _, b in keys], fontsize=7)
        ax.set_ylabel(f"nats/step below full KV\n({what})", fontsize=8)
        ax.axhline(0, color="k", linewidth=0.8)
    axes[0][0].legend(fontsize=7)
    command = "python -m benchmarks.suite.fidelity_plot " + " ".join(str(r) for r in runs)
    model = next((m for m in (load(r).get("model") for r in runs) if m), "")
    fig.suptitle("\n".join(title_lines({"model": model, "command": command},
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
