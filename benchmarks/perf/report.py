"""Markdown tables from the perf results, into the README (`perf-results`, `capacity-results`,
`long-output-results`).

    python -m benchmarks.perf.report      # README.md <- benchmarks/results/perf_cpu.json, capacity_cpu.json,
                                          #              long_output_cpu.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.readme import table_head, write_block

ROOT = Path(__file__).resolve().parents[2]
MIB = 2**20


def _decode(res: dict, batch: int | None) -> str:
    run = next((r for r in res["runs"] if (r["is_pool_max"] if batch is None else r["batch"] == batch)), None)
    if run is None:
        return "over pool"
    return f"{run['decode_tok_per_s']:.1f}" + (f" (b{run['batch']})" if batch is None else "")


def table(result: dict, source: str) -> str:
    head = ["tokens", "backend", "full-KV batch limit of the pool", "prefill b1 (s)", "decode tok/s b1", "decode tok/s b8",
            "decode tok/s at that limit", "fast tier / request", "vLLM pages held / request", "host pool / request",
            "peak RSS"]
    lines = [
        f"Command: `{result['command'].strip()}` ({result['model']}, {result['cores']} cores, KV pool "
        f"`VLLM_CPU_KVCACHE_SPACE={result['kv_cache_space_gib']}` for both, sekv budget_ratio "
        f"{result['budget_ratio']}, {result['decode_tokens']} decode tokens per request). Source: `{source}`.",
        "",
        *table_head(head),
    ]
    for row in result["rows"]:
        for backend in ("vllm", "sekv"):
            res = row[backend]
            b1 = next(r for r in res["runs"] if r["batch"] == 1)
            lines.append(
                f"| ~{row['length']} | {'stock vLLM' if backend == 'vllm' else 'sekv'} | {res['max_batch']} | "
                f"{b1['prefill_s']:.2f} | {_decode(res, 1)} | {_decode(res, 8)} | {_decode(res, None)} | "
                f"{res['fast_tier_bytes'] / MIB:.1f} MiB | {res['vllm_pages_held_bytes'] / MIB:.1f} MiB | "
                f"{res['host_pool_bytes'] / MIB:.1f} MiB | "
                f"{res['peak_rss_bytes'] / MIB / 1024:.2f} GiB |")
        r = row["ratio_sekv_to_stock"]
        at_max = next((v for k, v in r.items() if k.startswith("decode_tok_per_s_b") and
                       k == f"decode_tok_per_s_b{row['sekv']['max_batch']}"), None)
        lines.append(
            f"| | **sekv / stock** | | {r['prefill_b1']:.2f}x | {r['decode_tok_per_s_b1']:.2f}x | "
            f"{r.get('decode_tok_per_s_b8', float('nan')):.2f}x | {'-' if at_max is None else f'{at_max:.2f}x'} | "
            f"{r['fast_tier_bytes']:.3f}x | {r['vllm_pages_held']:.3f}x | | {r['peak_rss']:.2f}x |")
    return "\n".join(lines).replace("nanx", "-")


def capacity_table(result: dict, source: str) -> str:
    s, v = result["sekv"], result["vllm"]

    def rate(x):
        return "-" if x is None else f"{x:.1f}"

    lines = [
        f"Command: `{result['command'].strip()}` ({result['model']}, {result['cores']} cores, "
        f"{v['requests']} requests of ~{result['length']} tokens submitted at once, {result['decode_tokens']} decode "
        f"tokens each, one pool of `VLLM_CPU_KVCACHE_SPACE={result['kv_cache_space_gib']}` GiB = {v['pool_blocks']} "
        f"pages for both, sekv budget_ratio {result['budget_ratio']}). Source: `{source}`.",
        "",
        "| | most requests decoding at once | decode tok/s at that concurrency | output tok/s, whole run | wall time |",
        "| --- | --- | --- | --- | --- |",
        f"| stock vLLM | {v['max_concurrent']} | {rate(v['decode_tok_per_s_at_max'])} | {v['output_tok_per_s']:.1f} | {v['wall_s']:.0f} s |",
        f"| sekv | {s['max_concurrent']} | {rate(s['decode_tok_per_s_at_max'])} | {s['output_tok_per_s']:.1f} | {s['wall_s']:.0f} s |",
        f"| **sekv / stock** | **{result['concurrency_ratio']:.2f}x** (`concurrency_ratio`) | "
        f"{result.get('decode_throughput_ratio_at_capacity', float('nan')):.2f}x | {result['output_throughput_ratio']:.2f}x | |",
    ]
    return "\n".join(lines).replace("nanx", "-")


def long_output_table(result: dict, source: str) -> str:
    stock = result["vllm"]
    block = stock["block_size"]
    lines = [
        f"Command: `{result['command'].strip()}` ({result['model']}, {result['cores']} cores, {result['requests']} "
        f"requests of ~{result['length']} prompt tokens decoding together, {result['decode_tokens']} output tokens each "
        f"(greedy, ignore_eos), sekv budget_ratio {result['budget_ratio']}; pages of {block} tokens). Source: `{source}`.",
        "",
        "| | vLLM pages held per request at the end | decode tok/s | full-resolution rows per request at the end "
        "| output spans per request | host pool per request at the end | same token as stock vLLM |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    names = {"vllm": "stock vLLM", "sekv_window_kept": "sekv, output kept at full resolution (`window_growth: 0`)",
             "sekv_window_spanified": f"sekv, window spanified (`window_growth: {result['window_growth']}`)"}
    for name, label in names.items():
        run = result[name]
        figs = run.get("figures_at_end") or []

        def mean(key):
            return sum(f[key] for f in figs) / len(figs) if figs else None

        rows, spans, pool = mean("full_resolution_rows"), mean("output_spans"), mean("host_pool_bytes_now")
        lines.append(
            f"| {label} | {run['pages_per_request_at_end']:.0f} ({run['pages_ratio_to_stock']:.2f}x) | "
            f"{run['decode_tok_per_s']:.1f} ({run['decode_ratio_to_stock']:.2f}x) | "
            f"{'-' if rows is None else f'{rows:.0f}'} | {'-' if spans is None else f'{spans:.0f}'} | "
            f"{'-' if pool is None else f'{pool / MIB:.1f} MiB'} | {run['agreement_with_stock']['token_match_rate']:.1%} |")
    agree = result["sekv_window_spanified"]["agreement_with_window_kept"]
    lines += ["", f"The spanifying engine's outputs against the output-kept engine's (same budget): "
                  f"{agree['token_match_rate']:.1%} of positions with the same token, first difference at "
                  f"{agree['mean_first_difference']:.0f} tokens on average."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results" / "perf_cpu.json")
    parser.add_argument("--capacity", type=Path, default=ROOT / "benchmarks" / "results" / "capacity_cpu.json")
    parser.add_argument("--long-output", type=Path, default=ROOT / "benchmarks" / "results" / "long_output_cpu.json")
    args = parser.parse_args()
    print(write_block("perf-results", table(json.loads(args.results.read_text()), str(args.results.relative_to(ROOT)))))
    if args.capacity.exists():
        print(write_block("capacity-results", capacity_table(json.loads(args.capacity.read_text()),
                                                             str(args.capacity.relative_to(ROOT)))))
    if args.long_output.exists():
        print(write_block("long-output-results", long_output_table(json.loads(args.long_output.read_text()),
                                                                   str(args.long_output.relative_to(ROOT)))))


if __name__ == "__main__":
    main()
