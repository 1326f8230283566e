"""KV quantization of kept rows: the codec against its error bound, rows in pages (a byte stream across pages,
the engine's included), and a row-keeping method that composes with it in the runtime."""
import math

import pytest
import torch

from sekv_vllm.config import RequestOverrides, SeKVConfig, SeKVConfigError
from sekv_vllm.core import exact_attention
from sekv_vllm.methods import PromptRows, SnapKV, StreamingLLM, gather_kept
from sekv_vllm.methods.kv_quantization import KVQuantization
from sekv_vllm.methods.quest import gather_pages, page_bounds, page_scores, top_pages
from sekv_vllm.router import ModelShape
from sekv_vllm.runtime import SeKVRuntime, Status
from sekv_vllm.runtime.quantized_rows import QuantizedRows
from tests.methods.test_quest import PAGE, generate
from tests.methods.test_quest import prefill as quest_prefill
from tests.methods.test_quest import runtime as quest_runtime
from tests.methods.test_row_methods import LAYERS, HKV, D, H, T, prefill

BITS = (8, 4, 2)


def rows(n, seed=0, Hkv=3, D=64, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    scale = torch.rand(1, Hkv, D, generator=g) * 4  # channels of different ranges, as keys have
    return ((torch.randn(n, Hkv, D, generator=g) * scale).to(dtype),
            (torch.randn(n, Hkv, D, generator=g)).to(dtype))


@pytest.mark.parametrize("bits", BITS)
def test_codec_reconstructs_within_half_a_step_of_each_group(bits):
    codec = KVQuantization(bits=bits, group=32)
    k, v = rows(50)
    raw = codec.encode(k, v)
    assert raw.dtype == torch.uint8 and raw.shape == (50, codec.row_bytes(3, 64))
    assert codec.row_bytes(3, 64) == 2 * 3 * (64 * bits // 8 + 2 * 2 * 2)
    for x, y in zip((k, v), codec.decode(raw, 3, 64, torch.float32)):
        groups = x.view(50, 3, 2, 32)
        step = (groups.amax(-1) - groups.amin(-1)) / (2**bits - 1)
        bound = step / 2 + groups.abs().amax(-1) * 2e-3 + 1e-6  # half a step, plus float16 scale and minimum
        assert bool(((y.view(50, 3, 2, 32) - groups).abs() <= bound[..., None]).all())


@pytest.mark.parametrize("bits", BITS)
def test_values_on_the_grid_come_back_exactly(bits):
    levels = 2**bits - 1
    codes = torch.randint(0, levels + 1, (7, 2, 32), generator=torch.Generator().manual_seed(bits))
    codes[:, :, 0::16], codes[:, :, 1::16] = 0, levels  # each group of 16 spans the whole grid
    x = codes.float() * 0.5 - 3.0
    k, v = KVQuantization(bits=bits, group=16).decode(KVQuantization(bits=bits, group=16).encode(x, x), 2, 32,
                                                        torch.float32)
    assert torch.equal(k, x) and torch.equal(v, x)


def test_bad_bits_and_groups_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="kv_bits: 3"):
        KVQuantization(bits=3, group=32)
    with pytest.raises(ValueError, match="kv_quant_group: 32 does not divide the model's head size 48"):
        KVQuantization(bits=4, group=32).encode(*rows(2, D=48))


def engine_pages(P, block=16, Hkv=3, D=64, dtype=torch.bfloat16):
    """A layer's KV cache as vLLM's pages are read by sekv: [P, 2, block, Hkv, D]."""
    return torch.zeros(P, 2, block, Hkv, D, dtype=dtype)


@pytest.mark.parametrize("bits", BITS)
def test_quantized_rows_straddle_pages_and_survive_placement_and_copies(bits):
    codec = KVQuantization(bits=bits, group=32)
    k, v = rows(100, dtype=torch.bfloat16)
    stored = QuantizedRows.of_rows(k[:90], v[:90], codec, block=16, spare=0)
    for i in range(90, 100):  # decode steps: one row at a time, past the own pages' end
        stored.append(k[i : i + 1], v[i : i + 1])
    want = codec.decode(codec.encode(k, v), 3, 64, torch.bfloat16)
    assert all(torch.equal(a, b) for a, b in zip(stored.view(), want))
    pages = engine_pages(40)
    page_bytes = pages[0].numel() * pages.element_size()
    need = math.ceil(100 * codec.row_bytes(3, 64) / page_bytes)  # the bytes, not the rows, set the pages
    assert need < math.ceil(100 / 16)
    table = torch.randperm(40, generator=torch.Generator().manual_seed(0))[: need + 1]  # one spare page
    with pytest.raises(ValueError, match="cannot hold 100 rows"):
        stored.place(pages, table[: need - 1])
    placed = stored.place(pages, table)
    assert not placed.own and placed.capacity >= 100 and torch.equal(placed.pages_used, table[:need])
    untouched = torch.ones(40, dtype=torch.bool)
    untouched[table] = False
    assert not bool(pages[untouched].any())  # only the pages handed over were written
    assert all(torch.equal(a, b) for a, b in zip(placed.view(), want))
    while placed.length < placed.capacity:
        placed.append(k[:1], v[:1])
    with pytest.raises(RuntimeError, match="pages handed over"):
        placed.append(k[:1], v[:1])
    own = placed.to_own(block=64, spare=5)  # preempted: out of the engine's pages, bytes as stored
    assert own.own and own.capacity >= own.length + 5
    assert all(torch.equal(a, b) for a, b in zip(own.view(), placed.view()))
    placed.scrub()  # codes read as floats may be NaN: the pages go back to vLLM zeroed
    assert not bool(pages.any())


def test_a_request_that_ends_leaves_no_codes_in_the_engines_pages():
    rt = quantized_runtime("snapkv", budget_ratio=0.25, kv_bits=2)
    rt.admit("r", T, None)
    prefill(rt, "r")
    rt.compress("r")
    pages = {name: torch.zeros(8, 2, 16, HKV, D) for name in LAYERS}  # float32 pages, as the suite's engine
    assert rt.place_rows("r", pages, torch.tensor([5, 2, 7]))
    assert all(bool(p.isnan().any() or p.any()) for p in pages.values())
    rt.release("r", outcome="finished")
    assert not any(bool(p.any()) for p in pages.values())


def quantized_runtime(method, **settings):
    """The row methods' test model (head size 16): groups of 16 channels."""
    group = {"kv_quant_group": 16} if method != "sekv" else {}
    return SeKVRuntime(SeKVConfig(method=method, min_prompt_tokens=10, **group, **settings), LAYERS)


@pytest.mark.parametrize("bits", BITS)
def test_snapkv_with_quantized_rows_keeps_more_rows_for_the_same_bytes_and_decodes_over_them(bits):
    budget = 0.25
    plain, quant = quantized_runtime("snapkv", budget_ratio=budget), quantized_runtime("snapkv", budget_ratio=budget,
                                                                                        kv_bits=bits)
    for rt in (plain, quant):
        rt.admit("r", T, None)
        kvq = prefill(rt, "r")
        assert rt.compress("r").status is Status.COMPRESSED
    codec = KVQuantization(bits=bits, group=16)
    fig, fig_plain = quant.figures("r"), plain.figures("r")
    n_keep = min(math.ceil(budget * T) * (2 * HKV * D * 4) // codec.row_bytes(HKV, D), T)
    assert fig["kv_bits"] == bits and fig["kept_prompt_rows"] == n_keep > fig_plain["kept_prompt_rows"]
    assert fig["fast_tier_bytes"] == n_keep * codec.row_bytes(HKV, D) * len(LAYERS)
    assert fig["fast_tier_fraction"] <= fig_plain["fast_tier_fraction"] + 1e-9  # the same bytes, or fewer
    # decode: exact attention over the rows SnapKV keeps at that count, as the codec gives them back
    k, v, q_all = kvq["l0"]
    kept = SnapKV().keep(PromptRows(k, v, q_all[-64:]), n_keep)
    g = torch.Generator().manual_seed(1)
    q, k1, v1 = torch.randn(1, H, D, generator=g), torch.randn(1, HKV, D, generator=g), torch.randn(1, HKV, D, generator=g)
    k_ref, v_ref = codec.decode(codec.encode(*[torch.cat(p) for p in zip(gather_kept(k, v, kept), (k1, v1))]),
                                HKV, D, torch.float32)
    out = quant.attend_batch(["r"], "l0", q, 0.25, k1, v1)
    assert torch.allclose(out[0], exact_attention(q[0], k_ref, v_ref, 0.25), atol=1e-5)


def test_eight_bits_at_full_budget_stay_close_to_exact_attention_and_hold_half_the_bytes_or_less():
    rt = quantized_runtime("streaming_llm", budget_ratio=1.0, kv_bits=8)
    rt.admit("r", T, None)
    kvq = prefill(rt, "r")
    rt.compress("r")
    k, v, _ = kvq["l1"]
    q = torch.randn(1, H, D, generator=torch.Generator().manual_seed(2))
    ref = exact_attention(q[0], k, v, 0.25)
    out = rt.attend_batch(["r"], "l1", q, 0.25)[0]
    assert float((out - ref).norm() / ref.norm()) < 2e-2
    fig = rt.figures("r")
    assert fig["kept_prompt_rows"] == T and fig["fast_tier_fraction"] <= 0.5


def test_a_request_chooses_its_bits_with_its_method_and_bad_choices_are_refused():
    rt = quantized_runtime("streaming_llm", budget_ratio=0.25)  # 16 bits unless a request says otherwise
    assert rt.admit("q", T, {"sekv_method": "streaming_llm", "sekv_kv_bits": 4}).kv_bits == 4
    prefill(rt, "q")
    assert rt.compress("q").status is Status.COMPRESSED and rt.figures("q")["kv_bits"] == 4
    # another method's default groups (32 channels) do not divide this model's heads (16): full KV, said why
    rt.admit("g", T, {"sekv_method": "snapkv", "sekv_kv_bits": 4})
    prefill(rt, "g")
    mem = rt.compress("g")
    assert mem.status is Status.FULL_KV and "kv_quant_group: 32 does not divide the model's head size 16" in mem.reason
    with pytest.raises(SeKVConfigError, match="sekv_kv_bits needs sekv_method naming a method"):
        RequestOverrides.from_extra_args({"sekv_kv_bits": 4})
    with pytest.raises(SeKVConfigError, match="sekv_kv_bits needs sekv_method"):
        RequestOverrides.from_extra_args({"sekv_kv_bits": 4, "sekv_method": "sekv"})
    assert rt.admit("bad", T, {"sekv_kv_bits": 5, "sekv_method": "snapkv"}).status is Status.FULL_KV
    with pytest.raises(SeKVConfigError, match=r"sekv\.kv_bits: not a setting of method 'sekv'"):
        SeKVConfig.from_additional_config({"sekv": {"kv_bits": 4}})
    config = SeKVConfig(method="snapkv", kv_bits=4, kv_quant_group=64)
    with pytest.raises(SeKVConfigError, match="kv_quant_group: 64 does not divide the model's head size 48"):
        SeKVRuntime(config, LAYERS, ModelShape(num_layers=2, num_heads=6, num_kv_heads=2, head_dim=48))
    assert StreamingLLM().kv_quantization() is None


def test_quest_with_quantized_pages_reads_more_of_them_and_attends_them_as_their_codes_give_them_back():
    plain = quest_runtime(budget_ratio=0.125)
    assert plain.admit("r", T, None).reason.startswith("budget (38 rows) cannot hold quest's page bounds (18 rows)")
    rt = quest_runtime(budget_ratio=0.125, kv_bits=4, kv_quant_group=16)
    rt.admit("r", T, None)
    kv = quest_prefill(rt, "r")
    assert rt.compress("r").status is Status.COMPRESSED
    codec = KVQuantization(bits=4, group=16)
    full_row, row = 2 * HKV * D * 4, codec.row_bytes(HKV, D)
    paged, window = 288, 12
    per_step = ((38 - paged // PAGE) * full_row - window * row) // (PAGE * row)  # bounds at the KV dtype
    fig = rt.figures("r")
    assert fig["pages_per_step"] == per_step == 5 and fig["kv_bits"] == 4
    assert fig["fast_tier_bytes"] == (paged // PAGE * full_row + (window + per_step * PAGE) * row) * len(LAYERS)
    assert fig["fast_tier_fraction"] <= 0.125 and fig["host_pool_bytes"] == paged * row * len(LAYERS)
    q = torch.randn(1, H, D, generator=torch.Generator().manual_seed(2))
    k1, v1 = torch.randn(1, HKV, D), torch.randn(1, HKV, D)
    out = rt.attend_batch(["r"], "l1", q, 0.25, k1, v1)
    k, v = kv["l1"]
    kq, vq = codec.decode(codec.encode(torch.cat([k, k1]), torch.cat([v, v1])), HKV, D, torch.float32)
    lo, hi = page_bounds(k[:paged], PAGE)  # the bounds come from the keys as prefill computed them
    chosen = top_pages(page_scores(q[0], lo, hi, 0.25), per_step)
    k_read = gather_pages(kq[:paged].view(-1, PAGE, HKV, D), chosen)
    v_read = gather_pages(vq[:paged].view(-1, PAGE, HKV, D), chosen)
    ref = exact_attention(q[0], torch.cat([k_read, kq[paged:]]), torch.cat([v_read, vq[paged:]]), 0.25)
    assert torch.allclose(out[0], ref, atol=1e-5)


def test_quest_pages_out_quantized_output_as_the_window_kept_it():
    rt = quest_runtime(budget_ratio=0.25, window_growth=32, kv_bits=8, kv_quant_group=16)
    rt.admit("r", T, None)
    kv = quest_prefill(rt, "r")
    rt.compress("r")
    codec = KVQuantization(bits=8, group=16)
    g = torch.Generator().manual_seed(4)
    k_all, v_all, parts = generate(rt, *kv["l0"], 40, g)
    assert [(p.start, p.stop) for p in parts] == [(288, 320)]
    st = rt.get("r").method_state
    assert st.paged == 320 and rt.get("r").rows["l0"].length == 20
    kq, vq = codec.decode(codec.encode(k_all, v_all), HKV, D, torch.float32)  # quantized once, whatever moved
    q = torch.randn(1, H, D, generator=g)
    out = rt.attend_batch(["r"], "l0", q, 0.25)
    lo, hi = page_bounds(torch.cat([k_all[:288], kq[288:320]]), PAGE)  # the output's bounds from its kept rows
    chosen = top_pages(page_scores(q[0], lo, hi, 0.25), st.pages_per_step)
    k_read = gather_pages(kq[:320].view(-1, PAGE, HKV, D), chosen)
    v_read = gather_pages(vq[:320].view(-1, PAGE, HKV, D), chosen)
    ref = exact_attention(q[0], torch.cat([k_read, kq[320:]]), torch.cat([v_read, vq[320:]]), 0.25)
    assert torch.allclose(out[0], ref, atol=1e-5)
