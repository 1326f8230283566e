"""The server-load table in the README, from benchmarks/results/server_load_cpu.json.

    python -m benchmarks.serve.report [RESULTS_JSON]    # default: benchmarks/results/server_load_cpu.json
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from benchmarks.readme import table_head, write_block

RESULTS = Path(__file__).resolve().parents[1] / "results"


def _ms(d: dict, key: str) -> str:
    return f"{d[key]:.2f}" if key in d else "-"


def table(result: dict) -> str:
    load = result["load"]
    lines = [f"Command: `{result['command'].strip()}` (commit {result['commit']}, {result['date']}; "
             f"{load['requests']} requests, {load['concurrency']} in flight, KV pool {load['pool_gib']} GiB, "
             f"max_model_len {load['max_model_len']}, sekv {json.dumps(load['sekv_config'])}). "
             f"Source: `benchmarks/results/{result['source']}`.", ""]
    lines += table_head(["", "served", "hung up (freed)", "bad refused", "valid failed", "engine died",
                         "healthy after", "same reference text", "pages not returned", "host-pool bytes not returned",
                         "TTFT p50 / p90 s", "TPOT p50 / p90 s", "end to end p50 / p90 s", "wall s"])
    for name, r in result["backends"].items():
        o = r["outcomes"]
        host = "-" if r["host_pool_bytes_not_returned"] is None else r["host_pool_bytes_not_returned"]
        pages = "unknown (server gone)" if r["pages_not_returned"] is None else r["pages_not_returned"]
        lines.append(
            f"| {'stock vLLM' if name == 'stock' else name} | {o.get('served', 0)} | {o.get('dropped', 0)} | "
            f"{r['bad_refused']} of {r['bad_total']} | {r['valid_failed']} | {r['engine_died']} | {r['healthy_after']} | "
            f"{r['same_reference_output']} | {pages} | {host} | "
            f"{_ms(r['ttft_s'], 'p50')} / {_ms(r['ttft_s'], 'p90')} | {_ms(r['tpot_s'], 'p50')} / {_ms(r['tpot_s'], 'p90')} | "
            f"{_ms(r['e2e_s'], 'p50')} / {_ms(r['e2e_s'], 'p90')} | {r['wall_s']:.0f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else RESULTS / "server_load_cpu.json"
    print(write_block("server-load", table({**json.loads(path.read_text()), "source": path.name})))
