"""The suite through vLLM's OpenAI server: one server per backend, `concurrency` requests in flight.

The server is the one users run (`sekv-vllm serve`; stock vLLM with plugins off). Prompts are
sent to /v1/completions as the same chat-templated text the offline runner uses, so both paths
see identical tokens. sekv's per-request figures come from its stats file (`stats_path`), which
gets a line when the engine frees a finished request, before its reply is sent. Records are
appended per chunk of samples, so an interrupted run resumes from the last finished chunk.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from benchmarks.engine import ENGINE_ENV, STOCK_PLUGINS
from benchmarks.suite.grid import Grid
from benchmarks.suite.records import make_record
from sekv_vllm.tasks.ruler import chat_prompt, make_sample, token_counter

START_TIMEOUT_S = 300
REQUEST_TIMEOUT_S = 900


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict, timeout: float = REQUEST_TIMEOUT_S) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


class Server:
    """`sekv-vllm serve` in a subprocess on a free loopback port; stops on exit."""

    def __init__(self, model: str, sekv: dict | None, max_model_len: int, log_path: Path,
                 env: dict[str, str] | None = None):
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "sekv_vllm.entrypoints.cli", "serve", model, "--host", "127.0.0.1",
               "--port", str(self.port), "--max-model-len", str(max_model_len), "--enforce-eager",
               "--no-enable-prefix-caching"]
        env = {**os.environ, **ENGINE_ENV, **(env or {})}
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server runs its engine core as usual
        if sekv is None:
            env["VLLM_PLUGINS"] = STOCK_PLUGINS
        else:
            cmd += ["--kv-cache-backend", "sekv", "--sekv-config", json.dumps(sekv)]
        self.log_path = log_path
        self._log = open(log_path, "w")
        # a session of its own: stopping it stops the engine core and any worker with it
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def __enter__(self) -> "Server":
        deadline = time.time() + START_TIMEOUT_S
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_path.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=5) as resp:
                    if resp.status == 200:
                        return self
            except OSError:
                time.sleep(2)
        self.__exit__()
        raise RuntimeError(f"server did not become healthy in {START_TIMEOUT_S} s; log: {self.log_path}")

    def __exit__(self, *exc) -> None:
        with contextlib.suppress(ProcessLookupError):  # a server that died has no group left
            os.killpg(self.proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever of the group is left
        self._log.close()


def _figures(stats: Path, reply_ids: list[str], wait_s: float = 10.0) -> dict[str, dict]:
    """sekv's figures by reply id (the engine's id extends it). The engine core writes a line as it
    frees a request, which can trail the reply by a moment: wait a little for missing ones."""
    deadline = time.time() + wait_s
    while True:
        lines = stats.read_text().splitlines() if stats.exists() else []
        found = {}
        for line in lines:
            try:
                fig = json.loads(line)
            except json.JSONDecodeError:  # a line being written right now
                continue
            rid = next((r for r in reply_ids if fig["req_id"].startswith(r)), None)
            if rid is not None:
                found[rid] = fig
        if len(found) == len(reply_ids) or time.time() > deadline:
            return found
        time.sleep(0.2)


def run_server(grid: Grid, backend: str, jobs: list[dict], model: str, records: Path) -> None:
    from tqdm import tqdm
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    count = token_counter(tok)
    work = tempfile.mkdtemp(prefix="sekv-suite-server-")
    stats = Path(work) / "stats.jsonl"
    settings = grid.sekv_settings(backend)
    sekv = None if settings is None else {**settings, "stats_path": str(stats)}

    def ask(job: dict) -> tuple[dict, object, dict, float]:
        sample = make_sample(job["task"], job["length"], job["depth"], job["seed"], count)
        body = {"model": model, "prompt": chat_prompt(sample, tok), "max_tokens": job["max_tokens"], "temperature": 0}
        if sekv is not None:
            body["vllm_xargs"] = {"sekv_budget_ratio": job["budget"]}
        t0 = time.perf_counter()
        status, reply = post(f"{server.base}/v1/completions", body)
        if status != 200:
            raise RuntimeError(f"HTTP {status} for {job}: {reply}")
        return job, sample, reply, time.perf_counter() - t0

    chunk = max(4 * grid.concurrency, 16)  # records are written per chunk: resume granularity
    max_model_len = max(grid.lengths) + max(j["max_tokens"] for j in jobs) + 256
    with Server(model, sekv, max_model_len, Path(work) / "server.log") as server, \
            ThreadPoolExecutor(grid.concurrency) as pool, \
            tqdm(total=len(jobs), desc=f"{backend} (server x{grid.concurrency})", unit="sample", file=sys.stderr) as bar:
        for start in range(0, len(jobs), chunk):
            done = []
            for fut in as_completed([pool.submit(ask, j) for j in jobs[start : start + chunk]]):
                done.append(fut.result())
                bar.update(1)
            figures = _figures(stats, [reply["id"] for _, _, reply, _ in done]) if sekv is not None else {}
            with records.open("a") as out:
                for job, sample, reply, seconds in done:
                    fig = figures.get(reply["id"])
                    out.write(json.dumps(make_record(job, sample.answers, reply["choices"][0]["text"],
                                                     reply["usage"]["prompt_tokens"], seconds, grid.concurrency,
                                                     fig, via="server")) + "\n")
