"""Do the in-engine row-keeping methods (SnapKV, StreamingLLM, TOVA) keep the rows kvpress's presses keep?

    python -m benchmarks.peers.kvpress_agreement          # 4 of the suite's prompts (1K-2K), budgets 0.25 and 0.5

The prompts are the suite's (needle, multi-key needle, variable tracking; chat template, the question inside the
compressed part, as the engine compresses the whole prompt). In the kvpress environment the
default model prefills each prompt in HF transformers under kvpress's press; at every layer, the
press's own `score` and top-k give kvpress's kept positions per KV head, and sekv's method
(`sekv_vllm.methods`, plain torch) gets the same layer's post-RoPE keys and the window's queries
and returns its own. Reported per method and budget: the share of kept positions the two have in
common (1.0: identical), over every prompt, layer and KV head. kvpress keeps int(budget * T) rows
(sekv ceil(budget * T)); the check compares at kvpress's count.
Results: benchmarks/results/kvpress_agreement_cpu.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("SEKV_KVPRESS_VENV", REPO / ".venv-kvpress"))
# (task, prompt tokens, seed)
PROMPTS = (("needle", 1000, 0), ("needle", 2000, 1), ("niah_multikey", 1000, 2), ("vt", 2000, 3))
# sekv method -> (kvpress press, its settings as sekv names them -> kvpress's names)
PRESSES = {"snapkv": ("SnapKVPress", {"observation_window": "window_size", "pooling_kernel": "kernel_size"}),
           "streaming_llm": ("StreamingLLMPress", {"sink_tokens": "n_sink"}),
           "tova": ("TOVAPress", {})}


def _layer_kept(press, method, module, hidden_states, keys, kwargs, budget: float):
    """(kvpress's, sekv's) kept positions of one layer: [Hkv, n] each, sorted."""
    import torch
    from kvpress.utils import compute_n_kept, get_prerope_query_states
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from sekv_vllm.methods import PromptRows

    T = keys.shape[2]
    n = compute_n_kept(T, 1.0 - budget)
    theirs = press.score(module, hidden_states, keys, keys, None, kwargs)[0].topk(n, dim=-1).indices.sort(-1).values
    W = method.query_window
    queries = keys.new_zeros(0, 1, keys.shape[-1])
    if W:
        q = get_prerope_query_states(module, hidden_states[:, -W:])
        cos, sin = kwargs["position_embeddings"]
        q, _ = apply_rotary_pos_emb(q, q, cos[:, -W:], sin[:, -W:])
        queries = q[0].transpose(0, 1)  # [W, H, D]
    k = keys[0].transpose(0, 1)  # [T, Hkv, D]
    ours = method.keep(PromptRows(k, k, queries), n)
    return theirs, ours


def worker(spec: dict) -> None:
    """In the kvpress environment: spec {model, prompts: [token ids], budgets, methods} -> JSON on stdout."""
    import kvpress
    import torch
    from transformers import AutoModelForCausalLM

    from sekv_vllm.methods import ROW_METHODS

    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32).eval()
    results = []
    for name in spec["methods"]:
        press_name, names = PRESSES[name]
        method = ROW_METHODS[name]()
        settings = {theirs: getattr(method, ours) for ours, theirs in names.items()}
        for budget in spec["budgets"]:
            press = getattr(kvpress, press_name)(compression_ratio=1.0 - budget, **settings)
            shares, identical = [], 0
            hook = press.compress

            def compare(module, hidden_states, keys, values, attentions, kwargs, budget=budget, press=press):
                theirs, ours = _layer_kept(press, method, module, hidden_states, keys, kwargs, budget)
                nonlocal identical
                for h in range(theirs.shape[0]):
                    common = len(set(theirs[h].tolist()) & set(ours[h].tolist()))
                    shares.append(common / theirs.shape[1])
                    identical += common == theirs.shape[1]
                return hook(module, hidden_states, keys, values, attentions, kwargs)

            press.compress = compare
            for ids in spec["prompts"]:
                with torch.inference_mode(), press(model):
                    model.model(input_ids=torch.tensor([ids]))
            results.append({"method": name, "press": press_name, "settings": settings, "budget": budget,
                            "layer_heads": len(shares), "identical_layer_heads": identical,
                            "mean_common_share": sum(shares) / len(shares), "min_common_share": min(shares)})
    print(json.dumps(results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budgets", default="0.25,0.5")
    parser.add_argument("--out", default=str(REPO / "benchmarks/results/kvpress_agreement_cpu.json"))
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from sekv_vllm.entrypoints.default_model import default_model_dir
    from sekv_vllm.tasks.ruler import make_sample, split_after_question, token_counter

    model = str(default_model_dir())
    tok = AutoTokenizer.from_pretrained(model)
    prompts = []
    for task, tokens, seed in PROMPTS:
        compressed, _ = split_after_question(make_sample(task, tokens, 0.5, seed, token_counter(tok)), tok)
        prompts.append(tok(compressed, add_special_tokens=False).input_ids)
    spec = {"model": model, "prompts": prompts, "budgets": [float(b) for b in args.budgets.split(",")],
            "methods": sorted(PRESSES)}
    subprocess.run(["bash", str(REPO / "scripts" / "setup_kvpress.sh")], check=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "PYTHONPATH": str(REPO)}
    with tempfile.NamedTemporaryFile("w", suffix=".json") as spec_file:
        json.dump(spec, spec_file)
        spec_file.flush()
        out = subprocess.run([str(VENV / "bin" / "python"), "-m", "benchmarks.peers.kvpress_agreement", spec_file.name],
                             cwd=REPO, env=env, check=True, capture_output=True, text=True).stdout
    results = json.loads(out.strip().splitlines()[-1])
    report = {"command": "python -m benchmarks.peers.kvpress_agreement", "prompts": [list(p) for p in PROMPTS],
              "results": results}
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    for r in results:
        print(f"{r['method']:14s} budget {r['budget']:.2f}: {r['identical_layer_heads']}/{r['layer_heads']} layer-heads "
              f"identical, mean common share {r['mean_common_share']:.4f}, min {r['min_common_share']:.4f}")


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1].endswith(".json"):
        worker(json.loads(Path(sys.argv[1]).read_text()))
    else:
        main()
