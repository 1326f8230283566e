"""The method against exact attention, in plain torch."""
import math

import pytest
import torch

from sekv_vllm.core import (
    append_spans,
    attend_memory,
    compress_layer,
    exact_attention,
    fit_span_bases,
    gate_bases,
    rebuild_spans,
    segment_prompt,
    singular_values,
    summarize_spans,
)
from sekv_vllm.core.low_rank import as_rows, gated_span_rows, rebuild_spans_of, rows_if_smaller, span_rows
from sekv_vllm.policies import POLICIES, RouterPolicy, budgeted_zoom, make_policy
from sekv_vllm.router import ModelShape, ZoomRouter

H, HKV, D = 9, 3, 64


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-12))


def make_prompt(T: int, seed: int = 0, rank: int | None = None):
    g = torch.Generator().manual_seed(seed)
    if rank is None:
        k = torch.randn(T, HKV, D, generator=g)
        v = torch.randn(T, HKV, D, generator=g)
    else:  # locally low-rank keys/values, like real spans
        k = torch.randn(T, HKV, rank, generator=g) @ torch.randn(rank, D, generator=g) / math.sqrt(rank)
        v = torch.randn(T, HKV, rank, generator=g) @ torch.randn(rank, D, generator=g) / math.sqrt(rank)
    s = torch.rand(T, generator=g) * 4
    s[torch.rand(T, generator=g) < 0.1] += 6  # some surprising tokens
    s[0] = 0
    q = torch.randn(H, D, generator=g)
    return q, k, v, s


def full_rows(layout, k, v):
    pos = torch.cat([layout.fixed_pos, torch.arange(layout.window_start, layout.prompt_len)])
    return k[pos], v[pos]


def mixed(q, k, v, s, *, zoom_all: bool, r_max: int, max_span=64, window=16, budget=None):
    layout = segment_prompt(s, window=window, alpha=1.0, l_min=4, max_span=max_span, budget=budget)
    mem = compress_layer(k, v, layout, s, r_max)
    fk, fv = full_rows(layout, k, v)
    zoom = torch.full((H, layout.num_spans), zoom_all, dtype=torch.bool)
    return attend_memory(q, fk, fv, mem, zoom, 1 / math.sqrt(D)), layout


@pytest.mark.parametrize("T", [1, 5, 17, 63, 300, 1000])
def test_every_span_zoomed_at_full_rank_equals_exact(T):
    q, k, v, s = make_prompt(T, seed=T)
    out, layout = mixed(q, k, v, s, zoom_all=True, r_max=D, window=min(16, max(T - 1, 1)))
    ref = exact_attention(q, k, v, 1 / math.sqrt(D))
    assert rel_err(out, ref) < 1e-5
    # every prompt position is accounted for exactly once
    covered = torch.cat([layout.fixed_pos, torch.arange(layout.window_start, T)]
                        + [torch.arange(a, a + n) for a, n in zip(layout.span_start.tolist(), layout.span_len.tolist())])
    assert sorted(covered.tolist()) == list(range(T))


def test_error_falls_as_rank_rises():
    q, k, v, s = make_prompt(800, seed=1, rank=24)
    ref = exact_attention(q, k, v, 1 / math.sqrt(D))
    errs = [rel_err(mixed(q, k, v, s, zoom_all=True, r_max=r)[0], ref) for r in (1, 4, 8, 16, 24)]
    assert all(a > b for a, b in zip(errs, errs[1:])), errs
    assert errs[-1] < 1e-4  # rank 24 captures rank-24 data


def test_summaries_only_is_an_approximation_zoom_improves_it():
    q, k, v, s = make_prompt(800, seed=2, rank=8)
    ref = exact_attention(q, k, v, 1 / math.sqrt(D))
    e_summary = rel_err(mixed(q, k, v, s, zoom_all=False, r_max=8)[0], ref)
    e_zoom = rel_err(mixed(q, k, v, s, zoom_all=True, r_max=8)[0], ref)
    assert e_zoom < 1e-4 < e_summary


def test_float16_summaries_take_half_their_bytes_and_attend_as_float32_ones_do():
    q, k, v, s = make_prompt(800, seed=2, rank=8)
    layout = segment_prompt(s, window=16, alpha=1.0, l_min=4, max_span=32)
    wide = compress_layer(k, v, layout, s, 8, score_centroids=32, score_bits=2)
    half = compress_layer(k, v, layout, s, 8, score_centroids=32, score_bits=2, summary_dtype=torch.float16)
    assert half.summary_k.dtype == half.summary_v.dtype == torch.float16
    assert torch.equal(half.summary_v, wide.summary_v.half()) and torch.equal(half.summary_k, wide.summary_k.half())
    summary_bytes = 2 * wide.summary_k.numel() * 4
    assert wide.fast_tier_nbytes - half.fast_tier_nbytes == summary_bytes // 2
    fk, fv = full_rows(layout, k, v)
    zoom = torch.zeros(H, layout.num_spans, dtype=torch.bool)
    zoom[:, ::5] = True
    ref = attend_memory(q, fk, fv, wide, zoom, 1 / math.sqrt(D))
    assert rel_err(attend_memory(q, fk, fv, half, zoom, 1 / math.sqrt(D)), ref) < 2e-3


