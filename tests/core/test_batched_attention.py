"""Many requests at once give what each request alone gives (torch only)."""
import math

import torch

from sekv_vllm.core import compress_layer, concat_span_keys, segment_prompt
from sekv_vllm.core.batched_attention import batched_mixed_attention
from sekv_vllm.core.low_rank import rebuild_spans_of, span_factors
from sekv_vllm.core.mixed_attention import mixed_attention
from sekv_vllm.policies import SpanScorePolicy, budgeted_zoom, segment_budgeted_zoom, segment_key_recall

H, HKV, D = 6, 2, 16
SCALE = 1 / math.sqrt(D)


def request(T, seed, centroids):
    g = torch.Generator().manual_seed(seed)
    k, v, s = torch.randn(T, HKV, D, generator=g), torch.randn(T, HKV, D, generator=g), torch.rand(T, generator=g)
    layout = segment_prompt(s, window=16, alpha=1.0, l_min=4, max_span=16)
    mem = compress_layer(k, v, layout, s, r_max=16, score_centroids=centroids)
    full = torch.cat([layout.fixed_pos, torch.arange(layout.window_start, T)])
    return mem, k[full], v[full], torch.randn(H, D, generator=g) * 2


def test_segment_zoom_is_the_per_request_zoom():
    g = torch.Generator().manual_seed(0)
    lens = [7, 1, 12, 5]
    seg = torch.repeat_interleave(torch.arange(4), torch.tensor(lens))
    score = torch.randn(seg.numel(), H, generator=g)
    span_len = torch.randint(4, 17, (seg.numel(),), generator=g)
    eligible = torch.rand(seg.numel(), H, generator=g) > 0.3
    budgets = torch.tensor([30, 0, 1000, 15])
    got = segment_budgeted_zoom(score, seg, span_len, budgets, HKV, eligible)
    for b in range(4):
        m = seg == b
        want = budgeted_zoom(score[m].T, span_len[m], int(budgets[b]), HKV, eligible[m].T).T
        assert torch.equal(got[m], want), b


