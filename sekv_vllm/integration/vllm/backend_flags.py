"""`--kv-cache-backend` and `--sekv-config`: what they mean for an engine's additional_config (no vLLM
import; the version's shims add the flags to vLLM's parser)."""
from __future__ import annotations

import argparse
import json

from sekv_vllm.config import ADDITIONAL_CONFIG_KEY, SeKVConfigError

KV_CACHE_BACKENDS = ("vllm", "sekv")


def json_object(text: str) -> dict:
    """The value of `--sekv-config`: a JSON object, else an argparse error saying what is wrong."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"--sekv-config is not valid JSON: {err}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("--sekv-config must be a JSON object of sekv settings")
    return value


def apply_kv_cache_backend(additional_config: dict | None, backend: str, sekv_settings: dict | None) -> dict:
    """additional_config with the `sekv` entry that `--kv-cache-backend`/`--sekv-config` ask for."""
    config = dict(additional_config or {})
    if backend not in KV_CACHE_BACKENDS:
        raise SeKVConfigError(f"kv_cache_backend: {backend!r} is not one of {list(KV_CACHE_BACKENDS)}")
    if backend == "sekv":
        config[ADDITIONAL_CONFIG_KEY] = {**(config.get(ADDITIONAL_CONFIG_KEY) or {}), **(sekv_settings or {})}
    elif sekv_settings is not None:
        raise SeKVConfigError("--sekv-config needs --kv-cache-backend sekv")
    return config
