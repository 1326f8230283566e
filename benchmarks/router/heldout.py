"""Zoom policies against the teacher on held-out training-distribution texts (no vLLM).

    python -m benchmarks.router.heldout --config configs/router-smollm2-135m.toml

For the held-out texts of a router training config (seeds disjoint from training and from the
suite), each policy's hard zoom under each text's budget: recall of the teacher's positive spans,
share of span attention mass zoomed, spans zoomed, and the compressed model's KL to full KV and
next-token agreement. Policies: the trained router (the config's weights, default the shipped
ones), the untrained score, and no zoom at all (summaries only: the floor). Teacher passes are
read from the training run's cache when present. Writes benchmarks/results/router_heldout.json
and the README block `router-heldout`.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from benchmarks.readme import table_head, write_block
from sekv_vllm.policies import RouterPolicy, SpanScorePolicy, ZoomPolicy
from sekv_vllm.router import load_router, resolve_weights
from sekv_vllm.training.config import TrainConfig
from sekv_vllm.training.evaluate import evaluate_policy
from sekv_vllm.training.frozen_lm import FrozenLM
from sekv_vllm.training.train import model_path_of, teacher_records

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "benchmarks" / "results" / "router_heldout.json"


class SummariesOnly(ZoomPolicy):
    name = "summaries_only"

    def select(self, layer, q, summary_k, span_len, zoom_budget, scale):
        return torch.zeros(q.shape[0], span_len.numel(), dtype=torch.bool)


def table(result: dict) -> str:
    head = ["policy", "span recall", "span mass zoomed", "spans zoomed / head", "KL to full KV", "next-token agreement"]
    lines = [
        f"Command: `{result['command']}` ({result['records']} held-out texts, {result['queries']} decode queries, "
        f"budgets {result['budget_ratios']} of the prompt; router `{result['weights']}`). "
        f"Source: `benchmarks/results/router_heldout.json`.",
        "",
        *table_head(head),
    ]
    for name, r in result["policies"].items():
        lines.append(f"| {name} | {r['span_recall']:.3f} | {r['span_mass_zoomed']:.3f} | {r['mean_zoomed_spans']:.2f} "
                     f"| {r['kl_to_full_kv']:.3f} | {r['next_token_agreement']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--weights", default=None, help="router file (default: the shipped one for the model)")
    args = parser.parse_args()
    config = TrainConfig.load(args.config)
    model_path = model_path_of(config)
    lm = FrozenLM(model_path)
    weights = resolve_weights(args.weights, Path(model_path).name)
    router = load_router(weights, lm.shape)
    start = time.time()
    records = teacher_records(lm, config, model_path, heldout=True)
    r_max = config.sekv.r_max
    policies = {
        "router (trained)": evaluate_policy(lm, RouterPolicy(router), router, records, r_max),
        "router scores, exact keys (no gates)": evaluate_policy(lm, RouterPolicy(router), None, records, r_max),
        "span_score (untrained)": evaluate_policy(lm, SpanScorePolicy(), None, records, r_max),
        "summaries only (no zoom)": evaluate_policy(lm, SummariesOnly(), None, records, r_max),
    }
    result = {
        "command": f"python -m benchmarks.router.heldout --config {args.config}"
                   + (f" --weights {args.weights}" if args.weights else ""),
        "weights": str(weights.relative_to(ROOT)) if weights.is_relative_to(ROOT) else str(weights),
        "records": len(records),
        "queries": int(sum(r.query_pos.numel() for r in records)),
        "budget_ratios": list(config.budget_ratios),
        "policies": policies,
        "seconds": round(time.time() - start, 1),
    }
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    write_block("router-heldout", table(result))


if __name__ == "__main__":
    main()