def test_rebuild_is_lossless_at_full_rank_and_rows_keep_span_order():
    _, k, _, s = make_prompt(300, seed=3)
    layout = segment_prompt(s, window=10, alpha=1.0, l_min=4, max_span=64)
    bases = fit_span_bases(k, layout.span_start, layout.span_len, r_max=D)
    ids = torch.tensor([layout.num_spans - 1, 0])
    rows, row_span = rebuild_spans(bases, ids)
    want = torch.cat([k[layout.span_start[i]: layout.span_start[i] + layout.span_len[i]] for i in ids])
    assert torch.allclose(rows, want, atol=1e-4)
    assert row_span.tolist() == sum(([int(i)] * int(layout.span_len[i]) for i in ids), [])


@pytest.mark.parametrize("max_span, r_max", [(32, 32), (32, 8), (80, 16)])  # L < D (X X^T) and L >= D (X^T X)
def test_span_factors_equal_a_truncated_svd(max_span, r_max):
    _, k, _, s = make_prompt(400, seed=4, rank=12)
    k[100:140] = torch.randn(40, HKV, D)  # some spans of full rank
    layout = segment_prompt(s, window=10, alpha=1.0, l_min=4, max_span=max_span)
    bases = fit_span_bases(k, layout.span_start, layout.span_len, r_max=r_max)
    got = singular_values(bases)
    for i in range(layout.num_spans):
        start, n = int(layout.span_start[i]), int(layout.span_len[i])
        x = k[start : start + n].permute(1, 0, 2)  # [Hkv, n, D]
        u, sv, vh = torch.linalg.svd(x, full_matrices=False)
        r = min(r_max, n)
        want_rows = u[..., :r] * sv[:, None, :r] @ vh[:, :r]
        (rows,), _ = rebuild_spans_of(torch.tensor([i]), bases)
        assert torch.allclose(rows.permute(1, 0, 2), want_rows, atol=2e-4 * float(sv.max()))
        assert torch.allclose(got[i, :, :r], sv[:, :r], atol=1e-3 * float(sv.max()))
    if r_max >= max_span:  # factors rebuild exactly: the rows kept as they are equal them
        exact = span_rows(k, layout.span_start, layout.span_len)
        assert not exact.factored and torch.allclose(rows_if_smaller(bases).coef, exact.coef, atol=1e-4)


def test_summary_is_surprisal_weighted_mean_and_uniform_when_weights_vanish():
    x = torch.arange(12, dtype=torch.float32).view(6, 1, 2)
    w = torch.tensor([0, 1, 3, 0, 0, 0.0])
    out = summarize_spans(x, w, torch.tensor([0, 3]), torch.tensor([3, 3]))
    assert torch.allclose(out[0, 0], (x[1, 0] * 1 + x[2, 0] * 3) / 4)
    assert torch.allclose(out[1, 0], x[3:6, 0].mean(0))


def test_segmentation_invariants():
    _, _, _, s = make_prompt(2000, seed=4)
    layout = segment_prompt(s, window=100, alpha=1.0, l_min=4, max_span=64)
    assert layout.window_start == 1900
    assert 0 in layout.fixed_pos.tolist()  # the attention sink
    assert (layout.span_len >= 4).all() and (layout.span_len <= 64).all()
    assert (layout.span_start[1:] > layout.span_start[:-1]).all()
    theta = float(s.double().mean() + s.double().std(correction=0))
    anchors = set(torch.nonzero(s[:1900] > theta).flatten().tolist())
    assert anchors <= set(layout.fixed_pos.tolist())  # anchors never inside spans
    for a, n in zip(layout.span_start.tolist(), layout.span_len.tolist()):
        assert not anchors & set(range(a, a + n))


def test_output_stretch_is_segmented_by_the_given_threshold_without_a_sink():
    _, _, _, s = make_prompt(300, seed=6)
    s[:6] = 0.5  # the stretch's first token is no sink: only the threshold makes it an anchor
    layout = segment_prompt(s, window=0, alpha=1.0, l_min=4, max_span=32, first_anchor=False, theta=3.0)
    assert layout.window_start == 300 and layout.num_fixed == layout.fixed_pos.numel()
    covered = sorted(layout.fixed_pos.tolist() + [p for a, n in zip(layout.span_start.tolist(), layout.span_len.tolist())
                                                  for p in range(a, a + n)])
    assert covered == list(range(300))  # every token once: anchor, short run or span
    assert 0 not in layout.fixed_pos.tolist() and layout.span_start[0] == 0
    assert set(torch.nonzero(s > 3.0).flatten().tolist()) <= set(layout.fixed_pos.tolist())


