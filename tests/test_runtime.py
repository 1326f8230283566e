"""The engine-agnostic runtime: admission, capture, compression, pool exhaustion, release."""
import math

import pytest
import torch

from sekv_vllm.config import SeKVConfig
from sekv_vllm.core import exact_attention
from sekv_vllm.pool import HostPool
from sekv_vllm.router import ModelShape
from sekv_vllm.runtime import SeKVRuntime, Status, summary_dtype
from tests.ops.test_span_decode import kernel_or_skip

H, HKV, D = 9, 3, 64
LAYERS = ["l0", "l1"]


def prefill(rt: SeKVRuntime, req_id: str, T: int, seed: int = 0, chunk: int = 300):
    g = torch.Generator().manual_seed(seed)
    kv = {name: (torch.randn(T, HKV, D, generator=g), torch.randn(T, HKV, D, generator=g)) for name in LAYERS}
    rt.record_surprisal(req_id, torch.arange(1, T), torch.rand(T - 1, generator=g) * 5)
    for start in range(0, T, chunk):  # chunked prefill
        for name in LAYERS:
            k, v = kv[name]
            rt.capture(req_id, name, start, k[start : start + chunk], v[start : start + chunk])
    return kv


def test_admission_rules():
    rt = SeKVRuntime(SeKVConfig(zoom_policy="span_score", min_prompt_tokens=100), LAYERS)
    assert rt.admit("short", 50, None).status is Status.FULL_KV
    assert rt.admit("off", 500, {"sekv_compress": False}).status is Status.FULL_KV
    assert rt.admit("bad", 500, {"sekv_budget_ratio": 9}).reason.startswith("bad per-request settings")
    assert rt.admit("ok", 500, None).status is Status.PREFILLING
    assert [r for r in rt.requests if rt.is_active(r)] == ["ok"]


def test_compress_then_attend_matches_exact_attention_at_full_budget_and_rank():
    rt = SeKVRuntime(SeKVConfig(zoom_policy="span_score", min_prompt_tokens=10, budget_ratio=1.0, r_max=64, max_span=64, window=16), LAYERS)
    rt.admit("r", 1000, None)
    kv = prefill(rt, "r", 1000)
    assert rt.compress("r").status is Status.COMPRESSED
    g = torch.Generator().manual_seed(1)
    k_new, v_new, q = torch.randn(1, HKV, D, generator=g), torch.randn(1, HKV, D, generator=g), torch.randn(H, D, generator=g)
    rt.capture("r", "l1", 1000, k_new, v_new)  # the decode token joins the window
    out = rt.attend("r", "l1", q, 1 / math.sqrt(D))
    k, v = kv["l1"]
    ref = exact_attention(q, torch.cat([k, k_new]), torch.cat([v, v_new]), 1 / math.sqrt(D))
    assert float((out - ref).norm() / ref.norm()) < 1e-5
    fig = rt.figures("r")
    assert fig["decode_steps"] == 0 and fig["spans"] > 0 and fig["host_pool_bytes"] == rt.pool.used_bytes


@pytest.mark.parametrize("setting, stored", [("float16", torch.float16), ("kv", torch.float32)])
def test_summaries_are_stored_in_float16_beside_a_wider_kv_cache_or_in_its_dtype(setting, stored):
    rt = SeKVRuntime(SeKVConfig(zoom_policy="span_score", min_prompt_tokens=10, summary_dtype=setting), LAYERS)
    rt.admit("r", 1000, None)
    prefill(rt, "r", 1000)
    assert rt.compress("r").status is Status.COMPRESSED
    memory = rt.pool.load("r", "l0")
    assert memory.summary_k.dtype == memory.summary_v.dtype == stored
    # a KV cache of 16-bit floats keeps its own dtype either way
    assert summary_dtype(rt.config, torch.bfloat16) == torch.bfloat16
    assert summary_dtype(rt.config, torch.float16) == torch.float16


def test_full_pool_degrades_to_full_kv_without_error():
    rt = SeKVRuntime(SeKVConfig(zoom_policy="span_score", min_prompt_tokens=10, host_pool_bytes=10_000), LAYERS)
    rt.admit("r", 1000, None)
    prefill(rt, "r", 1000)
    mem = rt.compress("r")
    assert mem.status is Status.FULL_KV and mem.reason == "host pool full"
    assert rt.pool.used_bytes == 0 and not mem.rows and not mem.captured  # nothing half-stored


def test_release_frees_both_tiers_after_many_requests():
    rt = SeKVRuntime(SeKVConfig(zoom_policy="span_score", min_prompt_tokens=10), LAYERS)
    for i in range(20):
        rt.admit(f"r{i}", 600, None)
        prefill(rt, f"r{i}", 600, seed=i)
        rt.compress(f"r{i}")
        assert rt.release(f"r{i}", outcome="finished")["outcome"] == "finished"
    assert rt.pool.used_bytes == 0 and not rt.requests and rt.pool.owners() == []


