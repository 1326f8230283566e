"""The places where sekv-vllm wraps vLLM 0.32 functions, kept together because they depend on
its internals. Each wrap is installed once per process and is a pass-through unless the
engine's additional_config carries `sekv` (or the CLI says `--kv-cache-backend sekv`).

1. `EngineArgs.add_cli_args`: adds `--kv-cache-backend {vllm,sekv}` and `--sekv-config JSON`.
2. `EngineArgs.from_cli_args`: turns those flags into `additional_config["sekv"]`.
3. `EngineArgs.create_engine_config`: validates the sekv settings once, at start-up, and
   applies what they imply (prefix caching off: compressed requests share no pages yet).
4. `GPUModelRunner.execute_model` (the CPU runner inherits it): the runner bridge's step hooks.
5. `GPUModelRunner.get_kv_cache_spec`: sekv's layers get SeKVAttentionSpec, whose manager
   returns a compressed request's prompt pages to the pool (kv_pages.py).
6. `Scheduler._preempt_request`: marks the request as preempted while its pages are freed.
7. `GPUModelRunner.sample_tokens` (active whenever the plugin is installed, sekv or not): seeded
   sampling with a chunked prompt on CPU. vLLM rewinds the seeded generator of a request whose
   sample it discards (a partial prefill chunk) by a Philox offset, which torch's CPU generator
   does not have: `RuntimeError: CPU Generator does not use offset` kills the engine. Such a
   row draws from the default generator instead, so the request's own stream advances only for
   the tokens it keeps, which is what the rewind is for.
"""
from __future__ import annotations

import argparse
import json
import logging

import numpy as np

from sekv_vllm.config import ADDITIONAL_CONFIG_KEY, SeKVConfig, SeKVConfigError

logger = logging.getLogger("sekv_vllm")

KV_CACHE_BACKENDS = ("vllm", "sekv")
_MARK = "_sekv_wrapped"


def _wrap(owner: type, name: str, make) -> None:
    """Replace owner.name by make(original function), keeping static/class method kinds."""
    raw = owner.__dict__[name]
    kind = type(raw) if isinstance(raw, (staticmethod, classmethod)) else None
    func = raw.__func__ if kind else raw
    if getattr(func, _MARK, False):
        return
    wrapped = make(func)
    setattr(wrapped, _MARK, True)
    setattr(owner, name, kind(wrapped) if kind else wrapped)


def _json_object(text: str) -> dict:
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


def _install_cli() -> None:
    from vllm.engine.arg_utils import EngineArgs

    def make_add_cli_args(original):
        def add_cli_args(parser, *args, **kwargs):
            parser = original(parser, *args, **kwargs)
            group = parser.add_argument_group("sekv", "KV-cache compression (sekv-vllm plugin)")
            group.add_argument(
                "--kv-cache-backend", choices=KV_CACHE_BACKENDS, default="vllm",
                help="sekv: compress long prompts' KV cache with SeKV; vllm: stock full KV.",
            )
            group.add_argument(
                "--sekv-config", type=_json_object, default=None,
                help='SeKV settings as JSON, e.g. \'{"budget_ratio": 0.25}\' (see sekv_vllm.config.SeKVConfig).',
            )
            return parser

        return add_cli_args

    def make_from_cli_args(original):
        def from_cli_args(cls, args: argparse.Namespace):
            engine_args = original(cls, args)
            backend = getattr(args, "kv_cache_backend", "vllm")
            engine_args.additional_config = apply_kv_cache_backend(
                engine_args.additional_config, backend, getattr(args, "sekv_config", None)
            )
            return engine_args

        return from_cli_args

    def make_create_engine_config(original):
        def create_engine_config(self, *args, **kwargs):
            config = SeKVConfig.from_additional_config(self.additional_config)
            if config is not None:
                from vllm.platforms import current_platform

                if not current_platform.is_cpu():
                    raise SeKVConfigError(
                        "kv_cache_backend: sekv runs on vLLM's CPU platform only so far; "
                        "the GPU attention path is not written yet"
                    )
                if self.speculative_config:
                    # Draft tokens would enter the compressed window before they are accepted.
                    raise SeKVConfigError("speculative_config: speculative decoding is not supported with sekv yet")
                if self.enable_prefix_caching is not False:
                    logger.info("sekv: prefix caching switched off (compressed requests do not share pages)")
                self.enable_prefix_caching = False
                # Normalised and validated: every process reads the same full settings.
                self.additional_config = {**self.additional_config, ADDITIONAL_CONFIG_KEY: config.model_dump()}
            vllm_config = original(self, *args, **kwargs)
            if config is not None:
                _check_kernel_dtype(config, vllm_config)
                _settle_policy(config, vllm_config)
            return vllm_config

        return create_engine_config

    _wrap(EngineArgs, "add_cli_args", make_add_cli_args)
    _wrap(EngineArgs, "from_cli_args", make_from_cli_args)
    _wrap(EngineArgs, "create_engine_config", make_create_engine_config)


