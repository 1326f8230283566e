"""The router network, its policy and its weight files (no model needed)."""
import math

import pytest
import torch

from sekv_vllm.config import SeKVConfig
from sekv_vllm.core import SpanKeys, gate_bases, fit_span_bases, rebuild_spans, segment_prompt, singular_values
from sekv_vllm.policies import RouterPolicy, make_policy
from sekv_vllm.router import ModelShape, RouterWeightsError, ZoomRouter, load_router, resolve_weights, save_router
from sekv_vllm.runtime import SeKVRuntime

SHAPE = ModelShape(num_layers=3, num_heads=6, num_kv_heads=2, head_dim=16)


def test_shapes_and_parameter_count():
    r = ZoomRouter(SHAPE, d_r=8, r_max=4, gate_hidden=10)
    L, H, D = 3, 6, 16
    expected = L * (H * 8 * D + 2 * H) + L * ((4 + D) * 10 + 10 + 10 * 10 + 10 + 10 * 4 + 4)
    assert r.parameter_count() == expected
    # at start the learned term is small: the router ranks spans as the untrained score does
    from sekv_vllm.policies import SpanScorePolicy
    qq, kk, ll = torch.randn(H, D), torch.randn(30, 2, D), torch.randint(4, 9, (30,))
    keys = SpanKeys.of_summaries(kk, ll)
    want = SpanScorePolicy().select(0, qq, keys, 40, 1 / math.sqrt(D))
    got = RouterPolicy(ZoomRouter(SHAPE, w_init=0.0)).select(0, qq, keys, 40, 1 / math.sqrt(D))
    assert torch.equal(got, want)
    q, sk, lens = torch.randn(5, H, D), torch.randn(7, 2, D), torch.randint(4, 9, (7,))
    assert r.score_logits(1, q, SpanKeys.of_summaries(sk, lens)).shape == (5, H, 7)
    g = r.gates(2, torch.rand(7, 2, 3).sort(-1, descending=True).values, sk)
    assert g.shape == (7, 2, 3) and ((g > 0) & (g < 1)).all()
    assert r.threshold_logit(0).shape == (H,)


def test_directions_beyond_the_routers_rank_are_kept_whole():
    # spans longer than the router was trained on (max_span and r_max above its r_max): its gates for the
    # first r_max directions, the rest kept (gate 1)
    r = ZoomRouter(SHAPE, r_max=4)
    sk = torch.randn(7, 2, 16)
    sing = torch.rand(7, 2, 6).sort(-1, descending=True).values
    g = r.gates(1, sing, sk)
    assert g.shape == (7, 2, 6)
    assert torch.allclose(g[..., :4], r.gates(1, sing[..., :4], sk))
    assert (g[..., 4:] == 1).all() and (g[..., :4] < 1).all()


def test_default_model_router_share_is_reported_small():
    # SmolLM2-135M: 30 layers, 9 heads, 3 KV heads, head_dim 64 -> under 1% of 134.5M parameters
    r = ZoomRouter(ModelShape(30, 9, 3, 64))
    assert r.parameter_count() == 926_940
    assert r.parameter_count() / 134_515_008 < 0.01


