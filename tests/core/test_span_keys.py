"""Span scoring keys: key centroids estimate each span's attention mass (torch only)."""
import math

import torch

from sekv_vllm.core import SpanKeys, segment_prompt, span_keys, summarize_spans

H, HKV, D = 4, 2, 16
SCALE = 1 / math.sqrt(D)


def exact_span_mass(q, k, layout):
    """[H, S]: log sum over each span's tokens of exp(q . k * scale), from every key."""
    out = torch.empty(H, layout.num_spans)
    for s, (a, n) in enumerate(zip(layout.span_start.tolist(), layout.span_len.tolist())):
        logits = torch.einsum("kgd,tkd->kgt", q.view(HKV, H // HKV, D), k[a:a + n]).reshape(H, n) * SCALE
        out[:, s] = torch.logsumexp(logits, dim=-1)
    return out


def prompt(T, seed):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(T, HKV, D, generator=g)
    s = torch.rand(T, generator=g)
    layout = segment_prompt(s, window=8, alpha=1.0, l_min=4, max_span=16)
    return k, s, layout, torch.randn(H, D, generator=g) * 3


def test_one_centroid_per_token_is_the_exact_span_mass():
    k, s, layout, q = prompt(300, 0)
    keys = span_keys(k, summarize_spans(k, s, layout.span_start, layout.span_len), layout.span_start,
                     layout.span_len, num_centroids=16)
    assert torch.allclose(keys.score(q, SCALE), exact_span_mass(q, k, layout), atol=2e-3)


def test_no_centroids_is_the_summary_score():
    k, s, layout, q = prompt(300, 1)
    summary = summarize_spans(k, s, layout.span_start, layout.span_len)
    keys = span_keys(k, summary, layout.span_start, layout.span_len, num_centroids=0)
    qg = q.view(HKV, H // HKV, D)
    want = torch.einsum("kgd,skd->kgs", qg, summary).reshape(H, -1) * SCALE + torch.log(layout.span_len.float())
    assert torch.allclose(keys.score(q, SCALE), want, atol=2e-3)
    assert keys.centroid_k.shape == (layout.num_spans, 1, HKV, D)


def test_centroids_count_every_token_once():
    k, s, layout, _ = prompt(500, 2)
    keys = span_keys(k, summarize_spans(k, s, layout.span_start, layout.span_len), layout.span_start,
                     layout.span_len, num_centroids=4)
    counts = keys.log_count.float().exp().sum(dim=1)  # [S, Hkv]
    assert torch.allclose(counts, layout.span_len[:, None].float().expand_as(counts), rtol=2e-3)
    assert keys.centroid_nbytes == keys.centroid_k.numel() * 2 + keys.log_count.numel() * 2


def test_clustered_keys_are_scored_near_exactly_and_a_needle_is_not_averaged_away():
    g = torch.Generator().manual_seed(3)
    T, n = 8 + 10 * 16, 16
    centers = torch.randn(10, 4, HKV, D, generator=g)
    k = centers.repeat_interleave(4, dim=1).reshape(10 * n, HKV, D) + 0.01 * torch.randn(10 * n, HKV, D, generator=g)
    k = torch.cat([torch.zeros(8, HKV, D), k])  # tokens 0..7: fixed rows before the spans
    layout_start, layout_len = 8 + torch.arange(10) * n, torch.full((10,), n)
    q = torch.randn(H, D, generator=g) * 3
    # span 7 holds one needle: a key that matches every query head strongly, among 15 filler keys
    needle_row = 8 + 7 * n + 5
    k[needle_row] = q.view(HKV, H // HKV, D).mean(dim=1) * 2
    summary = summarize_spans(k, torch.ones(T), layout_start, layout_len)

    class Layout:  # what exact_span_mass reads
        span_start, span_len, num_spans = layout_start, layout_len, 10

    exact = exact_span_mass(q, k, Layout)
    four = span_keys(k, summary, layout_start, layout_len, num_centroids=4).score(q, SCALE)
    plain = SpanKeys.of_summaries(summary, layout_len).score(q, SCALE)
    assert (exact.argmax(dim=1) == 7).all()
    assert (four.argmax(dim=1) == 7).all()  # the centroids find the needle's span
    assert (four - exact).abs()[:, [i for i in range(10) if i != 7]].max() < 0.1
    assert (plain - exact).abs().max() > (four - exact).abs().max()
