"""Runs one vLLM `LLM` in this process and prints a JSON result; tests call it in a subprocess
so that stock vLLM (plugins off) and sekv each get a clean process.

    python llm_job.py SPEC.json   ->  {"outputs": [...], "figures": [...], "errors": [...]}
SPEC: {"plugins": bool, "additional_config": {...} | null, "max_model_len": int,
       "max_num_batched_tokens": int | null (vLLM's prefill chunk),
       "requests": [{"prompt": str, "max_tokens": int, "extra_args": {...} | null,
                     "temperature": float (0), "seed": int | null}],
       "bad_requests": [{"prompt": str, "extra_args": {...}}]}
"""
import json
import os
import sys


def surprisal_check(bridge) -> dict:
    """Where the bridge took the prompt-token surprisal from, and the largest difference between the surprisal
    of the model's bfloat16 output projection and that of its own logits, on hidden states of the size of the
    final norm's (a wrong vocabulary slice or weight shows as nats, bfloat16 rounding as a few hundredths)."""
    import torch

    from sekv_vllm.core.surprisal import token_surprisal

    head = bridge.runner.logit_head(torch.bfloat16)
    if head is None:
        return {"source": bridge.surprisal_source, "max_abs_difference": None}
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(64, head.weight.shape[1], generator=g)
    targets = torch.randint(0, head.weight.shape[0], (64,), generator=g)
    exact = token_surprisal(bridge.runner.compute_logits(hidden), targets)
    diff = (head.surprisal(hidden, targets) - exact).abs().max().item()
    return {"source": bridge.surprisal_source, "max_abs_difference": diff, "mean_surprisal": exact.mean().item()}


def main() -> None:
    spec = json.load(open(sys.argv[1]))
    if not spec.get("plugins", True):
        os.environ["VLLM_PLUGINS"] = "none-stock-vllm"  # an allow-list naming no installed plugin
    for key, value in {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                       "VLLM_CPU_OMP_THREADS_BIND": "nobind", "HF_HUB_OFFLINE": "1"}.items():
        os.environ.setdefault(key, value)
    from vllm import LLM, SamplingParams

    kwargs = {"additional_config": spec["additional_config"]} if spec.get("additional_config") else {}
    if spec.get("max_num_batched_tokens"):
        kwargs["max_num_batched_tokens"] = spec["max_num_batched_tokens"]
    llm = LLM(spec["model"], dtype="float32", enforce_eager=True, max_model_len=spec.get("max_model_len", 4096),
              enable_prefix_caching=False, **kwargs)
    tok = llm.get_tokenizer()

    def chat(text: str) -> str:
        return tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)

    errors = []
    for bad in spec.get("bad_requests", []):
        try:
            llm.generate([chat(bad["prompt"])], SamplingParams(max_tokens=4, extra_args=bad["extra_args"]))
            errors.append(None)
        except Exception as err:  # vLLM raises VLLMValidationError
            errors.append(f"{type(err).__name__}: {err}")
    reqs = spec["requests"]
    params = [SamplingParams(temperature=r.get("temperature", 0.0), seed=r.get("seed"), max_tokens=r.get("max_tokens", 24),
                             extra_args=r.get("extra_args")) for r in reqs]
    outputs = llm.generate([chat(r["prompt"]) for r in reqs], params)
    figures, mixed_steps, surprisal = [], None, None
    if spec.get("plugins", True):
        from sekv_vllm.integration.vllm.runner_bridge import current_bridge, figures_by_request_id

        bridge = current_bridge()
        mixed_steps = bridge.steps_mixing_prefill_and_compressed_decode if bridge else None
        if bridge is not None:
            surprisal = surprisal_check(bridge)
        by_id = figures_by_request_id()
        figures = [by_id.get(o.request_id) for o in outputs]
    result = {
        "outputs": [{"text": o.outputs[0].text, "token_ids": list(o.outputs[0].token_ids),
                     "prompt_tokens": len(o.prompt_token_ids)} for o in outputs],
        "figures": figures,
        "errors": errors,
        "steps_mixing_prefill_and_compressed_decode": mixed_steps,
        "surprisal": surprisal,
    }
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
