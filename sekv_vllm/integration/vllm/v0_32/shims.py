"""The places where sekv-vllm wraps vLLM 0.32 functions, kept together because they depend on
its internals. Each wrap is installed once per process and is a pass-through unless the
engine's additional_config carries `sekv` (or the CLI says `--kv-cache-backend sekv`).

1. `EngineArgs.add_cli_args`: adds `--kv-cache-backend {vllm,sekv}` and `--sekv-config JSON`.
2. `EngineArgs.from_cli_args`: turns those flags into `additional_config["sekv"]`.
3. `EngineArgs.create_engine_config`: validates the sekv settings once, at start-up, and
   applies what they imply (prefix caching off: compressed requests share no pages yet).
4. `GPUModelRunner.execute_model` (the CPU runner inherits it): the runner bridge's step hooks,
   and the step guard: an exception in a step fails the requests of that step (their cause
   filed in request_failures.py) instead of the engine; `sample_tokens` is guarded the same way.
5. `GPUModelRunner.get_kv_cache_spec`: sekv's layers get SeKVAttentionSpec, whose manager
   returns a compressed request's prompt pages to the pool (kv_pages.py).
6. `Scheduler._preempt_request`: marks the request as preempted while its pages are freed.
   `Scheduler.schedule`: keeps room in the pool for the running requests' next tokens before a new
   request is admitted (admission.py).
7. `GPUModelRunner.sample_tokens` (active whenever the plugin is installed, sekv or not): seeded
   sampling with a chunked prompt on CPU. vLLM rewinds the seeded generator of a request whose
   sample it discards (a partial prefill chunk) by a Philox offset, which torch's CPU generator
   does not have: `RuntimeError: CPU Generator does not use offset` kills the engine. Such a
   row draws from the default generator instead, so the request's own stream advances only for
   the tokens it keeps, which is what the rewind is for.
8. `Scheduler.update_from_output`: finishes the requests filed as failed with an error, before
   their output of the step is read (their pages are freed as for any finished request).
9. `OutputProcessor.process_outputs` and `GenerateBaseServing._raise_if_error` (front end): the HTTP 500
   of a failed request names its cause.
"""
from __future__ import annotations

import argparse
import logging

import numpy as np

from sekv_vllm.config import ADDITIONAL_CONFIG_KEY, SeKVConfig, SeKVConfigError
from sekv_vllm.methods import SEKV
from sekv_vllm.integration.vllm import request_failures
from sekv_vllm.integration.vllm.backend_flags import KV_CACHE_BACKENDS, apply_kv_cache_backend, json_object
from sekv_vllm.integration.vllm.v0_32.runner_view import RunnerView, StepSchedule

logger = logging.getLogger("sekv_vllm")

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
                "--sekv-config", type=json_object, default=None,
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
                _check_one_worker(self)
                # Normalised and validated: every process reads the same full settings.
                self.additional_config = {**self.additional_config, ADDITIONAL_CONFIG_KEY: config.normalised()}
            vllm_config = original(self, *args, **kwargs)
            if config is not None:
                # vLLM's CPU platform turns 'uni' into 'mp' (a worker process of its own) when the engine
                # core runs in a process of its own, as in the server.
                vllm_config.parallel_config.distributed_executor_backend = "uni"
                if config.method == SEKV:
                    # a request of another deployment's method that asks for sekv gets `auto`, settled there
                    _check_kernel_dtype(config, vllm_config)
                    _settle_policy(config, vllm_config)
            return vllm_config

        return create_engine_config

    _wrap(EngineArgs, "add_cli_args", make_add_cli_args)
    _wrap(EngineArgs, "from_cli_args", make_from_cli_args)
    _wrap(EngineArgs, "create_engine_config", make_create_engine_config)