def _check_kernel_dtype(config: SeKVConfig, vllm_config) -> None:
    """The C++ decode kernel reads float32 KV rows: `decode_kernel: cpp` with another KV dtype is
    refused at start-up (`auto` then decodes with the torch ops, and says so)."""
    import torch

    cache_dtype = vllm_config.cache_config.cache_dtype
    dtype = vllm_config.model_config.dtype if cache_dtype == "auto" else cache_dtype
    if config.decode_kernel == "cpp" and dtype not in (torch.float32, "float32", "fp32"):
        raise SeKVConfigError(f"sekv.decode_kernel: 'cpp' needs a float32 KV cache, this one is {dtype}; "
                              "allowed with it: 'auto' or 'torch'")


def _settle_policy(config: SeKVConfig, vllm_config) -> None:
    """Choose the zoom policy once (`auto`), log why, and refuse at start-up router weights that
    are missing or trained for another model shape; the workers get the policy and the file."""
    from pathlib import Path

    from sekv_vllm.policies import choose_policy
    from sekv_vllm.router import ModelShape, RouterWeightsError, check_router, resolve_weights

    mc = vllm_config.model_config
    policy, why = choose_policy(config.zoom_policy, config.router_weights, Path(mc.model).name)
    logger.info("sekv: zoom policy %s (%s)", policy, why)
    settings = {**config.model_dump(), "zoom_policy": policy}
    if policy != "router":
        vllm_config.additional_config = {**vllm_config.additional_config, ADDITIONAL_CONFIG_KEY: settings}
        return
    hf = mc.hf_text_config
    shape = ModelShape(hf.num_hidden_layers, hf.num_attention_heads, hf.num_key_value_heads, mc.get_head_size())
    try:
        path = resolve_weights(config.router_weights, Path(mc.model).name)
        check_router(path, shape)
    except RouterWeightsError as err:
        raise SeKVConfigError(f"sekv.{err}") from None
    settings["router_weights"] = str(path.resolve())
    vllm_config.additional_config = {**vllm_config.additional_config, ADDITIONAL_CONFIG_KEY: settings}


def _install_runner_hook() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from sekv_vllm.integration.vllm.runner_bridge import bridge_for

    def make_execute_model(original):
        def execute_model(self, scheduler_output, *args, **kwargs):
            bridge = bridge_for(self)
            if bridge is None:
                return original(self, scheduler_output, *args, **kwargs)
            bridge.before_step(scheduler_output)
            result = original(self, scheduler_output, *args, **kwargs)
            bridge.after_step(scheduler_output)
            return result

        return execute_model

    def make_get_kv_cache_spec(original):
        def get_kv_cache_spec(self, *args, **kwargs):
            specs = original(self, *args, **kwargs)
            if SeKVConfig.from_additional_config(self.vllm_config.additional_config) is None:
                return specs
            from sekv_vllm.integration.vllm.kv_pages import sekv_spec

            return {name: sekv_spec(spec, self.vllm_config) for name, spec in specs.items()}

        return get_kv_cache_spec

    def make_preempt_request(original):
        def _preempt_request(self, request, *args, **kwargs):
            from sekv_vllm.integration.vllm import kv_pages

            kv_pages.preempting.add(request.request_id)
            try:
                return original(self, request, *args, **kwargs)
            finally:
                kv_pages.preempting.discard(request.request_id)

        return _preempt_request

    def make_sample_tokens(original):
        def sample_tokens(self, *args, **kwargs):
            hidden = _hide_discarded_cpu_generators(self)
            try:
                return original(self, *args, **kwargs)
            finally:
                self.input_batch.generators.update(hidden)

        return sample_tokens

    _wrap(GPUModelRunner, "execute_model", make_execute_model)
    _wrap(GPUModelRunner, "sample_tokens", make_sample_tokens)
    _wrap(GPUModelRunner, "get_kv_cache_spec", make_get_kv_cache_spec)
    _wrap(Scheduler, "_preempt_request", make_preempt_request)


def _hide_discarded_cpu_generators(runner) -> dict:
    """Take the CPU generators of the rows whose samples this step discards (partial prefill chunks)
    out of the batch's generator map, which the sampler reads; returns them to be put back."""
    if runner.execute_model_state is None:
        return {}
    num_reqs = runner.input_batch.num_reqs
    generators = runner.input_batch.generators
    hidden = {}
    for i in np.nonzero(runner.discard_request_mask.np[:num_reqs])[0].tolist():
        generator = generators.get(i)
        if generator is not None and generator.device.type == "cpu":
            hidden[i] = generators.pop(i)
    return hidden


def install() -> None:
    _install_cli()
    _install_runner_hook()
