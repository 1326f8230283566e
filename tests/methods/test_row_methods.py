"""Row-keeping methods against references: kept positions, decode over kept rows, runtime life cycle (with every
registered method where the behaviour is common to all)."""
import math

import pytest
import torch

from sekv_vllm.config import SeKVConfig, SeKVConfigError
from sekv_vllm.core import exact_attention
from sekv_vllm.methods import METHODS, TOVA, PromptRows, SnapKV, StreamingLLM, gather_kept
from sekv_vllm.runtime import SeKVRuntime, Status

H, HKV, D, T = 6, 2, 16, 300
LAYERS = ["l0", "l1"]


def prompt(seed=0, T=T, W=64):
    g = torch.Generator().manual_seed(seed)
    return PromptRows(torch.randn(T, HKV, D, generator=g), torch.randn(T, HKV, D, generator=g),
                      torch.randn(W, H, D, generator=g))


def snapkv_scores_by_loops(rows: PromptRows, kernel: int) -> torch.Tensor:
    """SnapKV's votes written head by head, query by query (the paper's steps, no batching)."""
    T, Hkv, D = rows.k.shape
    W, H = rows.queries.shape[:2]
    group = H // Hkv
    per_head = []
    for h in range(H):
        votes = torch.zeros(T - W)
        for w in range(W):
            pos = T - W + w
            logits = rows.k[: pos + 1, h // group] @ rows.queries[w, h] / math.sqrt(D)
            votes += torch.softmax(logits, 0)[: T - W] / W
        padded = torch.cat([torch.zeros(kernel // 2), votes, torch.zeros(kernel // 2)])
        per_head.append(torch.stack([padded[i : i + kernel].sum() / kernel for i in range(T - W)]))
    return torch.stack(per_head).view(Hkv, group, T - W).mean(1)


def test_snapkv_scores_and_kept_rows_match_a_reference_written_head_by_head():
    rows, method = prompt(), SnapKV(observation_window=64, pooling_kernel=5)
    ref = snapkv_scores_by_loops(rows, 5)
    assert torch.allclose(method.scores(rows), ref, atol=1e-6)
    kept = method.keep(rows, 100)
    assert kept.shape == (HKV, 100) and bool((kept.diff(dim=1) > 0).all())
    for h in range(HKV):
        want = set(ref[h].topk(36).indices.tolist()) | set(range(T - 64, T))
        assert set(kept[h].tolist()) == want
    assert torch.equal(method.keep(rows, 10), torch.arange(T - 10, T).expand(HKV, 10))  # inside the window


def test_streaming_llm_keeps_sinks_and_the_most_recent_rows():
    kept = StreamingLLM(sink_tokens=4).keep(prompt(W=0), 50)
    assert torch.equal(kept, torch.cat([torch.arange(4), torch.arange(T - 46, T)]).expand(HKV, 50))
    assert torch.equal(StreamingLLM(sink_tokens=4).keep(prompt(W=0), T), torch.arange(T).expand(HKV, T))


def test_tova_keeps_the_last_row_and_what_the_last_query_attends_to_averaged_over_every_head():
    rows = prompt(seed=3, W=1)
    group = H // HKV
    attn = torch.stack([torch.softmax(rows.k[:, h // group] @ rows.queries[0, h] / math.sqrt(D), 0) for h in range(H)])
    ref = attn[:, : T - 1].mean(0)  # one score per row for every KV head
    method = TOVA()
    assert method.query_window == 1 and torch.allclose(method.scores(rows), ref, atol=1e-6)
    kept = method.keep(rows, 40)
    want = sorted(ref.topk(39).indices.tolist() + [T - 1])
    assert kept.shape == (HKV, 40) and all(kept[h].tolist() == want for h in range(HKV))
    assert torch.equal(method.keep(rows, 1), torch.tensor([[T - 1]] * HKV))


def test_gather_kept_takes_each_heads_own_positions():
    rows = prompt()
    pos = torch.tensor([[0, 5, 9], [1, 2, 299]])
    k, v = gather_kept(rows.k, rows.v, pos)
    assert torch.equal(k[:, 1], rows.k[[1, 2, 299], 1]) and torch.equal(v[:, 0], rows.v[[0, 5, 9], 0])


def runtime(method, **settings):
    return SeKVRuntime(SeKVConfig(method=method, min_prompt_tokens=10, **settings), LAYERS)


def prefill(rt, req_id, seed=0, chunk=70):
    """Chunked prefill of every layer: k, v and queries of the whole prompt, per layer."""
    g = torch.Generator().manual_seed(seed)
    kvq = {n: (torch.randn(T, HKV, D, generator=g), torch.randn(T, HKV, D, generator=g),
               torch.randn(T, H, D, generator=g)) for n in LAYERS}
    for start in range(0, T, chunk):
        for n, (k, v, q) in kvq.items():
            rt.capture(req_id, n, start, k[start : start + chunk], v[start : start + chunk], q[start : start + chunk])
    return kvq


@pytest.mark.parametrize("method", sorted(METHODS))
def test_at_full_budget_decode_equals_exact_attention(method):
    rt = runtime(method, budget_ratio=1.0)
    assert rt.admit("r", T, None).method == method and not rt.needs_surprisal("r")
    kvq = prefill(rt, "r")
    assert rt.compress("r").status is Status.COMPRESSED
    g = torch.Generator().manual_seed(1)
    q, k1, v1 = torch.randn(1, H, D, generator=g), torch.randn(1, HKV, D, generator=g), torch.randn(1, HKV, D, generator=g)
    out = rt.attend_batch(["r"], "l1", q, 0.25, k1, v1)
    k, v, _ = kvq["l1"]
    ref = exact_attention(q[0], torch.cat([k, k1]), torch.cat([v, v1]), 0.25)
    assert torch.allclose(out[0], ref, atol=1e-5)
    assert rt.figures("r")["fast_tier_fraction"] == 1.0


def test_snapkv_decodes_over_the_rows_it_chose_from_the_captured_queries():
    rt = runtime("snapkv", budget_ratio=0.25, observation_window=32)
    rt.admit("r", T, None)
    kvq = prefill(rt, "r")
    rt.compress("r")
    k, v, q_all = kvq["l0"]
    kept = SnapKV(observation_window=32).keep(PromptRows(k, v, q_all[-32:]), math.ceil(0.25 * T))
    q = torch.randn(1, H, D)
    out = rt.attend_batch(["r"], "l0", q, 0.25)
    assert torch.allclose(out[0], exact_attention(q[0], *gather_kept(k, v, kept), 0.25), atol=1e-5)
    fig = rt.figures("r")
    assert fig["kept_prompt_rows"] == 75 and fig["fast_tier_fraction"] == pytest.approx(75 / T)
    assert rt.release("r", outcome="finished")["method"] == "snapkv" and not rt.requests


def test_a_batch_of_methods_gives_each_request_what_it_gets_alone():
    rt = runtime("sekv", budget_ratio=0.5, zoom_policy="span_score")
    ids = {"a": None, **{f"r-{m}": {"sekv_method": m} for m in sorted(METHODS)}}
    for i, (r, extra) in enumerate(ids.items()):
        rt.admit(r, T, extra)
        if rt.needs_surprisal(r):
            rt.record_surprisal(r, torch.arange(1, T), torch.rand(T - 1, generator=torch.Generator().manual_seed(i)) * 5)
        prefill(rt, r, seed=i)
        assert rt.compress(r).status is Status.COMPRESSED
    q = torch.randn(len(ids), H, D)
    together = rt.attend_batch(list(ids), "l0", q, 0.25)
    for i, r in enumerate(ids):
        assert torch.allclose(together[i], rt.attend_batch([r], "l0", q[i : i + 1], 0.25)[0], atol=1e-6)
    assert [rt.figures(r)["method"] for r in ids] == ["sekv", *sorted(METHODS)]


def test_a_prompt_inside_the_observation_window_keeps_full_kv():
    rt = runtime("snapkv")
    assert rt.admit("r", 60, None).reason == "prompt (60) not longer than snapkv's query window (64)"


def test_settings_of_another_method_are_refused_naming_the_field():
    with pytest.raises(SeKVConfigError, match=r"sekv\.window: not a setting of method 'snapkv'"):
        SeKVConfig.from_additional_config({"sekv": {"method": "snapkv", "window": 16}})
    with pytest.raises(SeKVConfigError, match=r"sekv\.sink_tokens: not a setting of method 'sekv'"):
        SeKVConfig.from_additional_config({"sekv": {"sink_tokens": 2}})
    with pytest.raises(SeKVConfigError, match=r"sekv\.pooling_kernel: .*must be odd"):
        SeKVConfig.from_additional_config({"sekv": {"method": "snapkv", "pooling_kernel": 4}})
    with pytest.raises(SeKVConfigError, match=r"sekv\.method: Input should be 'sekv', 'streaming_llm', 'snapkv', 'tova', 'h2o' or 'quest'"):
        SeKVConfig.from_additional_config({"sekv": {"method": "pyramidkv"}})
    config = SeKVConfig.from_additional_config({"sekv": {"method": "snapkv", "observation_window": 32}})
    assert SeKVConfig.from_additional_config({"sekv": config.normalised()}).method_of("snapkv") == SnapKV(observation_window=32)
    assert config.method_of("streaming_llm") == StreamingLLM()  # another method: its defaults