@pytest.mark.parametrize("store_rows", [True, False])
def test_appended_spans_equal_one_compression_of_both_stretches(store_rows):
    # The window's spanification appends a stretch's spans to the prompt's: the result must be
    # what compressing both stretches' spans at once gives (same summaries, keys, rebuilt rows).
    _, k, v, s = make_prompt(400, seed=7, rank=8)
    a = segment_prompt(s[:250], window=0, alpha=1.0, l_min=4, max_span=32, theta=2.0)
    b = segment_prompt(s[250:], window=0, alpha=1.0, l_min=4, max_span=32, first_anchor=False, theta=2.0)
    both = type(a)(torch.cat([a.fixed_pos, 250 + b.fixed_pos]), torch.cat([a.span_start, 250 + b.span_start]),
                   torch.cat([a.span_len, b.span_len]), 400, 400)
    args = dict(r_max=32, score_centroids=32, score_bits=2, store_rows=store_rows)
    joined = append_spans(compress_layer(k[:250], v[:250], a, s[:250], **args),
                          compress_layer(k[250:], v[250:], b, s[250:], **args))
    whole = compress_layer(k, v, both, s, **args)
    assert torch.equal(joined.span_len, whole.span_len)
    assert torch.allclose(joined.summary_k, whole.summary_k) and torch.allclose(joined.summary_v, whole.summary_v)
    assert torch.equal(joined.keys.log_count, whole.keys.log_count)
    present = joined.keys.log_count.isfinite().permute(0, 2, 1)  # [S, C, Hkv]: centroids standing for tokens
    assert torch.equal(joined.keys.centroids()[present], whole.keys.centroids()[present])
    assert joined.bases_k.factored == (not store_rows)
    ids = torch.arange(both.num_spans)
    for x, y in ((joined.bases_k, whole.bases_k), (joined.bases_v, whole.bases_v)):
        assert torch.equal(x.row_offset, y.row_offset)
        assert rel_err(rebuild_spans(x, ids)[0], rebuild_spans(y, ids)[0]) < 1e-5
    mixed_forms = compress_layer(k[250:], v[250:], b, s[250:], **{**args, "store_rows": not store_rows})
    with pytest.raises(ValueError, match="both must keep factors or both rows"):
        append_spans(joined, mixed_forms)


def test_appended_spans_keep_their_own_quantization_ranges():
    _, k, v, s = make_prompt(400, seed=7, rank=8)
    a = segment_prompt(s[:250], window=0, alpha=1.0, l_min=4, max_span=32, theta=2.0)
    b = segment_prompt(s[250:], window=0, alpha=1.0, l_min=4, max_span=32, first_anchor=False, theta=2.0)
    args = dict(r_max=32, score_centroids=32, score_bits=2, score_range_spans=4)
    first, more = compress_layer(k[:250], v[:250], a, s[:250], **args), compress_layer(k[250:], v[250:], b, s[250:], **args)
    joined = append_spans(first, more).keys
    ranges = first.keys.codes.lo.shape[0]
    assert torch.equal(joined.codes.range_of, torch.cat([first.keys.codes.range_of, more.keys.codes.range_of + ranges]))
    assert torch.equal(joined.centroids(), torch.cat([first.keys.centroids(), more.keys.centroids()]))
    assert joined.stored_log_count is None and joined.centroid_nbytes == first.keys.centroid_nbytes + more.keys.centroid_nbytes


@pytest.mark.parametrize("case", ["one_token", "shorter_than_window", "one_huge_span", "all_anchor"])
def test_odd_prompts(case):
    T = {"one_token": 1, "shorter_than_window": 10, "one_huge_span": 1000, "all_anchor": 200}[case]
    q, k, v, _ = make_prompt(T, seed=5)
    s = torch.zeros(T) if case == "one_huge_span" else torch.rand(T)
    if case == "all_anchor":
        s = torch.arange(T, dtype=torch.float32) % 2 * 10  # every other token surprising: runs of 1
    layout = segment_prompt(s, window=16, alpha=1.0 if case != "all_anchor" else -3.0, l_min=4, max_span=64)
    if case == "one_huge_span":
        assert layout.fixed_pos.tolist() == [0] and layout.num_spans == math.ceil(983 / 64)
    if case == "all_anchor":
        assert layout.num_spans == 0
    mem = compress_layer(k, v, layout, s, r_max=D)
    fk, fv = full_rows(layout, k, v)
    out = attend_memory(q, fk, fv, mem, torch.ones(H, layout.num_spans, dtype=torch.bool), 1 / math.sqrt(D))
    assert rel_err(out, exact_attention(q, k, v, 1 / math.sqrt(D))) < 1e-5


