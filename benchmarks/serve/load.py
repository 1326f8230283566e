"""Load and client faults against the real server: does it survive, lose nothing, and give everything back?

    python -m benchmarks.serve.load                       # 200 requests, concurrency 32, 1 GiB pool, sekv + stock
    python -m benchmarks.serve.load --requests 40 --backends sekv

Each backend gets `sekv-vllm serve` (stock: the same server with plugins off) on a KV pool that
holds a handful of full-KV prompts (`--pool-gib`). A reference greedy request runs first; then the
load (benchmarks/serve/workload.py: chat and completions, streamed and not, n=2 with and without
seeds, seeded long prompts, stop strings, logprobs, long outputs, per-request budgets, clients
that hang up mid-stream, bad per-request values, over-long prompts, malformed bodies) with
`--concurrency` requests in flight; then the server's health, the reference again (same text?),
the pages vLLM's pool still holds (/metrics) and, for sekv, the host-pool bytes still in use (its log).
Reported per backend: requests by outcome, what failed and why, TTFT/TPOT/end-to-end percentiles
of the requests served. Results: benchmarks/results/server_load_cpu.json and server_load.png.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import tempfile
import time
from pathlib import Path

import aiohttp

from benchmarks.engine import command_line
from benchmarks.serve.plot import plot
from benchmarks.serve.workload import LoadRequest, make_load
from benchmarks.suite.server import Server

RESULTS = Path(__file__).resolve().parents[1] / "results"
REFERENCE = "Explain in three sentences why the sky is blue."
HOST_POOL_LINE = re.compile(r"sekv: no request held; host pool (\d+) of \d+ bytes in use")


async def send(session: aiohttp.ClientSession, base: str, req: LoadRequest) -> dict:
    """One request; returns its record (status, outcome, timings, output tokens, error text)."""
    record = {"index": req.index, "kind": req.kind, "prompt_tokens": req.prompt_tokens, "status": None,
              "ttft_s": None, "e2e_s": None, "output_tokens": 0, "error": None}
    start = time.perf_counter()
    data = req.raw if req.body is None else json.dumps(req.body).encode()
    try:
        async with session.post(base + req.path, data=data, headers={"Content-Type": "application/json"}) as resp:
            record["status"] = resp.status
            if resp.status != 200:
                record["error"] = (await resp.text())[:300]
            elif req.stream:
                chunks = 0
                async for line in resp.content:
                    if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        record["error"] = json.dumps(event["error"])[:300]
                        break
                    if any(_text(c) for c in event.get("choices", ())):
                        chunks += 1
                        record["ttft_s"] = record["ttft_s"] or time.perf_counter() - start
                    if req.drop_after_chunks and chunks >= req.drop_after_chunks:
                        break  # the client hangs up: leaving the block closes the connection
                record["output_tokens"] = chunks
            else:
                body = await resp.json()
                record["output_tokens"] = body.get("usage", {}).get("completion_tokens", 0)
                record["ttft_s"] = time.perf_counter() - start
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as err:
        record["error"] = f"{type(err).__name__}: {err}"[:300]
    record["e2e_s"] = time.perf_counter() - start
    return record


def _text(choice: dict) -> str:
    return (choice.get("delta") or {}).get("content") or choice.get("text") or ""


def outcome(req: LoadRequest, record: dict, backend: str) -> str:
    """served / refused / dropped as expected, or what went wrong."""
    expect, status = req.expect[backend], record["status"]
    if expect == "dropped":
        return "dropped" if status == 200 and not record["error"] else "valid_failed"
    if expect == "refused":
        return "refused" if status is not None and 400 <= status < 500 else "bad_not_refused"
    return "served" if status == 200 and not record["error"] else "valid_failed"


async def run_load(base: str, load: list[LoadRequest], concurrency: int, backend: str) -> list[dict]:
    limit = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=1800)

    done = []

    async def one(session, req):
        async with limit:
            record = await send(session, base, req)
        record["outcome"] = outcome(req, record, backend)
        done.append(record["outcome"])
        if len(done) % 20 == 0 or len(done) == len(load):
            print(f"[load] {backend}: {len(done)}/{len(load)} done, {done.count('valid_failed')} valid failed",
                  flush=True)
        return record

    async with aiohttp.ClientSession(timeout=timeout) as session:
        return await asyncio.gather(*(one(session, r) for r in load))


def reference(base: str, model: str) -> str | None:
    body = {"model": model, "messages": [{"role": "user", "content": REFERENCE}], "max_tokens": 48, "temperature": 0}

    async def go():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            try:
                async with session.post(base + "/v1/chat/completions", json=body) as resp:
                    return (await resp.json())["choices"][0]["message"]["content"] if resp.status == 200 else None
            except (aiohttp.ClientError, asyncio.TimeoutError, KeyError):
                return None

    return asyncio.run(go())


def server_state(base: str, log_path: Path) -> dict:
    """Health, pages vLLM's pool still holds (its usage gauge x its size), sekv's host-pool bytes in use."""
    async def go():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            try:
                async with session.get(base + "/health") as resp:
                    healthy = resp.status == 200
                async with session.get(base + "/metrics") as resp:
                    return healthy, await resp.text()
            except (aiohttp.ClientError, asyncio.TimeoutError):
                return False, ""

    healthy, metrics = asyncio.run(go())
    usage = re.search(r"^vllm:kv_cache_usage_perc\{[^}]*\} ([0-9.e+-]+)", metrics, re.M)
    blocks = re.search(r'num_gpu_blocks="(\d+)"', metrics)
    pages = round(float(usage.group(1)) * int(blocks.group(1))) if usage and blocks else None
    host = HOST_POOL_LINE.findall(log_path.read_text())
    return {"healthy": healthy, "pages_held": pages, "num_pages": int(blocks.group(1)) if blocks else None,
            "host_pool_bytes_in_use": int(host[-1]) if host else None}


def percentiles(values: list[float]) -> dict:
    if not values:
        return {}
    values = sorted(values)
    return {f"p{p}": round(values[min(len(values) - 1, int(p / 100 * len(values)))], 4) for p in (50, 90, 99)}


def report(backend: str, load: list[LoadRequest], records: list[dict], wall_s: float, before: str | None,
           after: str | None, state: dict, died: bool) -> dict:
    outcomes: dict[str, int] = {}
    for r in records:
        outcomes[r["outcome"]] = outcomes.get(r["outcome"], 0) + 1
    served = [r for r in records if r["outcome"] == "served"]
    streamed = [r for r, q in zip(records, load) if r["outcome"] == "served" and q.stream and r["output_tokens"] > 1]
    bad_total = sum(q.expect[backend] == "refused" for q in load)
    return {
        "requests": len(records),
        "outcomes": outcomes,
        "valid_failed": outcomes.get("valid_failed", 0),
        "bad_total": bad_total,
        "bad_refused": outcomes.get("refused", 0),
        "engine_died": died,
        "healthy_after": state["healthy"],
        "pages_not_returned": state["pages_held"],
        "num_pages": state["num_pages"],
        "host_pool_bytes_not_returned": state["host_pool_bytes_in_use"] if backend == "sekv" else None,
        "reference_before": before,
        "reference_after": after,
        "same_reference_output": before is not None and before == after,
        "wall_s": round(wall_s, 1),
        "output_tokens": sum(r["output_tokens"] for r in served),
        "ttft_s": percentiles([r["ttft_s"] for r in streamed]),
        "tpot_s": percentiles([(r["e2e_s"] - r["ttft_s"]) / (r["output_tokens"] - 1) for r in streamed]),
        "e2e_s": percentiles([r["e2e_s"] for r in served]),
        "failures": [{k: r[k] for k in ("index", "kind", "status", "error")} for r in records
                     if r["outcome"] in ("valid_failed", "bad_not_refused")],
        "records": records,
    }


def run_backend(backend: str, model: str, load: list[LoadRequest], args, log_dir: Path) -> dict:
    sekv = json.loads(args.sekv_config) if backend == "sekv" else None
    log_path = log_dir / f"{backend}.log"
    env = {"VLLM_CPU_KVCACHE_SPACE": str(args.pool_gib)}
    with Server(model, sekv, args.max_model_len, log_path, env=env) as server:
        before = reference(server.base, model)
        start = time.perf_counter()
        records = asyncio.run(run_load(server.base, load, args.concurrency, backend))
        wall = time.perf_counter() - start
        time.sleep(2)  # the last aborts (clients that hung up) reach the engine
        died = server.proc.poll() is not None or "EngineDeadError" in log_path.read_text()
        after = reference(server.base, model)
        state = server_state(server.base, log_path)
    result = report(backend, load, records, wall, before, after, state, died)
    print(f"[load] {backend}: {result['outcomes']} valid_failed={result['valid_failed']} "
          f"bad {result['bad_refused']}/{result['bad_total']} pages_not_returned={result['pages_not_returned']} "
          f"healthy={result['healthy_after']} same_reference={result['same_reference_output']} wall {wall:.0f} s",
          flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--pool-gib", type=int, default=1)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--sekv-config", default='{"budget_ratio": 0.125}')
    parser.add_argument("--backends", default="stock,sekv", help="comma-separated: stock (plugins off), sekv")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS / "server_load_cpu.json")
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    from sekv_vllm.entrypoints.default_model import prepare_default_model

    model = str(prepare_default_model())
    load = make_load(AutoTokenizer.from_pretrained(model), model, args.requests, args.max_model_len, args.seed)
    backends = {}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as log_dir:
        for backend in args.backends.split(","):
            backends[backend] = run_backend(backend, model, load, args, Path(log_dir))
            write(args, load, backends, commit, argv)  # each backend's figures as soon as they are in
    return 0


def write(args, load: list[LoadRequest], backends: dict, commit: str, argv: list[str] | None) -> None:
    head = backends.get("sekv") or next(iter(backends.values()))
    result = {
        "command": command_line("benchmarks.serve.load", argv),
        "date": time.strftime("%Y-%m-%d"), "commit": commit,
        "load": {"requests": args.requests, "concurrency": args.concurrency, "pool_gib": args.pool_gib,
                 "max_model_len": args.max_model_len, "sekv_config": json.loads(args.sekv_config),
                 "kinds": sorted({q.kind for q in load})},
        **{k: head[k] for k in ("requests", "valid_failed", "bad_refused", "bad_total", "pages_not_returned",
                                "host_pool_bytes_not_returned", "same_reference_output")},
        "backends": backends,
    }
    args.out.write_text(json.dumps(result, indent=1))
    plot(result, args.out.with_name("server_load.png"))
    print(f"[load] wrote {args.out}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
