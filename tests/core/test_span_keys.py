"""Span scoring keys: key centroids estimate each span's attention mass (torch only)."""
import math

import pytest

import torch

from sekv_vllm.core import SpanKeys, scoring_nbytes, segment_prompt, span_keys, summarize_spans
from sekv_vllm.core.span_keys import quantize_centroids
from sekv_vllm.core.span_summary import span_token_index

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
    counts = keys.log_count.float().exp().sum(dim=2)  # [S, Hkv]
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


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_quantized_keys_round_trip_within_half_a_step_and_count_their_bytes(bits):
    k, s, layout, q = prompt(400, 4)
    summary = summarize_spans(k, s, layout.span_start, layout.span_len)
    exact = span_keys(k, summary, layout.span_start, layout.span_len, num_centroids=16)
    coded = span_keys(k, summary, layout.span_start, layout.span_len, num_centroids=16, bits=bits)
    assert coded.centroid_k is None and coded.codes.codes.dtype == torch.uint8
    present = (exact.log_count > float("-inf")).permute(0, 2, 1)[..., None]  # [S, C, Hkv, 1]
    err = (coded.centroids() - exact.centroid_k.float()).abs() * present
    half_step = coded.codes.step.float()[:, None] / 2 + 1e-3  # [S, 1, Hkv, D]
    assert (err <= half_step).all()
    S, C = layout.num_spans, 16
    # codes, a range per span and its index; no counts (16 centroids: each key of a span of at most 16 its own)
    assert coded.stored_log_count is None
    assert coded.centroid_nbytes == S * HKV * C * D * bits // 8 + 2 * S * HKV * D * 2 + S * 8
    # more bits, closer to the exact span mass
    errors = [(span_keys(k, summary, layout.span_start, layout.span_len, 16, b).score(q, SCALE)
               - exact_span_mass(q, k, layout)).abs().mean() for b in (2, 4, 8)]
    assert errors[0] > errors[1] > errors[2] and errors[2] < 0.02


def test_two_bit_keys_still_find_the_needle_span():
    g = torch.Generator().manual_seed(5)
    T, n = 10 * 16, 16
    k = torch.randn(T, HKV, D, generator=g)
    q = torch.randn(H, D, generator=g) * 3
    k[7 * n + 5] = q.view(HKV, H // HKV, D).mean(dim=1) * 2  # the needle, in span 7
    start, length = torch.arange(10) * n, torch.full((10,), n)
    summary = summarize_spans(k, torch.ones(T), start, length)
    two_bit = span_keys(k, summary, start, length, num_centroids=16, bits=2).score(q, SCALE)
    assert (two_bit.argmax(dim=1) == 7).all()


def test_unsupported_bits_are_refused_naming_the_field():
    k, s, layout, _ = prompt(200, 6)
    summary = summarize_spans(k, s, layout.span_start, layout.span_len)
    with pytest.raises(ValueError, match="score_bits"):
        span_keys(k, summary, layout.span_start, layout.span_len, num_centroids=4, bits=3)


@pytest.mark.parametrize("centroids,bits", [(0, 2), (0, 16), (4, 16), (8, 2), (32, 2), (32, 4), (32, 8), (32, 16)])
@pytest.mark.parametrize("range_spans", [1, 4])
def test_scoring_bytes_are_known_before_the_spans_are_made(centroids, bits, range_spans):
    # the budget plan counts a span's scoring bytes before compressing: they must be what it then holds
    # (a last group of spans shorter than range_spans holds a whole range: at most the rest of one)
    k, s, layout, _ = prompt(400, 4)
    summary = summarize_spans(k, s, layout.span_start, layout.span_len)
    keys = span_keys(k, summary, layout.span_start, layout.span_len, centroids, bits, range_spans)
    planned = layout.num_spans * scoring_nbytes(centroids, bits, HKV, D, int(layout.span_len.max()), range_spans)
    short = 0 if centroids == 0 or bits == 16 else 2 * HKV * D * 2 * (1 - 1 / range_spans)
    assert planned <= keys.centroid_nbytes <= planned + short + 1e-6
    # counts are stored only where a centroid may stand for several keys
    assert (keys.stored_log_count is None) == (0 < centroids and centroids >= int(layout.span_len.max()))


def test_spans_sharing_a_range_score_as_the_keys_within_its_steps():
    k, s, layout, q = prompt(400, 4)
    summary = summarize_spans(k, s, layout.span_start, layout.span_len)
    C = int(layout.span_len.max())
    exact = span_keys(k, summary, layout.span_start, layout.span_len, C)
    shared = span_keys(k, summary, layout.span_start, layout.span_len, C, bits=4, range_spans=4)
    codes = shared.codes
    assert codes.lo.shape[0] == -(-layout.num_spans // 4) and torch.equal(codes.range_of, torch.arange(layout.num_spans) // 4)
    present = (exact.log_count > float("-inf")).permute(0, 2, 1)[..., None]
    err = (shared.centroids() - exact.centroid_k.float()).abs() * present
    assert (err <= codes.step[codes.range_of].float()[:, None] / 2 + 1e-3).all()
    # a range per span fits each span's keys at least as closely
    own = span_keys(k, summary, layout.span_start, layout.span_len, C, bits=4)
    assert (own.centroids() - exact.centroid_k.float()).abs().mul(present).mean() < err.mean()


@pytest.mark.parametrize("bits", [2, 4])
def test_slots_past_a_span_set_no_range_and_code_its_keys_as_masked_quantization_does(bits):
    """Every key its own centroid with slots past the span's length (C > L): those slots repeat a key, so
    the ranges and the keys' codes equal a quantization that masks the slots out."""
    k, s, layout, _ = prompt(300, 7)
    summary = summarize_spans(k, s, layout.span_start, layout.span_len)
    C = 24  # > max_span 16
    got = span_keys(k, summary, layout.span_start, layout.span_len, num_centroids=C, bits=bits)
    index, valid = span_token_index(layout.span_start, layout.span_len)
    S, L = index.shape
    zero_padded = torch.nn.functional.pad((k[index] * valid[..., None, None]).permute(0, 2, 1, 3), (0, 0, 0, C - L))
    present = torch.nn.functional.pad(valid, (0, C - L))[:, None].expand(S, HKV, C)
    want = quantize_centroids(zero_padded, present, bits)
    assert torch.equal(got.codes.lo, want.lo) and torch.equal(got.codes.step, want.step)
    for i, n in enumerate(layout.span_len.tolist()):
        assert torch.equal(got.codes.codes[i, :, :, :n], want.codes[i, :, :, :n])
    assert got.stored_log_count is None  # every key a centroid: counts implied
