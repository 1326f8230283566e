"""The C++ decode kernel against its torch reference (the runtime's torch path), request by request."""
import pytest
import torch

from sekv_vllm.config import SeKVConfig
from sekv_vllm.core.low_rank import fit_span_bases, rebuild_spans, rows_if_smaller
from sekv_vllm.ops.cpu_build import KernelBuildError
from sekv_vllm.ops.span_decode import load_span_decode
from sekv_vllm.router import ModelShape
from sekv_vllm.runtime import SeKVRuntime

SHAPE = ModelShape(num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64)
LAYERS = ["model.layers.0.attn", "model.layers.1.attn"]


def kernel_or_skip():
    try:
        return load_span_decode()
    except KernelBuildError as err:
        pytest.skip(f"C++ kernel not buildable here: {err}")


def _runtime(prompts: dict[str, int], shape: ModelShape = SHAPE, extra_args: dict[str, dict] | None = None,
             **cfg) -> SeKVRuntime:
    """Compressed requests of these prompt lengths (extra_args: a request's per-request settings); the exact
    fallback off unless cfg sets it (random queries spread their attention: it would read every row)."""
    cfg.setdefault("exact_fallback_coverage", 0.0)
    rt = SeKVRuntime(SeKVConfig(min_prompt_tokens=10, decode_kernel="torch", **cfg), LAYERS, shape,
                     "SmolLM2-135M-Instruct")
    Hkv, D = shape.num_kv_heads, shape.head_dim
    g = torch.Generator().manual_seed(11)
    for req, T in prompts.items():
        rt.admit(req, T, (extra_args or {}).get(req))
        rt.record_surprisal(req, torch.arange(1, T), torch.rand(T - 1, generator=g) * 6)
        # keys drifting between a few directions, like real keys: spans differ in what they hold
        directions = torch.randn(6, Hkv, D, generator=g) * 2
        for name in LAYERS:
            k = directions[(torch.arange(T) // 17) % 6] + torch.randn(T, Hkv, D, generator=g)
            rt.capture(req, name, 0, k, torch.randn(T, Hkv, D, generator=g))
        rt.compress(req)
        rt.capture(req, LAYERS[1], 0, torch.randn(1, Hkv, D, generator=g), torch.randn(1, Hkv, D, generator=g))
    return rt


CASES = {
    "router, 4 centroids, rows": dict(budget_ratio=0.25, score_centroids=4),
    "span_score, 4 centroids": dict(budget_ratio=0.25, zoom_policy="span_score", score_centroids=4),
    "span_score, summary key only": dict(budget_ratio=0.25, zoom_policy="span_score", score_centroids=0),
    # short spans: the budget holds fewer centroids per span, a different count for each request; a
    # quantization range shared by 4 spans; summaries in the KV dtype (float32; every other case: float16)
    "router, low-rank factors, centroids cut to each budget": dict(budget_ratio=0.12, r_max=8, max_span=16,
                                                                   score_range_spans=4, summary_dtype="kv"),
    "span_score, every key at 2 bits": dict(budget_ratio=0.25, zoom_policy="span_score", score_centroids=32,
                                            score_bits=2),
    "router, 4 centroids at 4 bits": dict(budget_ratio=0.25, score_centroids=4, score_bits=4),
    # the rows whole spans leave over go to single keys
    "router, every key at 2 bits, keys recalled": dict(budget_ratio=0.15, score_centroids=32),
    # at 10.5% "a" keeps 16 k-means centroids (no key recalled, even with a narrower window) beside "b", which
    # keeps every key with its window narrowed
    "router, 10.5%, keys recalled beside a request that cannot": dict(budget_ratio=0.105),
    "router, every key at 2 bits, whole spans only": dict(budget_ratio=0.15, score_centroids=32, recall_keys=False),
    # whole spans take at most half the zoom rows, single keys the rest
    "router, every key at 2 bits, half the zoom rows for keys": dict(budget_ratio=0.15, score_centroids=32,
                                                                    whole_span_share=0.5),
    # a span goes whole only where it holds a fifth of its request's span scores (per KV head)
    "router, every key at 2 bits, whole spans that stand out": dict(budget_ratio=0.15, score_centroids=32,
                                                                    whole_span_min_share=0.2),
    # recalled keys rebuilt from their spans' factors
    "span_score, low-rank factors, every key at 4 bits, keys recalled": dict(
        budget_ratio=0.25, zoom_policy="span_score", r_max=8, score_centroids=32, score_bits=4),
    "router, every key in float16, keys recalled": dict(budget_ratio=0.7, score_centroids=32, score_bits=16),
    # a KV head whose rows read hold less than 5% of a query head's estimated attention reads every row (random
    # queries spread their attention: 1% to 14% here)
    "router, every key at 2 bits, keys recalled, exact fallback": dict(budget_ratio=0.15, score_centroids=32,
                                                                      exact_fallback_coverage=0.05),
    # head_dim 32 and 4 query heads per KV head: the kernel's scalar paths (its vector paths take 64 and 128)
    "span_score, every key at 2 bits, head_dim 32": dict(
        budget_ratio=0.25, zoom_policy="span_score", score_centroids=32, score_bits=2,
        shape=ModelShape(num_layers=2, num_heads=8, num_kv_heads=2, head_dim=32)),
}


@pytest.mark.parametrize("case", CASES)
def test_kernel_matches_the_torch_path(case):
    kernel = kernel_or_skip()
    # c's budget covers every span: it is attended exactly, beside requests that choose
    prompts = {"a": 900, "b": 1300, "c": 200}
    rt = _runtime(prompts, **CASES[case])
    # each case decodes the scoring codes it names (the budget holds them)
    kept = [rt.requests[r].score_centroids for r in ("a", "b")]
    assert kept == [rt.config.score_centroids] * 2 if "score_centroids" in CASES[case] else 0 < kept[0] < kept[1] <= 32
    rt.requests["c"].zoom_all = True
    rt.sekv.spans.clear()
    shape = CASES[case].get("shape", SHAPE)
    q = torch.randn(3, shape.num_heads, shape.head_dim, generator=torch.Generator().manual_seed(4)) * 2
    ids = list(prompts)
    def zoomed() -> list[tuple[int, int]]:
        return [(rt.requests[r].zoomed_spans_total, rt.requests[r].recalled_keys_total,
                 rt.requests[r].exact_heads_total) for r in ids]

    for name in LAYERS:
        before = zoomed()
        ref = rt.attend_batch(ids, name, q, 0.125)
        mid = zoomed()
        rt.sekv.kernel = kernel
        out = rt.attend_batch(ids, name, q, 0.125)
        rt.sekv.kernel = None
        assert torch.allclose(out, ref, atol=2e-5, rtol=1e-4), (out - ref).abs().max()
        # as many spans zoomed, keys recalled and KV heads read exactly by each path
        assert [tuple(x - y for x, y in zip(m, b)) for m, b in zip(mid, before)] == \
            [tuple(x - y for x, y in zip(a, m)) for a, m in zip(zoomed(), mid)]
    assert rt.requests["b"].zoomed_spans_total > 0 and rt.requests["c"].zoomed_spans_total > 0
    # keys are recalled where every key is a scoring centroid and recall is on, never for a request that zooms all
    for r in ("a", "b"):
        recalls = rt.config.recall_keys and rt.requests[r].score_centroids >= rt.config.max_span
        assert (rt.requests[r].recalled_keys_total > 0) == recalls, r
    assert rt.requests["c"].recalled_keys_total == 0
    # the fallback reads some KV heads exactly, not all (the case's coverage splits them)
    heads = [rt.requests[r].exact_heads_total for r in ("a", "b")]
    if rt.config.exact_fallback_coverage > 0:
        assert 0 < sum(heads) < 2 * 2 * len(LAYERS) * (shape.num_kv_heads), heads
    else:
        assert heads == [0, 0]


def test_kernel_zooms_what_the_policy_would_and_refuses_bad_lists():
    kernel = kernel_or_skip()
    rt = _runtime({"a": 800}, budget_ratio=0.25)
    no_spans = {name: [] for name in ("summary_k", "summary_v", "span_len", "centroid_k", "log_count", "centroid_lo",
                                      "centroid_step", "centroid_range", "key_features", "coef_k", "basis_k", "coef_v", "basis_v",
                                      "row_offset")}
    common = {"new_k": torch.zeros(0), "new_v": torch.zeros(0), "query_features": torch.zeros(0, 0, 0),
              "bias": torch.zeros(9), "threshold": torch.zeros(9), "scale": 0.1, "score_scale": 0.1}
    with pytest.raises(RuntimeError, match="every per-request list"):
        kernel.span_decode(q=torch.zeros(2, 9, 64), row_pages=[], page_table=[], num_full=torch.zeros(2, dtype=torch.int64),
                           **no_spans, code_bits=0, budgets=torch.zeros(2, dtype=torch.int64),
                           whole_budgets=torch.zeros(2, dtype=torch.int64), min_shares=torch.zeros(2),
                           fallbacks=torch.zeros(2),
                           zoom_all=torch.zeros(2, dtype=torch.bool), recall_keys=True, **common)
    with pytest.raises(TypeError):  # named arguments only: 32 of them, several of one type
        kernel.span_decode(torch.zeros(2, 9, 64), [], [], torch.zeros(2, dtype=torch.int64), **no_spans, **common)
    rows = rt.requests["a"].rows[LAYERS[0]]
    m = rt.pool.load("a", LAYERS[0])
    args = dict(common, q=torch.zeros(1, 9, 64), row_pages=[rows.pages], page_table=[rows.table + rows.pages.shape[0]],
                num_full=torch.tensor([rows.length]), summary_k=[m.summary_k], summary_v=[m.summary_v],
                span_len=[m.span_len], centroid_k=[m.keys.codes.codes], log_count=[torch.zeros(0, dtype=torch.float16)],
                centroid_lo=[m.keys.codes.lo], centroid_step=[m.keys.codes.step],
                centroid_range=[m.keys.codes.range_of], code_bits=2, key_features=[],
                coef_k=[m.bases_k.coef], basis_k=[torch.zeros(0)], coef_v=[m.bases_v.coef], basis_v=[torch.zeros(0)],
                row_offset=[m.bases_k.row_offset], budgets=torch.tensor([4]), whole_budgets=torch.tensor([4]),
                min_shares=torch.zeros(1), fallbacks=torch.zeros(1), zoom_all=torch.tensor([False]),
                recall_keys=True)
    with pytest.raises(RuntimeError, match="page_table entries must be pages of row_pages"):
        kernel.span_decode(**args)
    args["page_table"] = [rows.table]
    args["num_full"] = torch.tensor([rows.capacity + 1])
    with pytest.raises(RuntimeError, match="num_full must be within the rows of page_table's pages"):
        kernel.span_decode(**args)
    args["num_full"] = torch.tensor([rows.length])
    codes = m.keys.codes
    with pytest.raises(RuntimeError, match="centroid_range out of"):
        kernel.span_decode(**dict(args, centroid_range=[codes.range_of + codes.lo.shape[0]]))
    too_few = dict(args, centroid_k=[codes.codes[..., :4].contiguous()])  # 4 centroids: counts can't be implied
    with pytest.raises(RuntimeError, match="log_count may be empty only"):
        kernel.span_decode(**too_few)
    assert rt.requests["a"].zoom_budget > 0


@pytest.mark.parametrize("path", ["cpp", "torch"])
def test_newest_rows_appended_by_the_decode_call_equal_captured_rows(path):
    """attend_batch(..., new_k, new_v) appends each request's newest row (the kernel in place) and attends
    it: the same output and windows as capturing the rows first."""
    kernel = kernel_or_skip() if path == "cpp" else None
    prompts = {"a": 900, "b": 1300}
    fused, captured = _runtime(prompts), _runtime(prompts)
    g = torch.Generator().manual_seed(5)
    ids = list(prompts)
    for rt in (fused, captured):
        rt.sekv.kernel = kernel
    fused.requests["a"].rows[LAYERS[0]].reserve(0)
    capacity = fused.requests["a"].rows[LAYERS[0]].capacity
    for _ in range(capacity - fused.requests["a"].rows[LAYERS[0]].length + 4):  # past its pages: they grow
        q = torch.randn(2, 9, 64, generator=g)
        k, v = torch.randn(2, 3, 64, generator=g), torch.randn(2, 3, 64, generator=g)
        for name in LAYERS:
            for i, r in enumerate(ids):
                captured.capture(r, name, 0, k[i : i + 1], v[i : i + 1])
            ref = captured.attend_batch(ids, name, q, 0.125)
            assert torch.equal(fused.attend_batch(ids, name, q, 0.125, k, v), ref)
    assert fused.requests["a"].rows[LAYERS[0]].capacity > capacity
    for r in ids:
        assert fused.requests[r].next_position == captured.requests[r].next_position
        for name in LAYERS:
            assert all(torch.equal(x, y) for x, y in zip(fused.requests[r].rows[name].view(),
                                                         captured.requests[r].rows[name].view()))


@pytest.mark.parametrize("path", ["cpp", "torch"])
def test_rows_in_scattered_engine_pages_decode_as_rows_in_own_pages(path, caplog):
    """Rows handed to the engine's pages (any page order, another page size, pages of other requests
    around them) and the newest rows the decode call writes there: the same outputs as own pages."""
    kernel = kernel_or_skip() if path == "cpp" else None
    prompts = {"a": 900, "b": 1300}
    paged, own = _runtime(prompts), _runtime(prompts)
    for rt in (paged, own):
        rt.sekv.kernel = kernel
    g = torch.Generator().manual_seed(6)
    cache = {name: torch.randn(64, 2, 16, 3, 64, generator=g) for name in LAYERS}  # an engine's pool of 64 pages
    free = torch.randperm(64, generator=g)
    for i, r in enumerate(prompts):
        n = paged.requests[r].rows[LAYERS[0]].length
        table = free[i * 20 : i * 20 + (n + 2) // 16 + 1]  # their rows and at least 3 spare rows, scattered
        assert paged.place_rows(r, cache, table)
        assert paged.rows_in_engine_pages(r) and paged.requests[r].rows[LAYERS[1]].pages is cache[LAYERS[1]]
    ids = list(prompts)
    with caplog.at_level("WARNING", logger="sekv_vllm"):
        for step in range(40):
            if step == 2:
                paged.add_pages("a", free[60:63])  # the engine hands more pages over; "b" gets none
            q = torch.randn(2, 9, 64, generator=g)
            k, v = torch.randn(2, 3, 64, generator=g), torch.randn(2, 3, 64, generator=g)
            for name in LAYERS:
                assert torch.equal(paged.attend_batch(ids, name, q, 0.125, k, v), own.attend_batch(ids, name, q, 0.125, k, v))
    assert paged.rows_in_engine_pages("a") and set(paged.requests["a"].rows[LAYERS[0]].table.tolist()) <= set(free.tolist())
    # "b" ran out of handed-over pages: its rows moved to sekv's own memory, said so, and went on
    assert not paged.rows_in_engine_pages("b") and "engine pages are full" in caplog.text
    for r in ids:
        for name in LAYERS:
            assert all(torch.equal(x, y) for x, y in zip(paged.requests[r].rows[name].view(), own.requests[r].rows[name].view()))
    assert not paged.place_rows("b", cache, free[:1])  # too few pages: refused, rows stay


def test_bases_are_kept_as_rows_when_factors_would_be_larger():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 3, 64, generator=g)
    start, length = torch.arange(0, 192, 24), torch.full((8,), 24)
    full_rank = fit_span_bases(x, start, length, r_max=32)  # r = 24 >= 24 * 64 / (24 + 64)
    rows = rows_if_smaller(full_rank)
    assert not rows.factored and rows.nbytes < full_rank.nbytes
    ids = torch.tensor([1, 5])
    assert torch.allclose(rebuild_spans(rows, ids)[0], rebuild_spans(full_rank, ids)[0], atol=1e-5)
    assert torch.allclose(rebuild_spans(rows, ids)[0], x[torch.cat([torch.arange(24, 48), torch.arange(120, 144)])], atol=1e-4)
    low_rank = fit_span_bases(x, start, length, r_max=4)
    assert rows_if_smaller(low_rank) is low_rank


def test_a_missing_kernel_is_an_error_when_required_and_a_logged_fallback_otherwise(monkeypatch, caplog):
    import sekv_vllm.runtime.span_runner as rm

    def unavailable():
        raise KernelBuildError("CalledProcessError: g++ not found")

    monkeypatch.setattr(rm, "load_span_decode", unavailable)
    with pytest.raises(RuntimeError, match="decode_kernel is 'cpp' but the C\\+\\+ kernel cannot be built here: .*g\\+\\+ not found"):
        SeKVRuntime(SeKVConfig(decode_kernel="cpp", zoom_policy="span_score"), LAYERS)
    with caplog.at_level("WARNING", logger="sekv_vllm"):
        rt = SeKVRuntime(SeKVConfig(zoom_policy="span_score"), LAYERS)
    assert rt.sekv.kernel is None and "decoding with the torch ops" in caplog.text
    with pytest.raises(ValueError, match="decode_kernel"):
        SeKVConfig(decode_kernel="cuda")


@pytest.mark.parametrize("path", ["torch", "cpp"])
def test_whole_spans_take_at_most_their_share_of_the_zoom_rows(path):
    # share 0: a request that recalls keys reads single keys only, as many as its zoom rows (per KV head)
    rt = _runtime({"a": 900, "b": 1300}, budget_ratio=0.15, score_centroids=32, whole_span_share=0.0)
    if path == "cpp":
        rt.sekv.kernel = kernel_or_skip()
    q = torch.randn(2, SHAPE.num_heads, SHAPE.head_dim, generator=torch.Generator().manual_seed(4)) * 2
    rt.attend_batch(["a", "b"], LAYERS[0], q, 0.125)
    for r in ("a", "b"):
        mem = rt.requests[r]
        assert mem.zoom_budget > 32 and mem.zoomed_spans_total == 0
        assert mem.recalled_keys_total == mem.zoom_budget * SHAPE.num_kv_heads


@pytest.mark.parametrize("path", ["torch", "cpp"])
def test_exact_fallback_attends_every_row_as_a_request_that_zooms_all(path):
    """A coverage no step reaches sends every KV head to every row: the output of a request that zooms every
    span (exact attention at full rank); a coverage every step reaches changes nothing."""
    kernel = kernel_or_skip() if path == "cpp" else None
    cfg = dict(budget_ratio=0.15, zoom_policy="span_score")
    always, never, plain, exact = (_runtime({"a": 900}, exact_fallback_coverage=f, **cfg) for f in (0.999999, 1e-9, 0.0, 0.0))
    exact.requests["a"].zoom_all = True
    q = torch.randn(1, SHAPE.num_heads, SHAPE.head_dim, generator=torch.Generator().manual_seed(8)) * 2
    for rt in (always, never, plain, exact):
        rt.sekv.kernel = kernel
    for name in LAYERS:
        ref = exact.attend_batch(["a"], name, q, 0.125)
        out = always.attend_batch(["a"], name, q, 0.125)
        assert torch.allclose(out, ref, atol=2e-5, rtol=1e-4), (out - ref).abs().max()
        assert torch.equal(never.attend_batch(["a"], name, q, 0.125), plain.attend_batch(["a"], name, q, 0.125))
    assert always.requests["a"].exact_heads_total == SHAPE.num_kv_heads * len(LAYERS)
    assert always.requests["a"].recalled_keys_total == 0
    assert never.requests["a"].exact_heads_total == 0 and never.requests["a"].recalled_keys_total > 0
    assert not torch.allclose(plain.attend_batch(["a"], LAYERS[0], q, 0.125), ref, atol=1e-3)


@pytest.mark.parametrize("path", ["torch", "cpp"])
def test_exact_fallback_per_request_overrides_the_deployments(path):
    """`sekv_exact_fallback_coverage` sets one request's coverage in a batch: a request asking for one no step
    reaches reads every row beside one that asks for none, whatever the deployment's."""
    kernel = kernel_or_skip() if path == "cpp" else None
    cfg = dict(budget_ratio=0.15, zoom_policy="span_score")
    prompts = {"a": 900, "b": 900}
    asked = _runtime(prompts, extra_args={"a": {"sekv_exact_fallback_coverage": 0.999999},
                                          "b": {"sekv_exact_fallback_coverage": 0.0}},
                     exact_fallback_coverage=0.5, **cfg)
    always = _runtime(prompts, exact_fallback_coverage=0.999999, **cfg)
    never = _runtime(prompts, **cfg)
    q = torch.randn(2, SHAPE.num_heads, SHAPE.head_dim, generator=torch.Generator().manual_seed(9)) * 2
    for rt in (asked, always, never):
        rt.sekv.kernel = kernel
    for name in LAYERS:
        out = asked.attend_batch(["a", "b"], name, q, 0.125)
        assert torch.allclose(out[0], always.attend_batch(["a", "b"], name, q, 0.125)[0], atol=1e-6, rtol=1e-5)
        assert torch.allclose(out[1], never.attend_batch(["a", "b"], name, q, 0.125)[1], atol=1e-6, rtol=1e-5)
    assert asked.requests["a"].exact_heads_total == SHAPE.num_kv_heads * len(LAYERS)
    assert asked.requests["b"].exact_heads_total == 0