def test_host_pool_accounting():
    pool = HostPool(100)
    assert pool.store("a", "x", object(), 60)
    assert not pool.store("b", "x", object(), 50)  # refuses instead of exceeding
    assert pool.store("a", "x", object(), 40)  # replacing frees the old entry first
    assert pool.used_bytes == 40 and pool.release("a") == 40 and pool.used_bytes == 0


def test_stats_path_gets_one_json_line_per_compressed_request(tmp_path):
    import json

    path = tmp_path / "stats.jsonl"
    rt = SeKVRuntime(SeKVConfig(zoom_policy="span_score", min_prompt_tokens=10, stats_path=str(path)), LAYERS)
    for i in range(2):
        rt.admit(f"r{i}", 600, None)
        prefill(rt, f"r{i}", 600, seed=i)
        rt.compress(f"r{i}")
        rt.release(f"r{i}", outcome="finished")
    rt.admit("short", 5, None)
    rt.release("short", outcome="finished")  # full KV: no line
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [x["req_id"] for x in lines] == ["r0", "r1"]
    assert all(x["outcome"] == "finished" and 0 < x["fast_tier_fraction"] < 1 for x in lines)


@pytest.mark.parametrize("kernel", ["torch", "cpp"])
def test_a_request_decodes_the_same_whatever_decodes_beside_it(kernel):
    # bitwise: preemption and continuous batching must not change greedy outputs
    if kernel == "cpp":
        kernel_or_skip()
    names = ["l0", "l1"]
    for policy in ("span_score", "router"):
        rt = SeKVRuntime(SeKVConfig(zoom_policy=policy, min_prompt_tokens=10, budget_ratio=0.25, decode_kernel=kernel),
                         names, ModelShape(30, 9, 3, 64), "SmolLM2-135M-Instruct")
        assert (rt.sekv.kernel is not None) == (kernel == "cpp")
        g = torch.Generator().manual_seed(5)
        for r, T in (("a", 500), ("b", 700), ("c", 300)):
            rt.admit(r, T, None)
            rt.record_surprisal(r, torch.arange(1, T), torch.rand(T - 1, generator=g) * 5)
            for n in names:
                rt.capture(r, n, 0, torch.randn(T, 3, 64, generator=g), torch.randn(T, 3, 64, generator=g))
            rt.compress(r)
        q = torch.randn(3, 9, 64, generator=g)
        alone = rt.attend_batch(["a"], "l1", q[:1], 0.125)[0]
        assert torch.equal(alone, rt.attend_batch(["c", "a", "b"], "l1", q[[2, 0, 1]], 0.125)[1])
        assert torch.equal(alone, rt.attend_batch(["a", "b"], "l1", q[:2], 0.125)[0])


def decode_steps(rt: SeKVRuntime, req_id: str, kv: dict, start: int, steps: int, seed: int, check=None):
    """Decode `steps` tokens (appended by attend_batch), recording output surprisal and spanifying the
    window when due, as the runner bridge does; check(out, k_all, v_all, q, name) after each call."""
    g = torch.Generator().manual_seed(seed)
    ks = {n: [kv[n][0]] for n in LAYERS}
    vs = {n: [kv[n][1]] for n in LAYERS}
    spanified = []
    for step in range(steps):
        rt.record_surprisal(req_id, torch.tensor([start + step]), torch.rand(1, generator=g) * 5)
        for n in LAYERS:
            k_new, v_new = torch.randn(1, HKV, D, generator=g), torch.randn(1, HKV, D, generator=g)
            q = torch.randn(1, H, D, generator=g)
            ks[n].append(k_new)
            vs[n].append(v_new)
            out = rt.attend_batch([req_id], n, q, 1 / math.sqrt(D), k_new, v_new)[0]
            if check is not None:
                check(out, torch.cat(ks[n]), torch.cat(vs[n]), q[0], n)
        if rt.window_due(req_id):
            spanified.append(rt.spanify_window(req_id))
    return spanified


@pytest.mark.parametrize("kernel", ["torch", "cpp"])
def test_spanified_output_still_equals_exact_attention_at_full_budget_and_rank(kernel):
    if kernel == "cpp":
        kernel_or_skip()
    rt = SeKVRuntime(SeKVConfig(zoom_policy="span_score", min_prompt_tokens=10, budget_ratio=1.0, r_max=64, max_span=64,
                                window=16, window_growth=40, decode_kernel=kernel), LAYERS)
    rt.admit("r", 600, None)
    kv = prefill(rt, "r", 600)
    rt.compress("r")
    pool_after_prompt = rt.pool.used_bytes
    errors = []

    def check(out, k, v, q, name):
        errors.append(rel_err(out, exact_attention(q, k, v, 1 / math.sqrt(D))))

    parts = decode_steps(rt, "r", kv, 600, 130, seed=1, check=check)
    assert [(p.start, p.stop) for p in parts] == [(584, 624), (624, 664), (664, 704)]  # all but the last 16 rows
    assert max(errors) < 1e-5
    fig = rt.figures("r")
    assert fig["output_spans"] == sum(p.spans for p in parts) > 0
    mem = rt.get("r")
    # full-resolution rows: the prompt's anchors and short runs, the output's, and the window
    assert fig["full_resolution_rows"] == fig["anchor_and_short_tokens"] + fig["output_anchor_and_short_tokens"] + 730 - 704
    assert mem.window_pos == 704 and rt.pool.used_bytes > pool_after_prompt == fig["host_pool_bytes"]
    assert fig["output_mean_surprisal"] > 0