@pytest.mark.parametrize("budget", [40, 100, 250, 600])
def test_budget_is_never_exceeded(budget):
    q, k, v, s = make_prompt(1500, seed=6)
    layout = segment_prompt(s, window=32, alpha=1.0, l_min=4, max_span=64, budget=budget)
    mem = compress_layer(k, v, layout, s, r_max=16, score_centroids=4)
    if layout.base_rows > budget:
        # only possible when even token 0 + window + minimal spans do not fit
        assert layout.fixed_pos.tolist() == [0]
        zoom_budget = 0
    else:
        zoom_budget = budget - layout.base_rows
    for name in POLICIES:
        policy = (RouterPolicy(ZoomRouter(ModelShape(1, H, HKV, D), r_max=16)) if name == "router"
                  else make_policy(name))
        zoom = policy.select(0, q, mem.keys, zoom_budget, 1 / math.sqrt(D))
        per_kv = zoom.view(HKV, H // HKV, -1)[:, 0]
        extra = (per_kv.float() * (mem.span_len - 1).float()).sum(dim=1)
        assert (extra <= zoom_budget).all()
        assert (layout.base_rows + extra <= max(budget, layout.base_rows)).all()


def test_tight_budget_demotes_low_surprisal_anchors_instead_of_failing():
    _, _, _, s = make_prompt(3000, seed=7)
    loose = segment_prompt(s, window=32, alpha=1.0, l_min=4, max_span=64)
    tight = segment_prompt(s, window=32, alpha=1.0, l_min=4, max_span=64, budget=loose.base_rows // 3)
    assert tight.base_rows <= loose.base_rows // 3 < loose.base_rows
    in_spans = torch.cat([torch.arange(a, a + n) for a, n in zip(tight.span_start.tolist(), tight.span_len.tolist())])
    demoted_max = s[in_spans].max()
    # whatever is more surprising than the most surprising demoted token is still an anchor
    more_surprising = torch.nonzero(s[: tight.window_start] > demoted_max).flatten()
    assert set(more_surprising.tolist()) <= set(tight.fixed_pos.tolist())
    assert demoted_max > float(s.double().mean() + s.double().std(correction=0))  # anchors were demoted


def test_budgeted_zoom_takes_highest_scores_first():
    score = torch.tensor([[0.1, 5.0, 1.0, 3.0]]).repeat(3, 1)
    lens = torch.tensor([10, 10, 10, 10])
    zoom = budgeted_zoom(score, lens, zoom_budget=20, num_kv_heads=1)
    assert zoom[0].tolist() == [False, True, False, True]


def test_token_surprisal_is_minus_the_log_probability_of_the_token():
    from sekv_vllm.core.surprisal import token_surprisal

    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    targets = torch.tensor([0, 7, 39, 7, 3])
    want = -torch.log_softmax(logits.float(), dim=-1)[torch.arange(5), targets]
    assert torch.allclose(token_surprisal(logits, targets), want, atol=1e-5)



@pytest.mark.parametrize("max_span", [32, 80])  # spans shorter than D (X X^T) and longer (X^T X)
def test_gated_rows_equal_the_gated_factors_rebuilt(max_span):
    """`gated_span_rows` (the served path at r_max >= every span) == the factors' path: fit, gate, rebuild."""
    _, k, _, s = make_prompt(400, seed=6, rank=12)
    k[100:140] = torch.randn(40, HKV, D)  # some spans of full rank
    layout = segment_prompt(s, window=10, alpha=1.0, l_min=4, max_span=max_span)
    seen = {}

    def gates_of(singular):
        g = torch.Generator().manual_seed(1)
        seen["singular"], seen["gates"] = singular, torch.rand(singular.shape, generator=g) * 0.6 + 0.4
        return seen["gates"]

    got = gated_span_rows(k, layout.span_start, layout.span_len, gates_of)
    fitted = fit_span_bases(k, layout.span_start, layout.span_len, r_max=max_span)
    want = as_rows(gate_bases(fitted, seen["gates"]))
    top = float(singular_values(fitted).max())
    assert torch.allclose(seen["singular"], singular_values(fitted), atol=1e-4 * top)
    assert got.basis is None and torch.equal(got.row_offset, want.row_offset)
    assert torch.allclose(got.coef, want.coef, atol=1e-4 * float(k.abs().max()))
    # gates of 1 give the rows back; a policy without gates gets None
    ones = gated_span_rows(k, layout.span_start, layout.span_len, torch.ones_like)
    assert torch.allclose(ones.coef, span_rows(k, layout.span_start, layout.span_len).coef, atol=1e-4 * float(k.abs().max()))
    assert gated_span_rows(k, layout.span_start, layout.span_len, lambda _: None) is None