def test_score_is_the_untrained_score_plus_the_learned_term():
    r = ZoomRouter(SHAPE, d_r=8)
    with torch.no_grad():
        r.bias[1] = torch.arange(6.0)
    q, sk, lens = torch.randn(6, 16), torch.randn(4, 2, 16), torch.tensor([4, 8, 16, 32])
    got = r.score_logits(1, q, SpanKeys.of_summaries(sk, lens))
    for h in range(6):
        W = r.W[1, h]
        for s in range(4):
            kp = torch.nn.functional.normalize(W @ sk[s, h // 3], dim=0)
            base = q[h] @ sk[s, h // 3] / math.sqrt(16)
            want = base + (W @ q[h]) @ kp / math.sqrt(8) + float(torch.tensor(math.log(lens[s])).half()) + h
            assert torch.isclose(got[h, s], want, atol=1e-4)


def test_gates_fold_into_the_rebuilt_keys():
    g = torch.Generator().manual_seed(0)
    k = torch.randn(200, 2, 16, generator=g)
    layout = segment_prompt(torch.rand(200, generator=g), window=8, alpha=1.0, l_min=4, max_span=16)
    bases = fit_span_bases(k, layout.span_start, layout.span_len, r_max=16)
    sing = singular_values(bases)
    # singular values of each span match torch's SVD
    a, n = int(layout.span_start[0]), int(layout.span_len[0])
    ref = torch.linalg.svdvals(k[a:a + n, 0])
    assert torch.allclose(sing[0, 0, :ref.numel()], ref, atol=1e-4)
    ones = gate_bases(bases, torch.ones_like(sing))
    ids = torch.arange(layout.num_spans)
    assert torch.allclose(rebuild_spans(ones, ids)[0], rebuild_spans(bases, ids)[0])
    half = gate_bases(bases, torch.full_like(sing, 0.5))
    assert torch.allclose(rebuild_spans(half, ids)[0], 0.5 * rebuild_spans(bases, ids)[0], atol=1e-5)


def test_router_policy_respects_budget_and_threshold():
    r = ZoomRouter(SHAPE)
    policy = RouterPolicy(r)
    q, sk, lens = torch.randn(6, 16), torch.randn(10, 2, 16), torch.full((10,), 8)
    keys = SpanKeys.of_summaries(sk, lens)
    zoom = policy.select(0, q, keys, zoom_budget=7 * 3, scale=0.25)
    assert zoom.view(2, 3, 10)[:, 0].sum(dim=1).le(3).all()  # 3 spans of cost 7 per KV head
    with torch.no_grad():
        r.tau_logit[0] = 100.0  # nothing passes the threshold
    assert not policy.select(0, q, keys, zoom_budget=1000, scale=0.25).any()


def test_weights_round_trip(tmp_path):
    r = ZoomRouter(SHAPE, seed=3)
    with torch.no_grad():
        r.bias.normal_()
    path = save_router(r, tmp_path / "r.safetensors", model_name="tiny", provenance={"command": "test"})
    back = load_router(path, SHAPE)
    for name, p in r.state_dict().items():
        assert torch.equal(back.state_dict()[name], p.half().float()), name
    q, sk, lens = torch.randn(6, 16), torch.randn(10, 2, 16), torch.randint(4, 9, (10,))
    keys = SpanKeys.of_summaries(sk, lens)
    assert torch.equal(RouterPolicy(back).select(0, q, keys, 20, 0.25),
                       RouterPolicy(r.half().float()).select(0, q, keys, 20, 0.25))


def test_mismatched_weights_are_refused(tmp_path):
    path = save_router(ZoomRouter(SHAPE), tmp_path / "r.safetensors", model_name="tiny", provenance={})
    other = ModelShape(30, 9, 3, 64)
    with pytest.raises(RouterWeightsError, match=r"router_weights: .*3 layers, 6 heads.*30 layers, 9 heads"):
        load_router(path, other)
    with pytest.raises(RouterWeightsError, match="router_weights: no shipped router for model 'Llama-3-8B'"):
        resolve_weights(None, "Llama-3-8B")
    with pytest.raises(RouterWeightsError, match="router_weights: no file"):
        load_router(tmp_path / "missing.safetensors", SHAPE)
    (tmp_path / "junk.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    with pytest.raises(RouterWeightsError, match="not a sekv router file"):
        load_router(tmp_path / "junk.safetensors", SHAPE)
    # the runtime refuses them when it starts, not at the first request
    cfg = SeKVConfig(zoom_policy="router", router_weights=str(path))
    with pytest.raises(RouterWeightsError):
        SeKVRuntime(cfg, [f"l{i}" for i in range(30)], other)
    SeKVRuntime(cfg, ["l0", "l1", "l2"], SHAPE)  # the right shape loads


def _compressed(tmp_path, budget_ratio: float, key_gate_strength: float = 1.0):
    r = ZoomRouter(SHAPE, r_max=8)
    with torch.no_grad():
        r.b3.fill_(-20.0)  # gates ~ 0: every gated key rebuilds as ~ 0
    path = save_router(r, tmp_path / "r.safetensors", model_name="tiny", provenance={})
    cfg = SeKVConfig(zoom_policy="router", router_weights=str(path), min_prompt_tokens=10, window=8, max_span=8,
                     r_max=8, budget_ratio=budget_ratio, key_gate_strength=key_gate_strength)
    names = ["l0", "l1", "l2"]
    rt = SeKVRuntime(cfg, names, SHAPE)
    T = 120
    rt.admit("a", T, None)
    g = torch.Generator().manual_seed(1)
    rows = {}
    for name in names:
        rows[name] = (torch.randn(T, 2, 16, generator=g), torch.randn(T, 2, 16, generator=g))
        rt.capture("a", name, 0, *rows[name])
    rt.record_surprisal("a", torch.arange(1, T), torch.rand(T - 1, generator=g))
    return rt, rt.compress("a"), rows


def test_runtime_uses_router_gates_and_scores(tmp_path):
    """Under a budget that forces a choice the router's gates shape the stored keys."""
    rt, mem, _ = _compressed(tmp_path, 0.3)
    assert not mem.zoom_all
    layer = rt.pool.load("a", "l1")
    assert layer.bases_k.coef.abs().max() < 1e-6 and layer.bases_v.coef.abs().max() > 0.1
    assert make_policy("span_score").key_gates(0, torch.ones(layer.keys.num_spans, 2, 8), layer.summary_k) is None
    out = rt.attend("a", "l1", torch.randn(6, 16), 0.25)
    assert out.shape == (6, 16) and torch.isfinite(out).all()


@pytest.mark.parametrize("strength", [0.0, 0.5])
def test_the_key_gate_strength_moves_the_gates_toward_keeping_the_key_rows(tmp_path, strength):
    """Gates ~ 0 everywhere: a strength s rebuilds every span key row as (1 - s) times itself (0: no gates)."""
    rt, mem, rows = _compressed(tmp_path, 0.3, key_gate_strength=strength)
    assert not mem.zoom_all
    layer = rt.pool.load("a", "l1")
    stored, k = layer.bases_k.coef, rows["l1"][0]  # [n, Hkv, D] span rows, [T, Hkv, D]
    assert layer.bases_k.basis is None and stored.shape[0] > 0
    # every stored key row is (1 - s) times one of the prompt's (the full gates would have made them ~ 0)
    err = (stored[:, None] - (1 - strength) * k[None]).abs().amax(dim=(-2, -1)).min(dim=1).values.max()
    assert err < 1e-4


def test_a_budget_covering_every_span_attends_exactly_whatever_the_router(tmp_path):
    from sekv_vllm.core import exact_attention

    rt, mem, rows = _compressed(tmp_path, 1.0)
    assert mem.zoom_all
    q = torch.randn(6, 16)
    k, v = rows["l1"]
    assert torch.allclose(rt.attend("a", "l1", q, 0.25), exact_attention(q, k, v, 0.25), atol=1e-4)


def test_span_wise_scores_match_the_all_pairs_scores():
    # serving scores each span for its own request's query; training scores all pairs
    r = ZoomRouter(SHAPE, seed=1, w_init=0.3)
    g = torch.Generator().manual_seed(2)
    keys = SpanKeys(torch.randn(9, 2, 16, generator=g), torch.randint(4, 9, (9,), generator=g),
                    torch.randn(9, 3, 2, 16, generator=g).half(), torch.rand(9, 2, 3, generator=g).half())
    seg = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2])
    q = torch.randn(3, 6, 16, generator=g)
    rows = r.score_rows(2, q, seg, keys)
    pairs = r.score_logits(2, q, keys)  # [3, H, S]
    assert torch.allclose(rows, pairs[seg, :, torch.arange(9)], atol=1e-5)
    # the policy scores through the fast tier's float16 copy of the key scales: one per span and query head
    policy = RouterPolicy(r)
    score, eligible = policy.span_scores(2, q, seg, keys, 0.25)
    assert policy.key_features(2, keys).dtype == torch.float16 and policy.key_features(2, keys).shape == (9, 6)
    assert policy.span_feature_nbytes(2) == policy.key_features(2, keys)[0].nbytes
    assert torch.equal(score, r.score_rows(2, q, seg, keys, policy.key_features(2, keys).float()))
    assert torch.allclose(score, rows, atol=2e-3) and torch.equal(eligible, score > r.threshold_logit(2)[None, :])