def rel_err(a, b):
    return float((a - b).norm() / b.norm())


def test_kernel_reads_spanified_output_as_the_torch_ops_do():
    kernel_or_skip()
    outs = {}
    for kernel in ("torch", "cpp"):
        rt = SeKVRuntime(SeKVConfig(min_prompt_tokens=10, budget_ratio=0.25, window_growth=64, decode_kernel=kernel),
                         LAYERS, ModelShape(2, H, HKV, D), "")
        rt.admit("r", 800, None)
        kv = prefill(rt, "r", 800)
        rt.compress("r")
        outs[kernel] = []
        parts = decode_steps(rt, "r", kv, 800, 150, seed=2, check=lambda out, *_: outs[kernel].append(out))
        assert len(parts) == 2 and all(p.spans > 0 for p in parts)
    assert max(rel_err(a, b) for a, b in zip(outs["cpp"], outs["torch"])) < 1e-4


def test_full_host_pool_keeps_the_window_at_full_resolution_and_tries_again_later(caplog):
    rt = SeKVRuntime(SeKVConfig(zoom_policy="span_score", min_prompt_tokens=10, window_growth=32), LAYERS)
    rt.admit("r", 600, None)
    kv = prefill(rt, "r", 600)
    rt.compress("r")
    rt.pool.capacity_bytes = rt.pool.used_bytes  # full: the output's spans cannot be stored
    with caplog.at_level("WARNING", logger="sekv_vllm"):
        parts = decode_steps(rt, "r", kv, 600, 70, seed=3)
    assert parts == [None, None]  # due at 32 and (after 32 more tokens) at 64 output tokens
    assert "host pool full" in caplog.text and "at full resolution" in caplog.text
    fig = rt.figures("r")
    assert fig["output_spans"] == 0 and fig["full_resolution_rows"] == fig["anchor_and_short_tokens"] + 16 + 70
    rt.pool.capacity_bytes = 1 << 40
    assert rt.window_due("r") is False
    decode_steps(rt, "r", kv, 670, 30, seed=4)  # due again at 96: room now
    assert rt.figures("r")["output_spans"] > 0


@pytest.mark.parametrize("policy", ["span_score", "router"])
def test_the_budget_bounds_every_fast_tier_byte(policy):
    # a budget is a share of full-KV bytes, everything counted: rows, summaries, scoring codes, router features
    rt = SeKVRuntime(SeKVConfig(zoom_policy=policy, min_prompt_tokens=10, window_growth=48), LAYERS,
                     ModelShape(30, H, HKV, D), "SmolLM2-135M-Instruct")
    centroids = {}
    for i, ratio in enumerate((0.5, 0.25, 0.125, 0.0625)):
        r = f"r{i}"
        rt.admit(r, 2000, {"sekv_budget_ratio": ratio})
        kv = prefill(rt, r, 2000, seed=i)
        assert rt.compress(r).status is Status.COMPRESSED
        fig = rt.figures(r)
        assert fig["fast_tier_fraction"] <= fig["budget_rows"] / 2000
        assert fig["fast_tier_fraction"] > 0.9 * ratio  # the budget is spent, not left idle
        centroids[ratio] = fig["score_centroids"]
        mem = rt.get(r)
        features = 0 if policy == "span_score" else sum(f.nbytes for f in mem.key_features.values())
        held = sum(m.fast_tier_nbytes for m in (rt.pool.load(r, n) for n in LAYERS))
        row = 2 * HKV * D * 4
        assert fig["fast_tier_bytes"] == held + features + (fig["base_rows"] - fig["spans"] + fig["zoom_budget_rows"]) * row * 2
        # the output's spans are held to the request's ratio too
        decode_steps(rt, r, kv, 2000, 60, seed=i)
        fig = rt.figures(r)
        grown = fig["output_span_tokens"] + fig["output_anchor_and_short_tokens"]
        assert fig["output_spans"] > 0 and fig["output_fast_tier_bytes"] <= ratio * grown * row * 2 + row * 2
    # a tight budget takes rows from the zoom (down to min_zoom_spans spans) before it keeps fewer scoring
    # centroids per span, rather than overrun
    assert centroids[0.5] == centroids[0.125] == 32 and centroids[0.0625] < 32