def _check_one_worker(engine_args) -> None:
    """The worker must run in the scheduler's process (the `uni` executor): the page plans
    (kv_pages.py) and the failed requests (request_failures.py) go from the one to the other in
    memory. In a worker process of its own (vLLM's server default on CPU) pages never went back."""
    backend = engine_args.distributed_executor_backend
    if backend not in (None, "uni"):
        raise SeKVConfigError(f"distributed_executor_backend: sekv needs 'uni' (one worker in the engine's "
                              f"process), got {backend!r}")
    if engine_args.tensor_parallel_size > 1 or engine_args.pipeline_parallel_size > 1:
        raise SeKVConfigError("tensor_parallel_size, pipeline_parallel_size: sekv runs one worker (1 each) so far")


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
    settings = {**config.normalised(), "zoom_policy": policy}
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
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
    from vllm.v1.request import RequestStatus
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    def make_execute_model(original):
        def execute_model(self, scheduler_output, *args, **kwargs):
            bridge = bridge_for(self)
            if bridge is None:
                return original(self, scheduler_output, *args, **kwargs)
            try:
                step = StepSchedule.of(scheduler_output)
                bridge.before_step(step)
                result = original(self, scheduler_output, *args, **kwargs)
                bridge.after_step(step)
            except Exception as err:
                return _fail_step(self, bridge, scheduler_output, "model step", err)
            bridge.step_succeeded()
            return result

        return execute_model

    def make_get_kv_cache_spec(original):
        def get_kv_cache_spec(self, *args, **kwargs):
            specs = original(self, *args, **kwargs)
            if SeKVConfig.from_additional_config(self.vllm_config.additional_config) is None:
                return specs
            from sekv_vllm.integration.vllm.v0_32.kv_pages import sekv_spec

            return {name: sekv_spec(spec, self.vllm_config) for name, spec in specs.items()}

        return get_kv_cache_spec

    def make_preempt_request(original):
        def _preempt_request(self, request, *args, **kwargs):
            from sekv_vllm.integration.vllm.v0_32 import kv_pages

            kv_pages.preempting.add(request.request_id)
            try:
                return original(self, request, *args, **kwargs)
            finally:
                kv_pages.preempting.discard(request.request_id)

        return _preempt_request

    def make_schedule(original):
        def schedule(self, *args, **kwargs):
            room = _decode_room(self)
            if room is None:
                return original(self, *args, **kwargs)
            room.before(self)
            out = original(self, *args, **kwargs)
            room.after(self)
            return out

        return schedule

    def make_sample_tokens(original):
        def sample_tokens(self, *args, **kwargs):
            state = self.execute_model_state
            hidden = _hide_discarded_cpu_generators(self)
            try:
                return original(self, *args, **kwargs)
            except Exception as err:
                bridge = bridge_for(self)
                if bridge is None or state is None:
                    raise
                return _fail_step(self, bridge, state.scheduler_output, "sampling", err)
            finally:
                self.input_batch.generators.update(hidden)

        return sample_tokens

    def make_update_from_output(original):
        def update_from_output(self, scheduler_output, model_runner_output):
            failed = {r: c for r, c in request_failures.take().items() if r in self.requests}
            if not failed:
                return original(self, scheduler_output, model_runner_output)
            # Finished first: the step's output of these requests is then skipped, as for an abort.
            requests = self.finish_requests(list(failed), RequestStatus.FINISHED_ERROR)
            outputs = original(self, scheduler_output, model_runner_output)
            for request in requests:
                eco = outputs.setdefault(request.client_index, EngineCoreOutputs())
                eco.outputs.append(EngineCoreOutput(request_id=request.request_id, new_token_ids=[],
                                                    finish_reason=request.get_finished_reason(),
                                                    stop_reason=failed[request.request_id]))
            return outputs

        return update_from_output

    _wrap(GPUModelRunner, "execute_model", make_execute_model)
    _wrap(GPUModelRunner, "sample_tokens", make_sample_tokens)
    _wrap(GPUModelRunner, "get_kv_cache_spec", make_get_kv_cache_spec)
    _wrap(Scheduler, "_preempt_request", make_preempt_request)
    _wrap(Scheduler, "schedule", make_schedule)
    _wrap(Scheduler, "update_from_output", make_update_from_output)


def _decode_room(scheduler) -> "DecodeRoom | None":
    """The scheduler's admission gate (made at its first schedule); None unless sekv is on and
    `decode_room_tokens` > 0."""
    room = scheduler.__dict__.get("_sekv_decode_room", False)
    if room is False:
        from sekv_vllm.integration.vllm.v0_32.admission import DecodeRoom

        config = SeKVConfig.from_additional_config(scheduler.vllm_config.additional_config)
        room = DecodeRoom(config.decode_room_tokens) if config is not None and config.decode_room_tokens else None
        scheduler._sekv_decode_room = room
    return room


def bridge_for(runner) -> "RunnerBridge | None":
    """The runner's bridge, made on first use; None when the runner's config has no `sekv`."""
    from sekv_vllm.integration.vllm.runner_bridge import RunnerBridge

    bridge = getattr(runner, "_sekv_bridge", False)
    if bridge is False:
        config = SeKVConfig.from_additional_config(runner.vllm_config.additional_config)
        bridge = RunnerBridge(RunnerView(runner), config) if config is not None else None
        runner._sekv_bridge = bridge
        if bridge is not None:
            logger.info("sekv: active on this worker with %s", config.model_dump())
    return bridge


def _fail_step(runner, bridge, scheduler_output, what: str, err: Exception):
    """Fail every request of a step that raised (one forward runs the whole batch: the exception
    cannot be pinned on one request) and go on with an empty output; the bridge gives up, and the
    engine stops as vLLM's would, after `MAX_FAILED_STEPS` failed steps in a row."""
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

    if not bridge.step_failed():
        raise err
    cause = f"{what} failed: {type(err).__name__}: {err}"
    req_ids = list(scheduler_output.num_scheduled_tokens)
    logger.exception("sekv: %s; failing the %d requests of this step: %s", cause, len(req_ids), req_ids)
    runner.execute_model_state = None
    for req_id in req_ids:
        bridge.drop(req_id)
        request_failures.fail(req_id, cause)
    return EMPTY_MODEL_RUNNER_OUTPUT


def _install_error_causes() -> None:
    from vllm.entrypoints.generate.base.serving import GenerateBaseServing, GenerationError
    from vllm.v1.engine import FinishReason
    from vllm.v1.engine.output_processor import OutputProcessor

    def make_process_outputs(original):
        def process_outputs(self, engine_core_outputs, *args, **kwargs):
            for eco in engine_core_outputs:
                cause = eco.stop_reason
                if (eco.finish_reason == FinishReason.ERROR and isinstance(cause, str)
                        and cause.startswith(request_failures.CAUSE_PREFIX)):
                    state = self.request_states.get(eco.request_id)
                    if state is not None:
                        parent = getattr(state, "parent_req", None)
                        request_failures.remember_cause((parent or state).external_req_id, cause)
            return original(self, engine_core_outputs, *args, **kwargs)

        return process_outputs

    def make_raise_if_error(original):
        def _raise_if_error(self, finish_reason, request_id):
            cause = request_failures.pop_cause(request_id) if finish_reason == "error" else None
            if cause is not None:
                logger.error("sekv: request %s failed: %s", request_id, cause)
                raise GenerationError(f"Internal server error: {cause}")
            return original(self, finish_reason, request_id)

        return _raise_if_error

    _wrap(OutputProcessor, "process_outputs", make_process_outputs)
    _wrap(GenerateBaseServing, "_raise_if_error", make_raise_if_error)


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
    _install_error_causes()
