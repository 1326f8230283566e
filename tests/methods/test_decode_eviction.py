"""H2O, and eviction while decoding (H2O, TOVA, StreamingLLM), against references written row by row: the
prompt's accumulated attention, the kept positions, and each step's attention over what a reference keeps."""
import math

import pytest
import torch

from sekv_vllm.config import SeKVConfig
from sekv_vllm.core import exact_attention
from sekv_vllm.methods import H2O, TOVA, PromptRows
from sekv_vllm.methods.h2o import accumulate_attention
from sekv_vllm.methods.kv_quantization import KVQuantization
from sekv_vllm.runtime import SeKVRuntime, Status
from tests.methods.test_row_methods import HKV, D, H, LAYERS, T, prefill

SCALE = 1 / math.sqrt(D)


def prompt_attention_by_rows(k, q):
    """[Hkv, T]: row t's attention from every query i >= t, averaged over the query heads of its KV head."""
    group = H // HKV
    acc = torch.zeros(HKV, T)
    for h in range(H):
        for i in range(T):
            acc[h // group, : i + 1] += torch.softmax(k[: i + 1, h // group] @ q[i, h] * SCALE, 0) / group
    return acc


def test_prefill_sums_the_attention_every_row_receives_chunk_by_chunk():
    g = torch.Generator().manual_seed(0)
    k, q = torch.randn(T, HKV, D, generator=g), torch.randn(T, H, D, generator=g)
    acc = torch.zeros(HKV, T)
    for start, stop in ((0, 7), (7, 200), (200, T)):  # chunked prefill, chunks of any size
        accumulate_attention(acc, q[start:stop], k[:stop], start)
    assert torch.allclose(acc, prompt_attention_by_rows(k, q), atol=1e-4)


def test_h2o_keeps_the_recent_rows_and_the_heaviest_before_them():
    g = torch.Generator().manual_seed(1)
    attention = torch.rand(HKV, T, generator=g)
    rows = PromptRows(torch.randn(T, HKV, D, generator=g), torch.randn(T, HKV, D, generator=g),
                      torch.zeros(0, H, D), attention)
    kept = H2O(recent_share=0.25).keep(rows, 40)
    for h in range(HKV):
        want = set(range(T - 10, T)) | set(attention[h, : T - 10].topk(30).indices.tolist())
        assert kept[h].tolist() == sorted(want)


def runtime(method, **settings):
    return SeKVRuntime(SeKVConfig(method=method, min_prompt_tokens=10, **settings), LAYERS)


def decode(rt, steps, seed=5):
    """Steps of layer l0 (the position counter's layer): the new rows and queries, and the outputs."""
    g = torch.Generator().manual_seed(seed)
    new = [(torch.randn(1, HKV, D, generator=g), torch.randn(1, HKV, D, generator=g), torch.randn(1, H, D, generator=g))
           for _ in range(steps)]
    return new, [rt.attend_batch(["r"], "l0", q, SCALE, k1, v1)[0] for k1, v1, q in new]


class Reference:
    """Each KV head's kept rows as a dict position -> (k, v, score), evicted by a rule, row by row."""

    def __init__(self, k, v, kept, scores):
        self.heads = [{int(p): [k[p, h], v[p, h], float(scores[h, p])] for p in kept[h]} for h in range(HKV)]

    def step(self, k1, v1, q, position, rule, n_keep):
        out = torch.zeros(H, D)
        group = H // HKV
        step_attn = {}
        for h in range(HKV):
            rows = self.heads[h]
            rows[position] = [k1[0, h], v1[0, h], 0.0]
            pos = sorted(rows)
            kk, vv = torch.stack([rows[p][0] for p in pos]), torch.stack([rows[p][1] for p in pos])
            for j in range(group):
                a = torch.softmax(kk @ q[0, h * group + j] * SCALE, 0)
                out[h * group + j] = a @ vv
                for p, w in zip(pos, a.tolist()):
                    step_attn[(h, p)] = step_attn.get((h, p), 0.0) + w / group
        for h in range(HKV):
            rows = self.heads[h]
            for p in rows:
                rows[p][2] += step_attn[(h, p)]
            if len(rows) > n_keep:
                del rows[rule(h, rows, step_attn)]
        return out

    def positions(self, h):
        return sorted(self.heads[h])


def test_h2o_decodes_over_the_rows_a_reference_keeps_and_evicts():
    rt = runtime("h2o", budget_ratio=0.2, recent_share=0.5)
    rt.admit("r", T, None)
    kvq = prefill(rt, "r")
    assert rt.compress("r").status is Status.COMPRESSED
    k, v, q_all = kvq["l0"]
    n_keep, recent = 60, 30
    acc = prompt_attention_by_rows(k, q_all)
    kept = H2O(recent_share=0.5).keep(PromptRows(k, v, q_all[:0], acc), n_keep)
    ref = Reference(k, v, kept, acc)

    def heavy_rule(h, rows, _):  # the lowest accumulated score outside the recent rows
        newest = max(rows)
        return min((p for p in rows if p <= newest - recent), key=lambda p: rows[p][2])

    new, outs = decode(rt, 12)
    for i, ((k1, v1, q), out) in enumerate(zip(new, outs)):
        assert torch.allclose(out, ref.step(k1, v1, q, T + i, heavy_rule, n_keep), atol=1e-5), f"step {i}"
    state = rt.requests["r"].method_state["l0"]
    for h in range(HKV):
        assert sorted(state.positions[h].tolist()) == ref.positions(h)
    assert rt.requests["r"].rows["l0"].length == n_keep and state.evicted == 12
    assert rt.figures("r")["evicts_while_decoding"] and rt.figures("r")["fast_tier_fraction"] == pytest.approx(0.2)


def test_tova_evicts_what_each_step_attends_to_least_averaged_over_every_head():
    rt = runtime("tova", budget_ratio=0.2)
    rt.admit("r", T, None)
    kvq = prefill(rt, "r")
    rt.compress("r")
    k, v, q_all = kvq["l0"]
    kept = TOVA().keep(PromptRows(k, v, q_all[-1:]), 60)
    ref = Reference(k, v, kept, torch.zeros(HKV, T))

    def tova_rule(h, rows, step_attn):  # TOVA: the same row for every KV head, the least attended on average
        return min(rows, key=lambda p: sum(step_attn[(g, p)] for g in range(HKV)))

    new, outs = decode(rt, 8, seed=7)
    for i, ((k1, v1, q), out) in enumerate(zip(new, outs)):
        assert torch.allclose(out, ref.step(k1, v1, q, T + i, tova_rule, 60), atol=1e-5), f"step {i}"


@pytest.mark.parametrize("bits", [16, 4])
def test_streaming_llm_rolls_its_window_past_the_sinks_whole_or_quantized(bits):
    rt = runtime("streaming_llm", budget_ratio=0.1, sink_tokens=4, kv_bits=bits, kv_quant_group=16)
    rt.admit("r", T, None)
    kvq = prefill(rt, "r")
    rt.compress("r")
    k, v, _ = kvq["l0"]
    n_keep = rt.figures("r")["kept_prompt_rows"]
    new, outs = decode(rt, 10, seed=9)
    all_k = torch.cat([k, *[n[0] for n in new]])
    all_v = torch.cat([v, *[n[1] for n in new]])
    # the last step attends before it evicts: the sinks and the newest n_keep - 4 + 1 rows
    keep = torch.cat([torch.arange(4), torch.arange(T + 10 - (n_keep - 3), T + 10)])
    kk, vv = all_k[keep], all_v[keep]
    if bits < 16:  # the rows as their codes give them back (moved as bytes, never quantized twice)
        kk, vv = KVQuantization(bits=bits, group=16).decode(KVQuantization(bits=bits, group=16).encode(kk, vv),
                                                            HKV, D, torch.float32)
    assert torch.allclose(outs[-1], exact_attention(new[-1][2][0], kk, vv, SCALE), atol=1e-5)
    assert rt.requests["r"].rows["l0"].length == n_keep


def test_evicting_nothing_where_the_budget_holds_the_prompt_or_the_setting_is_off():
    for method, settings in (("h2o", {"budget_ratio": 1.0}), ("tova", {"budget_ratio": 0.2, "evict_while_decoding": False})):
        rt = runtime(method, **settings)
        rt.admit("r", T, None)
        prefill(rt, "r")
        rt.compress("r")
        decode(rt, 3)
        kept = rt.figures("r")["kept_prompt_rows"]
        assert not rt.figures("r")["evicts_while_decoding"] and rt.requests["r"].rows["l0"].length == kept + 3


def test_a_resumed_requests_earlier_output_joins_the_kept_rows_at_its_own_positions():
    # Preempted before compression: its recompute captured 5 output rows after the prompt. StreamingLLM keeps 3
    # prompt rows (all sinks), then those rows; each step evicts the oldest row that is not a sink.
    rt = runtime("streaming_llm", token_budget=3, sink_tokens=4)
    rt.admit("r", T, None)
    prefill(rt, "r")
    g = torch.Generator().manual_seed(11)
    for name in LAYERS:
        rt.capture("r", name, T, torch.randn(5, HKV, D, generator=g), torch.randn(5, HKV, D, generator=g))
    rt.compress("r")
    decode(rt, 2)
    state = rt.requests["r"].method_state["l0"]
    assert sorted(state.positions[0].tolist()) == [0, 1, 2, *range(T + 2, T + 7)]
    assert rt.requests["r"].rows["l0"].length == 8 and state.evicted == 2
