"""Compressed requests hand their prompt pages back to vLLM's block pool (kv_pages.py)."""
import math

import pytest

from sekv_vllm.methods import METHODS
from tests.integration.conftest import PAGES_JOB, run_job

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def essay_ids(tokenizer):
    from benchmarks.perf.run import essay_prompts

    return lambda n_tokens, count: essay_prompts(tokenizer, n_tokens, count)


def pages(spec: dict, tmp_path) -> dict:
    return run_job(spec, tmp_path, job=PAGES_JOB)


def test_page_count_drops_to_the_fast_tier_share_after_compression(model_dir, essay_ids, tmp_path):
    prompt = essay_ids(2000, 1)
    r = pages({"model": model_dir, "sekv": {"budget_ratio": 0.125}, "prompts": prompt, "max_tokens": 8,
               "max_model_len": 2200}, tmp_path)
    fig = r["figures"][0]
    bs, n = r["block_size"], fig["prompt_tokens"]
    block_bytes = fig["full_kv_bytes"] // n * bs
    keep = math.ceil(fig["fast_tier_bytes"] / block_bytes)
    tail = math.ceil(n / bs) - n // bs  # the last, partly filled prompt page
    held = [next(iter(t["held"].values())) for t in r["trace"] if t["held"]]
    # prefill, then the step that compresses the prompt (once its first token is out): every prompt page; the
    # manager frees the rest at its next allocation
    assert held[0] == held[1] == math.ceil(n / bs)
    after = held[2:]
    assert after and min(after) == keep + tail  # compressed: the fast tier's pages and the tail
    assert max(after) <= keep + math.ceil((n + 8) / bs) - n // bs  # generated tokens may open one more
    assert fig["vllm_pages_held_bytes"] == (keep + tail) * block_bytes
    assert fig["vllm_pages_returned_bytes"] == (math.ceil(n / bs) - keep - tail) * block_bytes
    # 12.5% budget + every span key at 2 bits + router features (~21% of full KV at 2K): most pages go back
    assert keep <= math.ceil(0.25 * (n // bs))
    assert r["free_at_end"] == r["free_at_start"]
    assert "returned" in r["stderr"] and "pages to vLLM's pool" in r["stderr"]
    # the fast tier's rows live in those kept pages (vLLM's KV cache), not beside them
    checks = [ok for t in r["trace"] for ok in t["rows_in_pages"].values()]
    assert checks and all(checks) and fig["rows_in_vllm_pages"]


def test_returned_pages_admit_more_requests_and_outputs_do_not_change(model_dir, essay_ids, tmp_path):
    prompts = essay_ids(2000, 6)
    spec = {"model": model_dir, "prompts": prompts, "max_tokens": 32, "max_model_len": 2200}
    pool = 36  # pages of 128 tokens: two 2K requests at full KV
    stock = pages({**spec, "sekv": None, "num_blocks": pool}, tmp_path)
    small = pages({**spec, "sekv": {"budget_ratio": 0.125}, "num_blocks": pool}, tmp_path)
    large = pages({**spec, "sekv": {"budget_ratio": 0.125}}, tmp_path)
    full_pages = math.ceil(2001 / stock["block_size"])
    stock_max = max(t["running_with_output"] for t in stock["trace"])
    sekv_max = max(t["running_with_output"] for t in small["trace"])
    assert stock_max * full_pages <= pool and stock_max <= 2
    assert sekv_max >= 4 and sekv_max * full_pages > pool  # freed pages were reused while they ran
    assert small["outputs"] == large["outputs"]  # reuse of returned pages changes nothing
    assert small["preemptions"] == 0 and small["free_at_end"] == small["free_at_start"]


def test_preemption_under_a_tiny_pool_gives_the_same_outputs(model_dir, essay_ids, tmp_path):
    # A compressed request preempted mid-output keeps its compressed state; its recompute decodes
    # only the newest row from it (the decode is batch-invariant: tests/test_runtime.py). With the
    # window spanified every 128 rows its page ranges are filed again when it resumes. (Preemption
    # without spanification: every row-keeping method, below, goes through the same suspend and resume.)
    # decode_room_tokens 0: vLLM's own admission, which lets their outputs outgrow the pool (the default keeps
    # room for them: below).
    growth = 128
    spec = {"model": model_dir, "sekv": {"budget_ratio": 0.25, "min_prompt_tokens": 256, "window_growth": growth,
                                         "decode_room_tokens": 0},
            "prompts": essay_ids(700, 3), "max_tokens": 400, "max_model_len": 1110}
    tiny = pages({**spec, "num_blocks": 10}, tmp_path)  # three compressed requests outgrow the pool
    roomy = pages(spec, tmp_path)
    assert tiny["preemptions"] >= 1 and roomy["preemptions"] == 0
    assert "is kept for its recompute" in tiny["stderr"]
    assert tiny["outputs"] == roomy["outputs"]
    assert tiny["runtime_requests_left"] == 0 and tiny["host_pool_used_bytes"] == 0
    # rows copied out of the pages freed by preemption, back into the new ones after the recompute
    checks = [ok for t in tiny["trace"] for ok in t["rows_in_pages"].values()]
    assert checks and all(checks)
    assert all(f["output_spans"] > 0 for f in tiny["figures"])


def test_room_kept_for_decoding_requests_queues_new_ones_instead_of_preempting(model_dir, essay_ids, tmp_path):
    # 14 pages, vLLM's admission (decode_room_tokens 0) preempts; sekv's gate (the default) lets a request wait
    # while the running ones' next tokens would not fit beside it: none preempted, none lost, outputs unchanged.
    spec = {"model": model_dir, "sekv": {"budget_ratio": 0.25, "min_prompt_tokens": 256, "window_growth": 128},
            "prompts": essay_ids(700, 3), "max_tokens": 400, "max_model_len": 1110, "num_blocks": 14}
    gated = pages(spec, tmp_path)
    ungated = pages({**spec, "sekv": {**spec["sekv"], "decode_room_tokens": 0}}, tmp_path)
    assert ungated["preemptions"] >= 1 and gated["preemptions"] == 0
    assert gated["outputs"] == ungated["outputs"] and all(len(o) == 400 for o in gated["outputs"])
    assert "kept for the" in gated["stderr"] and "decode_room_tokens" in gated["stderr"]
    # it ran fewer requests at once than the ungated engine, and more than one
    most = [max(t["running_with_output"] for t in r["trace"]) for r in (gated, ungated)]
    assert 1 < most[0] <= most[1]
    assert gated["free_at_end"] == gated["free_at_start"] and gated["runtime_requests_left"] == 0


def test_aborted_and_finished_requests_free_both_tiers(model_dir, essay_ids, tmp_path):
    prompts = essay_ids(700, 12)
    r = pages({"model": model_dir, "sekv": {"budget_ratio": 0.25, "min_prompt_tokens": 256}, "prompts": prompts,
               "max_tokens": 16, "max_model_len": 1000, "abort": {"after_step": 3, "indices": [0, 3, 6, 9, 10, 11]}},
              tmp_path)
    assert r["free_at_end"] == r["free_at_start"]  # every page back in the pool
    assert r["runtime_requests_left"] == 0 and r["host_pool_used_bytes"] == 0  # and every host-pool byte
    done = [o for i, o in enumerate(r["outputs"]) if i not in (0, 3, 6, 9, 10, 11)]
    assert all(o is not None and len(o) == 16 for o in done)
    assert len(r["figures"]) >= 6  # the finished ones were compressed and released with figures


def test_spanified_output_returns_its_pages_too(model_dir, essay_ids, tmp_path):
    # 700 output tokens: the window is spanified every 128 (its oldest rows compressed as the
    # prompt was); the pages wholly inside those rows go back but for their fast-tier share.
    spec = {"model": model_dir, "prompts": essay_ids(700, 2), "max_tokens": 700, "max_model_len": 1500}
    sekv = {"budget_ratio": 0.125, "min_prompt_tokens": 256}
    grown = pages({**spec, "sekv": {**sekv, "window_growth": 128}}, tmp_path)
    kept = pages({**spec, "sekv": {**sekv, "window_growth": 0}}, tmp_path)
    bs = grown["block_size"]
    for g, k in zip(sorted(grown["figures"], key=lambda f: f["req_id"]), sorted(kept["figures"], key=lambda f: f["req_id"])):
        assert k["output_spans"] == 0 and k["full_resolution_rows"] > 700
        assert g["output_spans"] >= 10 and g["output_span_tokens"] > 400
        assert g["output_mean_surprisal"] > 0  # the output's surprisal was recorded
        assert g["full_resolution_rows"] < k["full_resolution_rows"] - 300
        assert g["host_pool_bytes_now"] > g["host_pool_bytes"]  # the output's spans joined the host pool
        block_bytes = g["full_kv_bytes"] // g["prompt_tokens"] * bs
        extra = (g["vllm_pages_returned_bytes"] - k["vllm_pages_returned_bytes"]) // block_bytes
        assert extra >= 2
        # the pages each request held at its last step differ by exactly the pages its output returned
        last_g = [t["held"] for t in grown["trace"] if len(t["held"]) == 2][-1]
        last_k = [t["held"] for t in kept["trace"] if len(t["held"]) == 2][-1]
        assert last_k[k["req_id"]] - last_g[g["req_id"]] == extra
    assert all(o is not None and len(o) == 700 for o in grown["outputs"])
    assert grown["free_at_end"] == grown["free_at_start"] and grown["host_pool_used_bytes"] == 0


def test_every_method_returns_its_pages_survives_preemption_and_abort(model_dir, essay_ids, tmp_path):
    # Every registered method but SeKV (the deployment's for the first, `sekv_method` for the others, in one
    # engine) through prefill, compression, decode, pages handed back (as many held as its figures say),
    # preemption under a tiny pool (same outputs as with room); one more request aborted. StreamingLLM's
    # rows are quantized (4 bits), quest's window and pages too (8 bits): rows packed across the pages' bytes
    # go through the same path.
    methods = sorted(METHODS)
    n = len(methods) + 1
    chosen = [methods[i % len(methods)] for i in range(n)]
    bits = {"streaming_llm": {"sekv_kv_bits": 4}, "quest": {"sekv_kv_bits": 8}}
    spec = {"model": model_dir, "sekv": {"method": methods[0], "budget_ratio": 0.125, "min_prompt_tokens": 256,
                                         "decode_room_tokens": 0},
            "prompts": essay_ids(700, n), "extra_args": [{"sekv_method": m, **bits.get(m, {})} for m in chosen],
            "max_tokens": 300,
            "max_model_len": 1010, "abort": {"after_step": 3, "indices": [n - 1]}}
    # 10 pages of 128 tokens: three compressed requests run at once, their outputs outgrow the pool
    tiny, roomy = pages({**spec, "num_blocks": 11}, tmp_path), pages(spec, tmp_path)
    assert tiny["preemptions"] >= 1 and roomy["preemptions"] == 0
    assert tiny["outputs"][: n - 1] == roomy["outputs"][: n - 1] and all(len(o) == 300 for o in roomy["outputs"][: n - 1])
    for r in (tiny, roomy):
        assert r["free_at_end"] == r["free_at_start"] and r["runtime_requests_left"] == 0
    bs = roomy["block_size"]
    finished = {f["req_id"].split("-")[0]: f for f in roomy["figures"] if not f["req_id"].startswith(f"r{n - 1}-")}
    assert sorted(finished) == [f"r{i}" for i in range(n - 1)]  # the last was aborted
    for rid, fig in finished.items():
        n = fig["prompt_tokens"]
        block_bytes = fig["full_kv_bytes"] // n * bs
        held = [t["held"][fig["req_id"]] for t in roomy["trace"] if fig["req_id"] in t["held"]]
        kept_pages = math.ceil(fig["fast_tier_bytes"] / block_bytes) + math.ceil(n / bs) - n // bs
        assert fig["method"] == chosen[int(rid[1:])] and fig["fast_tier_fraction"] == pytest.approx(0.125, abs=0.01)
        if fig["method"] == "streaming_llm":  # 4-bit rows: the same bytes keep more than 3x the rows
            assert fig["kv_bits"] == 4 and fig["kept_prompt_rows"] > 3 * math.ceil(0.125 * n)
        if fig["method"] == "quest":  # 8-bit pages: the same bytes read more of them than 16-bit ones would
            assert fig["kv_bits"] == 8 and fig["pages_per_step"] * fig["page_size"] > 0.125 * n - fig["host_pages"]
        assert fig["vllm_pages_held_bytes"] == kept_pages * block_bytes and min(held) == kept_pages
        assert max(held) >= math.ceil(n / bs)
    checks = [ok for t in roomy["trace"] for ok in t["rows_in_pages"].values()]
    assert checks and all(checks)


def test_pages_to_come_counts_the_pages_a_request_still_opens():
    from sekv_vllm.integration.vllm.v0_32.admission import pages_to_come

    # 4K prompt in 32 pages of 128, 512 output tokens to come: 4 more pages, fewer within a shorter room
    assert pages_to_come(4000, 4512, 32, room_tokens=1024, block_size=128) == 4
    assert pages_to_come(4000, 4512, 32, room_tokens=96, block_size=128) == 0
    assert pages_to_come(4000, 4512, 32, room_tokens=97, block_size=128) == 1
    assert pages_to_come(4512, 4512, 36, room_tokens=1024, block_size=128) == 0  # at its max_tokens
    # a prompt mid-prefill (2 of its 8 pages allocated) still opens the rest of them
    assert pages_to_come(1000, 1010, 2, room_tokens=1024, block_size=128) == 6
