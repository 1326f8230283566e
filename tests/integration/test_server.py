"""The OpenAI-compatible server started with `--kv-cache-backend sekv`."""
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from sekv_vllm.tasks.ruler import make_sample

pytestmark = pytest.mark.vllm

SERVER_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "HF_HUB_OFFLINE": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def serve_cmd(model_dir: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "sekv_vllm.entrypoints.cli", "serve", model_dir, "--max-model-len", "4096",
            "--enforce-eager", "--host", "127.0.0.1", *extra]


def start_server(cmd: list[str], tmp_path_factory, env: dict | None = None):
    """Start a server on a free port; yields (base url, log path) once healthy, stops it after."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    log = open(log_path, "w")
    # a session of its own: stopping it stops the engine core and any worker with it
    proc = subprocess.Popen([*cmd, "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, **SERVER_ENV, **(env or {})}, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=5) as resp:
                if resp.status == 200:
                    break
        except OSError:
            time.sleep(2)
    else:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("server did not become healthy in 300 s")
    try:
        yield base, log_path
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # whatever of the group is left


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    yield from start_server(serve_cmd(model_dir, "--kv-cache-backend", "sekv", "--sekv-config", '{"budget_ratio": 0.3}'),
                            tmp_path_factory)


def chat(base: str, model_dir: str, text: str, **extra) -> tuple[int, dict]:
    body = {"model": model_dir, "messages": [{"role": "user", "content": text}], "max_tokens": 24,
            "temperature": 0, **extra}
    return post(base + "/v1/chat/completions", body)


def test_chat_completion_with_a_compressed_prompt(server, model_dir, count_tokens):
    base, log_path = server
    sample = make_sample("needle", 1500, 0.5, 3, count_tokens)
    status, body = chat(base, model_dir, sample.prompt)
    assert status == 200, body
    assert body["choices"][0]["message"]["content"].strip(), body
    deadline = time.time() + 10
    while "sekv: compressed" not in log_path.read_text() and time.time() < deadline:
        time.sleep(0.5)
    log = log_path.read_text()
    assert "sekv: compressed" in log
    # the worker runs in the scheduler's process, so the server's pool gets the pages back too
    assert "pages to vLLM's pool" in log, log[-3000:]


def test_bad_request_setting_is_http_400_and_others_are_unaffected(server, model_dir):
    base, _ = server
    status, body = chat(base, model_dir, "Hello!", vllm_xargs={"sekv_budget_ratio": -1})
    assert status == 400, body
    assert "sekv_budget_ratio" in json.dumps(body)
    status, body = chat(base, model_dir, "Hello!", vllm_xargs={"sekv_compres": 0})
    assert status == 400 and "sekv_compress" in json.dumps(body), body
    status, body = chat(base, model_dir, "What is the capital of France?", vllm_xargs={"sekv_compress": 0})
    assert status == 200 and "Paris" in body["choices"][0]["message"]["content"]


def test_bad_config_is_refused_at_start_up(model_dir):
    proc = subprocess.run(serve_cmd(model_dir, "--port", str(free_port()), "--kv-cache-backend", "sekv",
                                    "--sekv-config", '{"budget_ratio": 2, "window": 0}'),
                          capture_output=True, text=True, timeout=120, env={**os.environ, **SERVER_ENV})
    assert proc.returncode != 0
    assert "sekv.budget_ratio: Input should be less than or equal to 1 (got 2)" in proc.stderr
    assert "sekv.window: Input should be greater than or equal to 1 (got 0)" in proc.stderr


def test_router_weights_of_another_model_are_refused_at_start_up(model_dir, tmp_path):
    from sekv_vllm.router import ModelShape, ZoomRouter, save_router

    wrong = save_router(ZoomRouter(ModelShape(4, 8, 2, 32)), tmp_path / "other.safetensors", model_name="other",
                        provenance={})
    proc = subprocess.run(serve_cmd(model_dir, "--port", str(free_port()), "--kv-cache-backend", "sekv",
                                    "--sekv-config", json.dumps({"zoom_policy": "router", "router_weights": str(wrong)})),
                          capture_output=True, text=True, timeout=180, env={**os.environ, **SERVER_ENV})
    assert proc.returncode != 0
    assert ("sekv.router_weights: " in proc.stderr and "4 layers, 8 heads" in proc.stderr
            and "30 layers, 9 heads, 3 KV heads, head_dim 64" in proc.stderr), proc.stderr[-3000:]


FAULT = """
from sekv_vllm.runtime import SeKVRuntime


def spanify_window(self, req_id):
    raise RuntimeError("injected fault in spanify_window")


SeKVRuntime.spanify_window = spanify_window
"""


def test_a_request_that_fails_inside_sekv_is_http_500_naming_the_cause_and_others_are_served(
        model_dir, count_tokens, tmp_path_factory):
    # Every process of the server (the engine core is spawned) imports this first: spanification always raises.
    fault = tmp_path_factory.mktemp("fault")
    (fault / "sitecustomize.py").write_text(FAULT)
    cmd = serve_cmd(model_dir, "--kv-cache-backend", "sekv", "--sekv-config", '{"window_growth": 8, "min_prompt_tokens": 256}')
    servers = start_server(cmd, tmp_path_factory, env={"PYTHONPATH": str(fault)})
    base, _ = next(servers)
    try:
        long_prompt = make_sample("needle", 1500, 0.5, 5, count_tokens).prompt
        with ThreadPoolExecutor(2) as pool:
            failing = pool.submit(chat, base, model_dir, long_prompt, max_tokens=40, ignore_eos=True)
            served = pool.submit(chat, base, model_dir, "What is the capital of France?")
            (status, body), (ok_status, ok_body) = failing.result(), served.result()
        assert status == 500, body
        assert "sekv: output spanification failed: RuntimeError: injected fault in spanify_window" in json.dumps(body)
        assert ok_status == 200 and "Paris" in ok_body["choices"][0]["message"]["content"]
        status, body = chat(base, model_dir, "What is the capital of France?")
        assert status == 200 and "Paris" in body["choices"][0]["message"]["content"]
    finally:
        servers.close()
