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
from sekv_vllm.router.weights import read_metadata
from sekv_vllm.training.config import TrainConfig
from sekv_vllm.training.evaluate import evaluate_policy
from sekv_vllm.training.frozen_lm import FrozenLM
from sekv_vllm.training.train import model_path_of, teacher_records

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "benchmarks" / "results" / "router_heldout.json"


class SummariesOnly(ZoomPolicy):
    name = "summaries_only"

    def span_scores(self, layer, q, seg, keys, scale):
        no = torch.zeros(keys.num_spans, q.shape[1])
        return no, no.bool()  # nothing eligible: nothing zoomed


def table(result: dict) -> str:
    ratios = result["budget_ratios"]
    head = ["policy", "span recall", "span mass zoomed", "spans zoomed / head",
            *(f"KL @ {r}" for r in ratios), *(f"agreement @ {r}" for r in ratios)]
    lines = [
        f"Command: `{result['command']}` ({result['records']} held-out texts, {result['queries']} decode queries; "
        f"each text has one of the budgets {ratios} of the prompt; router `{result['weights']}`). "
        "KL to full KV and next-token agreement of the compressed model, per budget. "
        "Source: `benchmarks/results/router_heldout.json`.",
        "",
        *table_head(head),
    ]
    for name, r in result["policies"].items():
        per = r["by_budget"]
        lines.append(f"| {name} | {r['span_recall']:.3f} | {r['span_mass_zoomed']:.3f} | {r['mean_zoomed_spans']:.2f} | "
                     + " | ".join(f"{per[str(b)]['kl_to_full_kv']:.3f}" for b in ratios) + " | "
                     + " | ".join(f"{per[str(b)]['next_token_agreement']:.3f}" for b in ratios) + " |")
    # the trained router and the untrained score, each as served
    names = [n for n in result["policies"] if n.startswith(("router (trained),", "span_score (untrained)"))]
    sources = list(result["policies"][names[0]]["by_source"])
    lines += ["", f"Per source of the held-out texts (span recall / KL to full KV / next-token agreement; scoring "
              f"codes at {result['score_bits']} bits):", "",
              *table_head(["source", "texts", *names])]
    for src in sources:
        cells = [result["policies"][n]["by_source"][src] for n in names]
        lines.append(f"| {src} | {cells[0]['records']} | "
                     + " | ".join(f"{c['span_recall']:.3f} / {c['kl_to_full_kv']:.3f} / {c['next_token_agreement']:.3f}"
                                  for c in cells) + " |")
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
    trained_centroids = json.loads(read_metadata(weights)["provenance"])["config"]["sekv"].get("score_centroids", 0)
    start = time.time()
    records = teacher_records(lm, config, model_path, heldout=True)
    r_max, C, bits = config.sekv.r_max, config.sekv.score_centroids, config.sekv.score_bits
    # (policy, router whose gates rebuild keys, centroids per span, bits per scoring-code element)
    runs = {
        f"router (trained), {C} centroids": (RouterPolicy(router), router, C, bits),
        **({f"router (trained with {trained_centroids}), {trained_centroids} centroids":
            (RouterPolicy(router), router, trained_centroids, bits)} if trained_centroids != C else {}),
        "router scores, exact keys (no gates)": (RouterPolicy(router), None, C, bits),
        f"span_score (untrained), {C} centroids": (SpanScorePolicy(), None, C, bits),
        "span_score, summary key only (0 centroids)": (SpanScorePolicy(), None, 0, 16),
        f"span_score, every token ({config.sekv.max_span} float16 centroids: exact span mass)":
            (SpanScorePolicy(), None, config.sekv.max_span, 16),
        "summaries only (no zoom)": (SummariesOnly(), None, 0, 16),
    }
    ratios = sorted({r.text.budget_ratio for r in records}, reverse=True)
    policies = {}
    for name, (policy, gates, centroids, score_bits) in runs.items():
        res = evaluate_policy(lm, policy, gates, records, r_max, centroids, score_bits, config.sekv.score_range_spans)
        policies[name] = res
        print(name, json.dumps({k: v for k, v in res.items() if k not in ("by_budget", "by_source")}), flush=True)
    result = {
        "command": f"python -m benchmarks.router.heldout --config {args.config}"
                   + (f" --weights {args.weights}" if args.weights else ""),
        "weights": str(weights.relative_to(ROOT)) if weights.is_relative_to(ROOT) else str(weights),
        "records": len(records),
        "queries": int(sum(r.query_pos.numel() for r in records)),
        "budget_ratios": ratios,
        "score_bits": config.sekv.score_bits,
        "policies": policies,
        "seconds": round(time.time() - start, 1),
    }
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    write_block("router-heldout", table(result))


if __name__ == "__main__":
    main()