def test_whole_spans_hold_their_min_share_of_the_span_scores():
    """min_shares: only spans whose softmax share of their request's span scores (eligible spans, the KV
    group's best head) reaches their request's minimum are zoomed, best first while the budget lasts."""
    g = torch.Generator().manual_seed(1)
    lens = [9, 14, 6]
    seg = torch.repeat_interleave(torch.arange(3), torch.tensor(lens))
    score = torch.randn(seg.numel(), H, generator=g) * 3
    span_len = torch.randint(4, 17, (seg.numel(),), generator=g)
    eligible = torch.rand(seg.numel(), H, generator=g) > 0.2
    budgets = torch.tensor([1000, 1000, 20])
    min_shares = torch.tensor([0.0, 0.15, 0.3])
    got = segment_budgeted_zoom(score, seg, span_len, budgets, HKV, eligible, min_shares)
    group = score.masked_fill(~eligible, float("-inf")).view(-1, HKV, H // HKV).amax(2)
    for b in range(3):
        m = seg == b
        share = torch.softmax(group[m], dim=0)  # [S_b, Hkv]
        for kh in range(HKV):
            cols = slice(kh * (H // HKV), (kh + 1) * (H // HKV))
            want = budgeted_zoom(score[m][:, cols].T, span_len[m], int(budgets[b]), 1,
                                 (eligible[m][:, cols] & (share[:, kh:kh + 1] >= min_shares[b])).T).T
            assert torch.equal(got[m][:, cols], want), (b, kh)
    # the first request zooms every eligible span (its budget holds them); the others only those that stand out
    assert torch.equal(got[seg == 0].view(-1, HKV, H // HKV)[..., 0], (group[seg == 0] > float("-inf")))
    assert 0 < int(got[seg == 1].sum()) < int((group[seg == 1] > float("-inf")).sum()) * (H // HKV)


def test_batch_equals_each_request_alone():
    reqs = [request(T, seed, c) for T, seed, c in [(300, 1, 4), (120, 2, 0), (500, 3, 4)]]
    policy = SpanScorePolicy()
    budgets = [60, 200, 0]
    want = []
    for (mem, fk, fv, q), budget in zip(reqs, budgets):
        zoom = policy.select(0, q, mem.keys, budget, SCALE)
        ids = torch.nonzero(zoom.any(0)).flatten()
        (zk, zv), zs = rebuild_spans_of(ids, mem.bases_k, mem.bases_v)
        want.append(mixed_attention(q, fk, fv, mem.summary_k, mem.summary_v, mem.span_len, zoom, zk, zv, zs, SCALE))

    keys = concat_span_keys([m.keys for m, *_ in reqs])
    counts = torch.tensor([m.keys.num_spans for m, *_ in reqs])
    seg = torch.repeat_interleave(torch.arange(3), counts)
    q = torch.stack([r[3] for r in reqs])
    score, _ = policy.span_scores(0, q, seg, keys, SCALE)
    zoom = segment_budgeted_zoom(score, seg, keys.span_len, torch.tensor(budgets), HKV)
    pair_span, pair_head = torch.nonzero(zoom.view(-1, HKV, H // HKV).any(2), as_tuple=True)
    parts, first = [], 0
    for i, ((mem, *_), n) in enumerate(zip(reqs, counts.tolist())):
        mine = seg[pair_span] == i
        parts.append((span_factors(mem.bases_k, pair_span[mine] - first, pair_head[mine], 16, 16),
                      span_factors(mem.bases_v, pair_span[mine] - first, pair_head[mine], 16, 16)))
        first += n
    coef_k, basis_k = (torch.cat(t) for t in zip(*(k for k, _ in parts)))
    coef_v, basis_v = (torch.cat(t) for t in zip(*(v for _, v in parts)))
    whole = zoom.view(-1, HKV, H // HKV)[:, :, 0]
    read = (torch.arange(16)[None, :] < keys.span_len[:, None])[pair_span]
    got = batched_mixed_attention(q, [r[1] for r in reqs], [r[2] for r in reqs], keys.summary_k,
                                  torch.cat([m.summary_v for m, *_ in reqs]), seg,
                                  keys.span_len[:, None] * ~whole, pair_span, pair_head, coef_k, basis_k, coef_v,
                                  basis_v, read, SCALE)
    assert torch.allclose(got, torch.stack(want), atol=1e-5)
    assert zoom.any() and not zoom.all()  # the test exercises zoomed and summarised spans


def test_span_factors_rebuild_the_rows():
    mem, *_ = request(400, 4, 0)
    ids, heads = torch.tensor([0, 3, 5]), torch.tensor([1, 0, 1])
    coef, basis = span_factors(mem.bases_k, ids, heads, 20, 18)  # padded past the longest span and the rank
    rows, row_span = rebuild_spans_of(ids, mem.bases_k)
    padded = coef @ basis  # [3, 20, D]
    for i, (s, h) in enumerate(zip(ids.tolist(), heads.tolist())):
        n = int(mem.span_len[s])
        assert torch.allclose(padded[i, :n], rows[0][row_span == s, h], atol=1e-5)
        assert (padded[i, n:] == 0).all()


def test_key_recall_spends_what_whole_spans_leave_on_the_best_keys():
    """Per request and KV head: the keys of spans not zoomed, best first, as many as the rows left; a key
    counts for the heads its span is eligible for; spans whose centroids are not their keys recall none."""
    g = torch.Generator().manual_seed(3)
    counts = [5, 4, 6]
    seg = torch.repeat_interleave(torch.arange(3), torch.tensor(counts))
    S, C = seg.numel(), 16
    span_len = torch.randint(4, 17, (S,), generator=g)
    key_score = torch.randn(S, H, C, generator=g)
    eligible = torch.rand(S, H, generator=g) > 0.2
    per_key = torch.ones(S, dtype=torch.bool)
    per_key[7] = False
    budgets = torch.tensor([20, 3, 200])
    score = torch.randn(S, H, generator=g)
    zoom = segment_budgeted_zoom(score, seg, span_len, budgets, HKV, eligible)
    read = segment_key_recall(key_score, seg, span_len, zoom, budgets, HKV, eligible, per_key)
    whole = zoom.view(S, HKV, -1)[:, :, 0]
    G = H // HKV
    for b in range(3):
        for kh in range(HKV):
            mine = torch.nonzero(seg == b).flatten().tolist()
            left = int(budgets[b]) - sum(int(span_len[s]) - 1 for s in mine if whole[s, kh])
            cands = []
            for s in mine:
                if whole[s, kh] or not per_key[s]:
                    continue
                for c in range(int(span_len[s])):
                    heads = [kh * G + j for j in range(G) if eligible[s, kh * G + j]]
                    if heads:
                        cands.append((-max(float(key_score[s, h, c]) for h in heads), s, c))
            want = {(s, c) for _, s, c in sorted(cands)[:max(left, 0)]}
            got = {(s, c) for s in mine for c in torch.nonzero(read[s, kh]).flatten().tolist()}
            assert got == want, (b, kh)
    assert read.any() and not read[7].any()


def test_attention_over_recalled_keys_is_attention_over_those_rows():
    """Recalled keys are attended as their rows; the summary of a span stands for its tokens not read
    (logit bias log of their count) and is gone once every token is read."""
    mem, fk, fv, q = request(300, 5, 0)
    (rows_k, rows_v), _ = rebuild_spans_of(torch.arange(mem.keys.num_spans), mem.bases_k, mem.bases_v)
    S, L = mem.keys.num_spans, 16
    g = torch.Generator().manual_seed(9)
    read = (torch.rand(S, HKV, L, generator=g) > 0.7) & (torch.arange(L)[None, None, :] < mem.span_len[:, None, None])
    read[1] = torch.arange(L)[None, :] < mem.span_len[1]  # every token of span 1 read: no summary
    pair_span, pair_head = torch.nonzero(read.any(dim=2), as_tuple=True)
    coef_k, basis_k = span_factors(mem.bases_k, pair_span, pair_head, L, 16)
    coef_v, basis_v = span_factors(mem.bases_v, pair_span, pair_head, L, 16)
    count = mem.span_len[:, None] - read.sum(dim=2)
    got = batched_mixed_attention(q[None], [fk], [fv], mem.summary_k, mem.summary_v, torch.zeros(S, dtype=torch.int64),
                                  count, pair_span, pair_head, coef_k, basis_k, coef_v, basis_v,
                                  read[pair_span, pair_head], SCALE)[0]
    first = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(mem.span_len, 0)[:-1]])
    want = []
    for kh in range(HKV):
        ks, vs, bias = [fk[:, kh]], [fv[:, kh]], [torch.zeros(fk.shape[0])]
        for s in range(S):
            if count[s, kh] > 0:
                ks.append(mem.summary_k[s, kh][None]), vs.append(mem.summary_v[s, kh][None])
                bias.append(torch.log(count[s, kh].float())[None])
            toks = torch.nonzero(read[s, kh]).flatten() + first[s]
            ks.append(rows_k[toks, kh]), vs.append(rows_v[toks, kh]), bias.append(torch.zeros(toks.numel()))
        k, v, b = torch.cat(ks), torch.cat(vs), torch.cat(bias)
        qh = q.view(HKV, H // HKV, D)[kh]
        want.append(torch.softmax(qh @ k.T * SCALE + b, dim=-1) @ v)
    assert torch.allclose(got, torch.cat(want), atol=1e-5)
    assert (count[1] == 0).all() and (count > 0).any() and read.any()
