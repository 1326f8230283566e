"""sekv inside vLLM's offline LLM on the default model, against stock vLLM."""
import pytest
import torch

from sekv_vllm.methods import METHODS
from sekv_vllm.tasks.haystack import sentences
from sekv_vllm.tasks.ruler import make_sample, score
from tests.integration.conftest import run_job

pytestmark = pytest.mark.vllm

# At budget_ratio 1.0 every span is zoomed; with r_max >= max_span the bases are lossless,
# so the whole SeKV path (capture, segmentation, summaries, SVD, rebuild, mixed softmax, and the
# window's spanification every 8 output tokens) must reproduce full attention.
LOSSLESS = {"budget_ratio": 1.0, "r_max": 64, "max_span": 64, "min_prompt_tokens": 256, "window": 64,
            "window_growth": 8}


def essay_prompt(n_sentences: int, start: int) -> str:
    text = " ".join(sentences()[start : start + n_sentences])
    return f"{text}\n\nSummarize the text above in one sentence."


@pytest.fixture(scope="module")
def equality_prompts(count_tokens):
    return [
        "What is the capital of France?",
        essay_prompt(30, 100),
        make_sample("needle", 1000, 0.5, 1, count_tokens).prompt,
        make_sample("passkey", 1500, 0.2, 2, count_tokens).prompt,
    ]


@pytest.fixture(scope="module")
def stock_run(model_dir, equality_prompts, tmp_path_factory):
    requests = [{"prompt": p, "max_tokens": 24} for p in equality_prompts]
    return requests, run_job({"model": model_dir, "plugins": False, "requests": requests}, tmp_path_factory.mktemp("stock"))


def test_full_budget_equals_stock_vllm_token_for_token(model_dir, stock_run, tmp_path):
    requests, stock = stock_run
    sekv = run_job({"model": model_dir, "additional_config": {"sekv": LOSSLESS}, "requests": requests}, tmp_path)
    assert "sekv" not in stock["stderr"]  # the reference really ran without the plugin
    for i, (a, b) in enumerate(zip(stock["outputs"], sekv["outputs"])):
        assert a["token_ids"] == b["token_ids"], f"prompt {i}: stock {a['text']!r} vs sekv {b['text']!r}"
    assert sekv["figures"][0] is None  # 1 short prompt: full KV
    for fig in sekv["figures"][1:]:
        assert fig is not None and fig["spans"] > 0 and fig["decode_steps"] > 0
    assert sum(fig["output_spans"] for fig in sekv["figures"][1:]) > 0  # the window was spanified


def test_every_method_at_full_budget_equals_stock_vllm_token_for_token(model_dir, stock_run, tmp_path):
    # One engine: every registered method but SeKV (the deployment's, then the others per request), each keeping
    # or reading every prompt row (budget 1.0): their capture, kept rows or pages, decode over them and output
    # rows must be exact.
    requests, stock = stock_run
    methods = sorted(METHODS)
    chosen = [{**r, "extra_args": {"sekv_method": m}} for m in methods for r in requests]
    run = run_job({"model": model_dir, "requests": chosen,
                   "additional_config": {"sekv": {"method": methods[0], "budget_ratio": 1.0, "min_prompt_tokens": 256}},
                   "bad_requests": [{"prompt": "hi", "extra_args": {"sekv_method": "pyramidkv"}}]}, tmp_path)
    for i, out in enumerate(run["outputs"]):
        ref = stock["outputs"][i % len(requests)]
        assert out["token_ids"] == ref["token_ids"], f"{chosen[i]['extra_args']} prompt {i}: {ref['text']!r} vs {out['text']!r}"
    figures = run["figures"]
    assert [f and f["method"] for f in figures] == [m if i else None for m in methods for i in range(len(requests))]  # the first is short
    assert all(f["fast_tier_fraction"] == 1.0 and f["decode_steps"] > 0 for f in figures if f)
    assert "sekv_method" in run["errors"][0] and "'sekv', 'streaming_llm', 'snapkv', 'tova', 'h2o' or 'quest'" in run["errors"][0]


def test_a_prompt_is_compressed_after_its_first_token(model_dir, stock_run, tmp_path):
    # Compression runs at the step after the prompt's last forward pass: the first token is sampled from exact rows
    # (stock's, at any budget), a request that ends with it is never compressed, and one that goes on is.
    requests, stock = stock_run
    long = requests[1:]  # the first prompt is short: full KV
    chosen = [{**r, "max_tokens": 1} for r in long] + [{**r, "max_tokens": 3} for r in long]
    # (with the surprisal's tail sampled: the setting's path through the engine)
    config = {"budget_ratio": 0.0625, "min_prompt_tokens": 256, "surprisal_exact_tokens": 8192}
    run = run_job({"model": model_dir, "additional_config": {"sekv": config}, "requests": chosen}, tmp_path)
    for i, out in enumerate(run["outputs"]):
        assert out["token_ids"][0] == stock["outputs"][1 + i % len(long)]["token_ids"][0], f"request {i}"
    assert run["figures"][: len(long)] == [None] * len(long)
    assert all(f is not None and f["spans"] > 0 and f["decode_steps"] > 0 for f in run["figures"][len(long) :])
    assert run["surprisal"]["source"].endswith(", tail sampled")


