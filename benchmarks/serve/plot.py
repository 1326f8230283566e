"""The server-load figure: requests by outcome and latency percentiles, one bar group per backend.

    python -m benchmarks.serve.plot    # benchmarks/results/server_load_cpu.json -> server_load.png
"""
from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results"
OUTCOMES = ("served", "dropped", "refused", "valid_failed", "bad_not_refused")


def plot(result: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    backends = result["backends"]
    names = list(backends)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        counts = [backends[name]["outcomes"].get(o, 0) for o in OUTCOMES]
        xs = [j + i * width for j in range(len(OUTCOMES))]
        left.bar(xs, counts, width, label=name)
        for x, c in zip(xs, counts):
            left.text(x, c, str(c), ha="center", va="bottom", fontsize=7)
    left.set_xticks([j + 0.4 - width / 2 for j in range(len(OUTCOMES))], OUTCOMES, fontsize=8)
    left.set_ylabel("requests")
    left.set_title("requests by outcome", fontsize=9)
    left.legend(fontsize=8)
    metrics = [("ttft_s", "p50"), ("ttft_s", "p90"), ("tpot_s", "p50"), ("tpot_s", "p90"), ("e2e_s", "p50"),
               ("e2e_s", "p90")]
    for i, name in enumerate(names):
        values = [backends[name][m].get(p, 0) for m, p in metrics]
        right.bar([j + i * width for j in range(len(metrics))], values, width, label=name)
    right.set_xticks([j + 0.4 - width / 2 for j in range(len(metrics))],
                     [f"{m[:-2]} {p}" for m, p in metrics], fontsize=8)
    right.set_yscale("log")
    right.set_ylabel("seconds (requests served)")
    right.set_title("latency", fontsize=9)
    right.legend(fontsize=8)
    fig.suptitle(result["command"], fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":
    src = RESULTS / "server_load_cpu.json"
    print(plot(json.loads(src.read_text()), RESULTS / "server_load.png"))
