"""Runs one sekv engine with faults injected into sekv's work and into a model step; prints a JSON
result. Tests run it in a subprocess (the faults are monkeypatches of this process only).

    python fault_job.py SPEC.json  ->  {"rounds": [[{"text", "token_ids", "finish_reason"}, ...], ...], ...}
SPEC: {"model": str, "sekv": {...}, "rounds": [{"requests": [{"prompt": str, "max_tokens": int,
       "extra_args": {...} | null}], "faults": {"compress": i, "spanify_window": i, "attend_batch": i,
       "model_step": bool}}]}
A fault named by a runtime method raises in it for request i of the round (found by its prompt's
length: the round's prompts differ in length); `model_step` raises in the model's forward once,
at the round's first step.
"""
import json
import os
import sys


def main() -> None:
    spec = json.load(open(sys.argv[1]))
    for key, value in {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                       "VLLM_CPU_OMP_THREADS_BIND": "nobind", "HF_HUB_OFFLINE": "1"}.items():
        os.environ.setdefault(key, value)
    from vllm import LLM, SamplingParams

    from sekv_vllm.integration.vllm import request_failures
    from sekv_vllm.integration.vllm.runner_bridge import current_bridge
    from sekv_vllm.runtime import SeKVRuntime

    llm = LLM(spec["model"], dtype="float32", enforce_eager=True, max_model_len=4096, enable_prefix_caching=False,
              additional_config={"sekv": spec["sekv"]})
    core = llm.llm_engine.engine_core.engine_core
    pool = core.scheduler.kv_cache_manager.block_pool
    runner = core.model_executor.driver_worker.worker.model_runner
    free_at_start = pool.get_num_free_blocks()
    faults: dict = {}

    def faulty(name):
        original = getattr(SeKVRuntime, name)

        def method(self, req_id, *args, **kwargs):
            ids = req_id if isinstance(req_id, list) else [req_id]
            if any(self.requests[r].prompt_len == faults.get(name) for r in ids if r in self.requests):
                raise RuntimeError(f"injected fault in {name}")
            return original(self, req_id, *args, **kwargs)

        setattr(SeKVRuntime, name, method)

    for name in ("compress", "spanify_window", "attend_batch"):
        faulty(name)
    model_forward = runner.model.forward

    def forward(*args, **kwargs):
        if faults.pop("model_step", False):
            raise RuntimeError("injected fault in the model's forward")
        return model_forward(*args, **kwargs)

    runner.model.forward = forward
    tok = llm.get_tokenizer()
    rounds = []
    for round_ in spec["rounds"]:
        reqs = round_["requests"]
        prompts = [tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], tokenize=False,
                                           add_generation_prompt=True) for r in reqs]
        faults.clear()
        faults.update({name: len(tok.encode(prompts[i])) if name != "model_step" else i
                       for name, i in round_.get("faults", {}).items()})
        params = [SamplingParams(temperature=0.0, max_tokens=r.get("max_tokens", 24), extra_args=r.get("extra_args"))
                  for r in reqs]
        outputs = llm.generate(prompts, params)
        rounds.append([{"text": o.outputs[0].text, "token_ids": list(o.outputs[0].token_ids),
                        "finish_reason": o.outputs[0].finish_reason, "prompt_tokens": len(o.prompt_token_ids)}
                       for o in outputs])
    runtime = current_bridge().runtime
    print("RESULT " + json.dumps({
        "rounds": rounds,
        "failed_total": request_failures.failed_total,
        "pages_not_returned": free_at_start - pool.get_num_free_blocks(),
        "runtime_requests_left": len(runtime.requests),
        "host_pool_used_bytes": runtime.pool.used_bytes,
    }))


if __name__ == "__main__":
    main()
