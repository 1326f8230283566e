"""Time of sekv's decode attention alone: one `attend_batch` per layer for a batch of compressed requests.

    python -m benchmarks.perf.decode_step                      # 16 requests of 4K tokens, budget 0.125
    python -m benchmarks.perf.decode_step --requests 8 --length 2000 --profile

No engine and no model: the runtime gets synthetic prompt rows of the default model's shape
(30 layers, 9 heads, 3 KV heads, head_dim 64, float32) with clustered keys (a few directions per
span, like real keys), surprisal from a fixed seed, and is compressed as in serving. Then
`--steps` decode steps run, each appending one row per request and layer and attending every
layer, with the configured policy (the shipped router by default). Against it, in the same run:
stock attention over the same requests' full prompts (one softmax per request over all rows),
the work a full-KV decode step does; and sekv's torch path (the C++ kernel's reference). `--profile`
prints torch's operator table for sekv's steps.
Results: benchmarks/results/decode_step_cpu.json.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from sekv_vllm.config import SeKVConfig
from sekv_vllm.core import exact_attention
from sekv_vllm.router import ModelShape
from sekv_vllm.runtime.request_memory import SeKVRuntime

RESULTS = Path(__file__).resolve().parents[1] / "results"
SHAPE = ModelShape(num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64)
MODEL = "SmolLM2-135M-Instruct"


def synthetic_rows(gen: torch.Generator, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v: [length, Hkv, D] float32; keys drift between a few directions every ~20 tokens."""
    Hkv, D = SHAPE.num_kv_heads, SHAPE.head_dim
    directions = torch.randn(8, Hkv, D, generator=gen) * 2
    which = (torch.arange(length) // 20 + torch.randint(0, 8, (1,), generator=gen)) % 8
    k = directions[which] + torch.randn(length, Hkv, D, generator=gen)
    v = torch.randn(length, Hkv, D, generator=gen)
    return k, v


def build_runtime(config: SeKVConfig, requests: int, length: int, seed: int) -> tuple[SeKVRuntime, list[str]]:
    """`requests` synthetic prompts of `length` tokens compressed by the config's method (surprisal and
    queries where it reads them)."""
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(SHAPE.num_layers)]
    rt = SeKVRuntime(config, layers, SHAPE, MODEL)
    gen = torch.Generator().manual_seed(seed)
    ids = []
    for r in range(requests):
        req = f"req-{r}"
        rt.admit(req, length, None)
        runner = rt.methods[rt.get(req).method]
        if runner.needs_surprisal:
            rt.record_surprisal(req, torch.arange(1, length), torch.rand(length - 1, generator=gen) * 8)
        for name in layers:
            k, v = synthetic_rows(gen, length)
            q = torch.randn(length, SHAPE.num_heads, SHAPE.head_dim, generator=gen) \
                if runner.query_window or runner.accumulates_prompt_attention else None
            rt.capture(req, name, 0, k, v, q)
        rt.compress(req)
        ids.append(req)
    return rt, ids


def sekv_steps(rt: SeKVRuntime, ids: list[str], steps: int, gen: torch.Generator) -> float:
    """Seconds per decode step (all layers) of the runtime's batched attention."""
    H, Hkv, D = SHAPE.num_heads, SHAPE.num_kv_heads, SHAPE.head_dim
    scale = D ** -0.5
    times = []
    for _ in range(steps):
        q = torch.randn(len(ids), H, D, generator=gen)
        row_k, row_v = torch.randn(len(ids), Hkv, D, generator=gen), torch.randn(len(ids), Hkv, D, generator=gen)
        t0 = time.perf_counter()
        for name in rt.layer_names:
            rt.attend_batch(ids, name, q, scale, row_k, row_v)  # appends each request's newest row, as in serving
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def full_kv_steps(requests: int, length: int, steps: int, gen: torch.Generator) -> float:
    """Seconds per decode step of exact attention over every request's full prompt (all layers)."""
    H, Hkv, D = SHAPE.num_heads, SHAPE.num_kv_heads, SHAPE.head_dim
    ks = [torch.randn(length, Hkv, D, generator=gen) for _ in range(requests)]
    vs = [torch.randn(length, Hkv, D, generator=gen) for _ in range(requests)]
    times = []
    for _ in range(steps):
        q = torch.randn(requests, H, D, generator=gen)
        t0 = time.perf_counter()
        for _layer in range(SHAPE.num_layers):
            for b in range(requests):
                exact_attention(q[b], ks[b], vs[b], D ** -0.5)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--length", type=int, default=4000)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--sekv-config", default='{"budget_ratio": 0.125}', help="JSON SeKVConfig fields")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--out", default=str(RESULTS / "decode_step_cpu.json"))
    args = ap.parse_args(argv)
    config = SeKVConfig(**json.loads(args.sekv_config))
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    t0 = time.perf_counter()
    rt, ids = build_runtime(config, args.requests, args.length, args.seed)
    build_s = time.perf_counter() - t0
    sekv_steps(rt, ids, 1, gen)  # warm-up
    if args.profile:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            sekv_steps(rt, ids, 2, gen)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    sekv_s = sekv_steps(rt, ids, args.steps, gen)
    kernel, rt.sekv.kernel = rt.sekv.kernel, None
    torch_s = sekv_steps(rt, ids, max(2, args.steps // 4), gen)
    rt.sekv.kernel = kernel
    full_s = full_kv_steps(args.requests, args.length, args.steps, gen)
    fig = rt.figures(ids[0])
    result = {
        "command": " ".join(["python -m benchmarks.perf.decode_step", *(argv if argv is not None else sys.argv[1:])]),
        "requests": args.requests, "prompt_tokens": args.length, "steps": args.steps,
        "sekv_config": config.model_dump(exclude_defaults=True), "policy": type(rt.sekv.policy).__name__,
        "threads": torch.get_num_threads(),
        "spans_per_request": fig["spans"], "zoom_budget_rows": fig["zoom_budget_rows"],
        "fast_tier_fraction": round(fig["fast_tier_fraction"], 4),
        "host_pool_over_full_kv": round(fig["host_pool_bytes"] / fig["full_kv_bytes"], 3),
        "mean_zoomed_spans_per_layer": round(fig["mean_zoomed_spans"], 2),
        "decode_kernel": "cpp" if kernel is not None else "torch",
        "sekv_attention_s_per_step": round(sekv_s, 4),
        "sekv_torch_path_s_per_step": round(torch_s, 4),
        "full_kv_attention_s_per_step": round(full_s, 4),
        "sekv_over_full_kv": round(sekv_s / full_s, 3),
        "compress_s_per_request": round(build_s / args.requests, 2),
    }
    print(json.dumps(result, indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