def test_full_host_pool_degrades_to_full_kv_and_says_so(model_dir, stock_run, tmp_path):
    requests, stock = stock_run
    sekv = run_job({"model": model_dir, "additional_config": {"sekv": {"host_pool_bytes": 1000, "min_prompt_tokens": 256}},
                    "requests": requests}, tmp_path)
    assert [o["token_ids"] for o in sekv["outputs"]] == [o["token_ids"] for o in stock["outputs"]]
    assert all(f is None for f in sekv["figures"])  # nothing compressed, nothing lost
    assert "host pool full" in sekv["stderr"] and "keeps full KV" in sekv["stderr"]


@pytest.fixture(scope="module")
def compressed_run(model_dir, count_tokens, tmp_path_factory):
    """One sekv engine at its default 25% budget: needles, a mixed batch, per-request overrides."""
    needles = [make_sample("needle", 2000, d, 10 + i, count_tokens) for i, d in enumerate((0.2, 0.5, 0.8))]
    requests = [{"prompt": s.prompt, "max_tokens": 24} for s in needles]
    requests += [
        {"prompt": "Name three primary colors.", "max_tokens": 24},  # short: full KV
        {"prompt": needles[0].prompt, "max_tokens": 24, "extra_args": {"sekv_compress": False}},
        {"prompt": needles[1].prompt, "max_tokens": 24, "extra_args": {"sekv_budget_ratio": 0.5}},
        {"prompt": essay_prompt(60, 400), "max_tokens": 24},
    ]
    bad = [
        {"prompt": "hi", "extra_args": {"sekv_budget_ratio": 3}},
        {"prompt": "hi", "extra_args": {"sekv_budgett": 10}},
    ]
    spec = {"model": model_dir, "additional_config": {"sekv": {}}, "requests": requests, "bad_requests": bad}
    return needles, run_job(spec, tmp_path_factory.mktemp("sekv"))


def test_needle_in_2k_haystack_found_at_quarter_budget(compressed_run):
    needles, result = compressed_run
    found = []
    for sample, out, fig in zip(needles, result["outputs"], result["figures"]):
        assert fig is not None and fig["budget_rows"] <= 0.25 * fig["prompt_tokens"] + 1
        # a budget bounds every fast-tier byte: rows, summaries, every span key at 2 bits, router features
        assert 0.2 < fig["fast_tier_fraction"] <= fig["budget_rows"] / fig["prompt_tokens"]
        found.append(score(sample.answers, out["text"]))
    # Measured: the default policy (the shipped router) finds all 3, the untrained score 1 to 2;
    # this guards that level. benchmarks/ has the full picture.
    assert sum(found) >= 2, [o["text"] for o in result["outputs"][:3]]


def test_mixed_batch_completes_with_per_request_settings(compressed_run):
    needles, result = compressed_run
    outs, figs = result["outputs"], result["figures"]
    assert all(o["token_ids"] for o in outs)
    assert figs[3] is None  # short prompt
    assert figs[4] is None  # sekv_compress false
    assert score(needles[0].answers, outs[4]["text"]) == 1.0
    assert figs[5]["budget_rows"] == -(-figs[5]["prompt_tokens"] // 2)  # sekv_budget_ratio 0.5
    assert figs[6] is not None and figs[6]["spans"] > 0
    assert result["steps_mixing_prefill_and_compressed_decode"] > 0  # continuous batching really mixed them


def test_prompt_surprisal_from_the_bfloat16_projection_matches_the_models_logits(compressed_run):
    _, result = compressed_run
    check = result["surprisal"]
    fast = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    # surprisal_precision "auto": the bfloat16 copy where the CPU has bfloat16 dot products
    assert check["source"] == ("bfloat16" if fast else "model")
    # the copy is the model's projection (vocabulary rows, no padding): bfloat16 rounding only; a wrong slice
    # or weight would be off by nats (the surprisal of random targets is ~11 nats here)
    assert check["max_abs_difference"] < 0.3, check
    assert check["mean_surprisal"] > 5


def test_bad_per_request_setting_is_refused_naming_the_field(compressed_run):
    _, result = compressed_run
    ratio_err, unknown_err = result["errors"]
    assert ratio_err and "sekv_budget_ratio" in ratio_err and "less than or equal to 1" in ratio_err
    assert unknown_err and "sekv_budgett" in unknown_err and "sekv_token_budget" in unknown_err
