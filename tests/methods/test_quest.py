"""Quest-like page selection against references: bounds, page ranks, decode over the pages read, the host pool,
the output paged out as it grows."""
import math

import pytest
import torch

from sekv_vllm.config import SeKVConfig, SeKVConfigError
from sekv_vllm.core import exact_attention
from sekv_vllm.methods import Quest
from sekv_vllm.methods.quest import gather_pages, page_bounds, page_scores, top_pages
from sekv_vllm.runtime import SeKVRuntime, Status

H, HKV, D, T = 6, 2, 16, 300
LAYERS = ["l0", "l1"]
PAGE = 16


def runtime(**settings):
    return SeKVRuntime(SeKVConfig(**{"method": "quest", "min_prompt_tokens": 10, **settings}), LAYERS)


def prefill(rt, req_id, seed=0, n=T):
    g = torch.Generator().manual_seed(seed)
    kv = {name: (torch.randn(n, HKV, D, generator=g), torch.randn(n, HKV, D, generator=g)) for name in LAYERS}
    for name, (k, v) in kv.items():
        rt.capture(req_id, name, 0, k, v)
    return kv


def test_bounds_hold_every_key_and_bound_every_logit_of_their_page():
    g = torch.Generator().manual_seed(0)
    k, q = torch.randn(8 * PAGE, HKV, D, generator=g), torch.randn(H, D, generator=g)
    lo, hi = page_bounds(k, PAGE)
    pages = k.view(8, PAGE, HKV, D)
    assert bool((pages >= lo[:, None]).all() and (pages <= hi[:, None]).all())
    group = H // HKV
    for h in range(H):
        logits = torch.einsum("d,pnd->pn", q[h], pages[:, :, h // group])
        bound = torch.maximum(q[h] * lo[:, h // group], q[h] * hi[:, h // group]).sum(-1)
        assert bool((logits.amax(dim=1) <= bound + 1e-5).all())


def test_page_ranks_follow_the_largest_normalised_bound_of_each_kv_heads_query_heads():
    g = torch.Generator().manual_seed(1)
    k, q = torch.randn(10 * PAGE, HKV, D, generator=g), torch.randn(H, D, generator=g)
    lo, hi = page_bounds(k, PAGE)
    scores = page_scores(q, lo, hi, 0.25)
    group = H // HKV
    for kv in range(HKV):
        per_head = []
        for h in range(kv * group, (kv + 1) * group):
            bound = torch.stack([sum(max(q[h, d] * lo[p, kv, d], q[h, d] * hi[p, kv, d]) for d in range(D))
                                 for p in range(10)]) * 0.25
            per_head.append(bound - torch.logsumexp(bound, 0))
        assert torch.allclose(scores[kv], torch.stack(per_head).amax(0), atol=1e-5)
    chosen = top_pages(scores, 3)
    assert chosen.shape == (HKV, 3) and bool((chosen.diff(dim=1) > 0).all())
    assert all(set(chosen[kv].tolist()) == set(scores[kv].topk(3).indices.tolist()) for kv in range(HKV))


def test_gathered_rows_are_each_kv_heads_own_pages_in_order():
    pages = torch.randn(5, PAGE, HKV, D)
    chosen = torch.tensor([[0, 3], [1, 4]])
    rows = gather_pages(pages, chosen)
    assert rows.shape == (2 * PAGE, HKV, D)
    assert torch.equal(rows[:, 0], torch.cat([pages[0, :, 0], pages[3, :, 0]]))
    assert torch.equal(rows[:, 1], torch.cat([pages[1, :, 1], pages[4, :, 1]]))


def test_decode_reads_the_best_pages_of_each_kv_head_and_the_window_and_the_pool_holds_the_pages():
    rt = runtime(budget_ratio=0.25)
    rt.admit("r", T, None)
    kv = prefill(rt, "r")
    mem = rt.compress("r")
    assert mem.status is Status.COMPRESSED
    paged, window = 288, 12  # 18 pages; the partial page stays in the window
    pages_per_step = (math.ceil(0.25 * T) - paged // PAGE - window) // PAGE
    fig = rt.figures("r")
    assert fig["host_pages"] == paged // PAGE and fig["pages_per_step"] == pages_per_step == 2
    assert fig["fast_tier_bytes"] == (paged // PAGE + window + pages_per_step * PAGE) * 2 * HKV * D * 4 * len(LAYERS)
    assert fig["fast_tier_fraction"] <= 0.25 and fig["host_pool_bytes"] == paged * 2 * HKV * D * 4 * len(LAYERS)
    q = torch.randn(1, H, D, generator=torch.Generator().manual_seed(2))
    k1, v1 = torch.randn(1, HKV, D), torch.randn(1, HKV, D)
    out = rt.attend_batch(["r"], "l1", q, 0.25, k1, v1)
    k, v = kv["l1"]
    lo, hi = page_bounds(k[:paged], PAGE)
    chosen = top_pages(page_scores(q[0], lo, hi, 0.25), pages_per_step)
    k_read = gather_pages(k[:paged].view(-1, PAGE, HKV, D), chosen)
    v_read = gather_pages(v[:paged].view(-1, PAGE, HKV, D), chosen)
    ref = exact_attention(q[0], torch.cat([k_read, k[paged:], k1]), torch.cat([v_read, v[paged:], v1]), 0.25)
    assert torch.allclose(out[0], ref, atol=1e-5)
    assert rt.release("r", outcome="finished")["mean_zoomed_spans"] == pages_per_step
    assert rt.pool.used_bytes == 0 and not rt.requests


def test_the_page_holding_a_needle_is_read_where_a_recent_window_alone_would_miss_it():
    """A key far back that matches the query: its page's bound is the highest, so it is read."""
    rt = runtime(budget_ratio=0.25)
    rt.admit("r", T, None)
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(T, HKV, D, generator=g) * 0.1, torch.randn(T, HKV, D, generator=g)
    q = torch.randn(1, H, D, generator=g)
    k[40] = q[0].view(HKV, H // HKV, D).mean(1) * 10  # position 40, page 2, aligned with every head of the group
    for name in LAYERS:
        rt.capture("r", name, 0, k, v)
    rt.compress("r")
    scale = 1 / math.sqrt(D)
    exact = exact_attention(q[0], k, v, scale)
    err = (rt.attend_batch(["r"], "l0", q, scale)[0] - exact).abs().max()
    err_recent = (exact_attention(q[0], k[-75:], v[-75:], scale) - exact).abs().max()  # as many rows, the last
    assert err_recent > 20 * err
    lo, hi = page_bounds(k[:288], PAGE)
    assert bool((top_pages(page_scores(q[0], lo, hi, scale), 2) == 2).any(dim=1).all())  # every KV head reads page 2


def generate(rt, k_all, v_all, steps, g):
    """`steps` output rows of request r (random, every layer), its window paged out when due: layer l0's rows
    k_all, v_all [T + steps, Hkv, D] and what each paging out returned."""
    parts = []
    for step in range(steps):
        rows = {name: (torch.randn(1, HKV, D, generator=g), torch.randn(1, HKV, D, generator=g)) for name in LAYERS}
        for name in LAYERS:
            rt.capture("r", name, T + step, *rows[name])
        k_all, v_all = torch.cat([k_all, rows["l0"][0]]), torch.cat([v_all, rows["l0"][1]])
        if rt.window_due("r"):
            parts.append(rt.spanify_window("r"))
    return k_all, v_all, parts


def test_the_output_grows_into_host_pages_and_decode_reads_them_like_the_prompts():
    rt = runtime(budget_ratio=0.5, window_growth=32)
    rt.admit("r", T, None)
    kv = prefill(rt, "r")
    rt.compress("r")
    g = torch.Generator().manual_seed(4)
    k_all, v_all, parts = generate(rt, *kv["l0"], 40, g)
    assert [(p.start, p.stop) for p in parts] == [(288, 320)]  # due at position 288 + 32: two pages out
    st = rt.get("r").method_state
    # budget 150 rows + 16 for the 32 rows paged out: 20 bounds, 12 window rows, 8 pages of 16
    assert st.paged == 320 and st.budget_rows == 166 and st.pages_per_step == 8
    assert rt.get("r").rows["l0"].length == 340 - 320
    assert parts[0].fast_tier_bytes == (2 + (8 - 7) * PAGE) * 2 * HKV * D * 4 * len(LAYERS)
    q = torch.randn(1, H, D, generator=g)
    out = rt.attend_batch(["r"], "l0", q, 0.25)
    lo, hi = page_bounds(k_all[:320], PAGE)
    chosen = top_pages(page_scores(q[0], lo, hi, 0.25), 8)
    k_read = gather_pages(k_all[:320].view(-1, PAGE, HKV, D), chosen)
    v_read = gather_pages(v_all[:320].view(-1, PAGE, HKV, D), chosen)
    ref = exact_attention(q[0], torch.cat([k_read, k_all[320:]]), torch.cat([v_read, v_all[320:]]), 0.25)
    assert torch.allclose(out[0], ref, atol=1e-5)


def test_a_budget_covering_the_prompt_keeps_every_row_in_the_window_and_needs_no_host_pool():
    rt = runtime(budget_ratio=1.0, window_growth=32, host_pool_bytes=0)
    rt.admit("r", T, None)
    prefill(rt, "r")
    assert rt.compress("r").status is Status.COMPRESSED
    fig = rt.figures("r")
    assert fig["host_pages"] == 0 and fig["host_pool_bytes"] == 0 and fig["fast_tier_fraction"] == 1.0
    for step in range(40):
        for name in LAYERS:
            rt.capture("r", name, T + step, torch.randn(1, HKV, D), torch.randn(1, HKV, D))
    assert not rt.window_due("r")  # nothing to page out either


def test_a_full_host_pool_at_output_growth_is_tried_again_a_growth_later():
    rt = runtime(budget_ratio=0.5, window_growth=32)
    rt.admit("r", T, None)
    prefill(rt, "r")
    rt.compress("r")
    rt.pool.capacity_bytes = rt.pool.used_bytes  # full from now on
    tries = 0
    for step in range(80):
        for name in LAYERS:
            rt.capture("r", name, T + step, torch.randn(1, HKV, D), torch.randn(1, HKV, D))
        if rt.window_due("r"):
            tries += 1
            assert rt.spanify_window("r") is None
    assert tries == 2  # at positions 320 and 352 (the window keeps its rows between)
    assert rt.get("r").rows["l0"].length == 380 - 288


def test_a_budget_too_small_for_bounds_window_and_one_page_keeps_full_kv_and_says_why():
    rt = runtime(token_budget=40)
    mem = rt.admit("r", T, None)  # known at admission: prefill captures nothing for it
    assert mem.status is Status.FULL_KV and not rt.is_active("r")
    assert mem.reason == "budget (40 rows) cannot hold quest's page bounds (18 rows), window (12) and one page (16)"
    assert rt.admit("s", 10, None).reason == "prompt (10) shorter than quest's recent_rows (0) + one page (16)"


def test_a_full_host_pool_keeps_full_kv():
    rt = runtime(budget_ratio=0.25, host_pool_bytes=1000)
    rt.admit("r", T, None)
    prefill(rt, "r")
    assert rt.compress("r").reason == "host pool full" and rt.pool.used_bytes == 0


def test_settings_are_validated_naming_the_field():
    with pytest.raises(SeKVConfigError, match=r"sekv\.page_size: Input should be greater than or equal to 2"):
        SeKVConfig.from_additional_config({"sekv": {"method": "quest", "page_size": 1}})
    with pytest.raises(SeKVConfigError, match=r"sekv\.sink_tokens: not a setting of method 'quest'"):
        SeKVConfig.from_additional_config({"sekv": {"method": "quest", "sink_tokens": 2}})
    config = SeKVConfig.from_additional_config({"sekv": {"method": "quest", "page_size": 32}})
    assert config.method_of("quest") == Quest(page_size=32)
