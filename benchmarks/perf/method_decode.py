"""Decode attention time of every in-engine method, side by side: what a method costs per decode step.

    python -m benchmarks.perf.method_decode                       # 4 requests of 2K tokens, budget 0.25
    python -m benchmarks.perf.method_decode --requests 8 --length 4000 --budget 0.125

No engine and no model (as benchmarks.perf.decode_step): the runtime gets synthetic prompt rows of the
default model's shape (30 layers, 9 heads, 3 KV heads, head_dim 64, float32), each method compresses
them as in serving, then `--steps` decode steps each append one row per request and layer and attend
every layer. Against them, in the same run: exact attention over the full prompts (a full-KV decode
step's attention). Results: benchmarks/results/method_decode_cpu.json and method_decode.png.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from benchmarks.perf.decode_step import RESULTS, build_runtime, full_kv_steps, sekv_steps
from sekv_vllm.config import SeKVConfig

# (label, SeKVConfig fields beside the budget)
METHODS = (
    ("sekv", {}),
    ("snapkv", {"method": "snapkv"}),
    ("snapkv@kv8", {"method": "snapkv", "kv_bits": 8}),
    ("snapkv@kv4", {"method": "snapkv", "kv_bits": 4}),
    ("h2o", {"method": "h2o"}),
    ("tova", {"method": "tova"}),
    ("streaming_llm", {"method": "streaming_llm"}),
    ("quest", {"method": "quest"}),
    ("quest@kv8", {"method": "quest", "kv_bits": 8}),
    ("quest@kv4", {"method": "quest", "kv_bits": 4}),
)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["methods"]
    fig, ax = plt.subplots(figsize=(9, 3.6))
    ax.bar([r["method"] for r in rows], [1000 * r["s_per_step"] for r in rows], color="tab:blue")
    ax.axhline(1000 * result["full_kv_attention_s_per_step"], color="black", linestyle="--", label="full KV attention")
    ax.set_ylabel("ms per decode step (all layers)")
    ax.set_title(f"{result['requests']} requests x {result['prompt_tokens']} tokens, budget {result['budget']}")
    ax.tick_params(axis="x", rotation=30)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--length", type=int, default=2000)
    ap.add_argument("--budget", type=float, default=0.25)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(RESULTS / "method_decode_cpu.json"))
    args = ap.parse_args(argv)
    gen = torch.Generator().manual_seed(args.seed)
    rows = []
    for label, fields in METHODS:
        config = SeKVConfig(budget_ratio=args.budget, min_prompt_tokens=0, **fields)
        rt, ids = build_runtime(config, args.requests, args.length, args.seed)
        sekv_steps(rt, ids, 1, gen)  # warm-up
        seconds = sekv_steps(rt, ids, args.steps, gen)
        fig = rt.figures(ids[0])
        rows.append({"method": label, "s_per_step": round(seconds, 4),
                     "fast_tier_fraction": round(fig["fast_tier_fraction"], 4)})
        print(f"{label:14s} {1000 * seconds:8.1f} ms/step  fast tier {100 * fig['fast_tier_fraction']:.1f}%")
    full_s = full_kv_steps(args.requests, args.length, args.steps, gen)
    for r in rows:
        r["over_full_kv_attention"] = round(r["s_per_step"] / full_s, 3)
    result = {
        "command": " ".join(["python -m benchmarks.perf.method_decode", *(argv if argv is not None else sys.argv[1:])]),
        "requests": args.requests, "prompt_tokens": args.length, "budget": args.budget, "steps": args.steps,
        "threads": torch.get_num_threads(), "full_kv_attention_s_per_step": round(full_s, 4), "methods": rows,
    }
    print(f"full KV attention {1000 * full_s:8.1f} ms/step")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out.with_name("method_decode.png"))


if __name__ == "__main__":
    main()
