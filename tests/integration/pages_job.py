"""Steps one vLLM engine by hand and reports what its block pool did; tests run it in a subprocess.

    python pages_job.py SPEC.json  ->  RESULT {"outputs": [...], "trace": [...], ...}
SPEC: {"model": str, "sekv": {...} | null (stock vLLM, plugins off), "num_blocks": int | null,
       "prompts": [[token ids]], "extra_args": [per-prompt SamplingParams.extra_args] | null, "max_tokens": int,
       "abort": {"after_step": int, "indices": [int]}}

Per step the trace records, per live request, the pages it holds (null pages excluded),
whether it is running with output, and (sekv) whether each compressed request's rows are inside
pages it holds in vLLM's KV cache; the result adds the pool's free pages at start and end,
preemptions, block ids held after compression, and what sekv's runtime still holds at the end.
"""
import json
import os
import sys


def rows_in_pages(manager) -> dict[str, bool]:
    """Per compressed request whose rows sekv keeps in vLLM's pages: whether every page they use is one the
    request holds (not null) and the rows are in vLLM's KV cache memory of every layer."""
    from sekv_vllm.integration.vllm.runner_bridge import current_bridge

    bridge = current_bridge()
    if bridge is None:
        return {}
    out = {}
    for req_id in bridge.runtime.requests:
        if not bridge.runtime.rows_in_engine_pages(req_id):
            continue
        mem = bridge.runtime.get(req_id)
        held = {b.block_id for b in manager.req_to_blocks.get(req_id, []) if b is not manager._null_block}
        ok = True
        for name, layer in bridge.layers.items():
            rows = mem.rows[name]
            used = rows.pages_used.tolist()
            ok &= set(used) <= held and rows.pages.data_ptr() == layer.kv_cache.data_ptr()
        out[req_id] = ok
    return out


def main() -> None:
    spec = json.load(open(sys.argv[1]))
    if spec.get("sekv") is None:
        os.environ["VLLM_PLUGINS"] = "none-stock-vllm"
    for key, value in {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                       "VLLM_CPU_OMP_THREADS_BIND": "nobind", "HF_HUB_OFFLINE": "1"}.items():
        os.environ.setdefault(key, value)
    from vllm import LLM, SamplingParams

    kwargs = {"additional_config": {"sekv": spec["sekv"]}} if spec.get("sekv") is not None else {}
    if spec.get("num_blocks"):
        kwargs["num_gpu_blocks_override"] = spec["num_blocks"]
    llm = LLM(spec["model"], dtype="float32", enforce_eager=True, max_model_len=spec.get("max_model_len", 4600),
              enable_prefix_caching=False, **kwargs)
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    pool = scheduler.kv_cache_manager.block_pool
    manager = scheduler.kv_cache_manager.coordinator.single_type_managers[0]
    preemptions = []
    original_preempt = scheduler._preempt_request

    def count_preempt(request, *args, **kwargs):
        preemptions.append(request.request_id)
        return original_preempt(request, *args, **kwargs)

    scheduler._preempt_request = count_preempt
    free_at_start = pool.get_num_free_blocks()
    ids = [f"r{i}" for i in range(len(spec["prompts"]))]
    extra_args = spec.get("extra_args") or [None] * len(ids)
    for rid, prompt, extra in zip(ids, spec["prompts"], extra_args):
        params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True, extra_args=extra)
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    abort = spec.get("abort") or {}
    outputs: dict[str, list[int]] = {}
    trace, block_ids_seen = [], {}
    step = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = list(out.outputs[0].token_ids)
        step += 1
        if abort and step == abort["after_step"]:
            engine.abort_request([ids[i] for i in abort["indices"]])
        held = {}
        for engine_id, blocks in manager.req_to_blocks.items():
            live = [b.block_id for b in blocks if b is not manager._null_block]
            held[engine_id] = len(live)
            block_ids_seen.setdefault(engine_id, set()).update(live)
        running = [r.request_id for r in scheduler.running if r.num_output_tokens > 0]
        trace.append({"held": held, "running_with_output": len(running), "free": pool.get_num_free_blocks(),
                      "rows_in_pages": rows_in_pages(manager) if spec.get("sekv") is not None else {}})
    result = {
        "outputs": [outputs.get(rid) for rid in ids],
        "trace": trace,
        "free_at_start": free_at_start,
        "free_at_end": pool.get_num_free_blocks(),
        "block_size": manager.block_size,
        "preemptions": len(preemptions),
        "block_ids": {k: sorted(v) for k, v in block_ids_seen.items()},
    }
    if spec.get("sekv") is not None:
        from sekv_vllm.integration.vllm.runner_bridge import current_bridge, request_figures

        runtime = current_bridge().runtime
        result["figures"] = request_figures()
        result["runtime_requests_left"] = len(runtime.requests)
        result["host_pool_used_bytes"] = runtime.pool.used_bytes
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
