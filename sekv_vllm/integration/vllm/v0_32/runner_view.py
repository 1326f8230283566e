"""What sekv's runner bridge reads of vLLM 0.32's model runner and scheduler output: the seam between the
version-neutral adapter (runner_bridge.py) and this version's internals (attribute names, the KV cache
layout). Another vLLM version provides the same two names in a folder of its own."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
from vllm.model_executor.models.utils import extract_layer_index

from sekv_vllm.core.surprisal import LogitHead

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner


@dataclass(frozen=True)
class NewRequest:
    req_id: str
    prompt_len: int
    extra_args: dict | None


@dataclass(frozen=True)
class StepSchedule:
    """One step as the scheduler planned it: requests that finished or were preempted since the last step,
    new ones, preempted ones resumed (they recompute their prompt and output), tokens per request."""

    finished: tuple[str, ...]
    preempted: tuple[str, ...]
    new: tuple[NewRequest, ...]
    resumed: tuple[str, ...]
    num_tokens: dict[str, int]

    @classmethod
    def of(cls, scheduler_output: "SchedulerOutput") -> "StepSchedule":
        new = tuple(NewRequest(r.req_id, len(r.prompt_token_ids or ()),
                               r.sampling_params.extra_args if r.sampling_params else None)
                    for r in scheduler_output.scheduled_new_reqs)
        return cls(tuple(scheduler_output.finished_req_ids), tuple(scheduler_output.preempted_req_ids or ()), new,
                   tuple(scheduler_output.scheduled_cached_reqs.resumed_req_ids),
                   dict(scheduler_output.num_scheduled_tokens))


@dataclass(frozen=True)
class StepOutputs:
    """What the step's forward pass computed: hidden [N, hidden] final hidden states of its N token rows,
    logits [B, V] for sampling (None if none), query_start [B + 1] int64 each request's first row."""

    hidden: torch.Tensor
    logits: torch.Tensor | None
    query_start: torch.Tensor


class RunnerView:
    """One model runner, as sekv reads it."""

    def __init__(self, runner: "GPUModelRunner") -> None:
        self._runner = runner

    @property
    def additional_config(self) -> dict:
        return self._runner.vllm_config.additional_config

    @property
    def model_name(self) -> str:
        return Path(self._runner.vllm_config.model_config.model).name

    @property
    def block_size(self) -> int:
        return self._runner.cache_config.block_size

    def attention_layers(self) -> dict:
        """The model's attention layers by name, in model order (num_heads, num_kv_heads, head_size, kv_cache)."""
        forward_context = self._runner.compilation_config.static_forward_context
        attn = [(name, layer) for name, layer in forward_context.items()
                if hasattr(layer, "impl") and hasattr(layer, "kv_cache")]
        return dict(sorted(attn, key=lambda item: extract_layer_index(item[0])))

    @staticmethod
    def kv_pages(layer) -> torch.Tensor:
        """A layer's KV cache [num_blocks, Hkv, block, 2 D] (LBHNC) as pages of rows [num_blocks, 2, block, Hkv, D]
        (the same memory, sekv's layout for the pages a compressed request keeps)."""
        num_blocks, Hkv, block, two_d = layer.kv_cache.shape
        return layer.kv_cache.view(num_blocks, 2, block, Hkv, two_d // 2)

    @staticmethod
    def page_bytes(layer) -> int:
        """Bytes of one page of one layer."""
        return layer.kv_cache[0].numel() * layer.kv_cache.element_size()

    def batch_req_ids(self) -> list[str]:
        """The requests of the running batch, in batch order."""
        return self._runner.input_batch.req_ids

    def knows(self, req_id: str) -> bool:
        return req_id in self._runner.requests

    def prompt(self, req_id: str) -> list[int]:
        return self._runner.requests[req_id].prompt_token_ids or []

    def output(self, req_id: str) -> list[int]:
        """Tokens generated so far (a negative id: a placeholder not sampled yet)."""
        return self._runner.requests[req_id].output_token_ids

    def extra_args(self, req_id: str) -> dict | None:
        params = self._runner.requests[req_id].sampling_params
        return params.extra_args if params else None

    def max_tokens(self, req_id: str) -> int | None:
        params = self._runner.requests[req_id].sampling_params
        return params.max_tokens if params else None

    def computed_tokens(self, req_id: str) -> int:
        """Tokens computed before this step."""
        return self._runner.requests[req_id].num_computed_tokens

    def block_ids(self, req_id: str) -> list[int]:
        return self._runner.requests[req_id].block_ids[0]

    def step_outputs(self) -> StepOutputs | None:
        state = self._runner.execute_model_state
        if state is None:
            return None
        return StepOutputs(state.hidden_states, state.logits, self._runner.query_start_loc.cpu)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden] -> logits [n, V]."""
        return self._runner.model.compute_logits(hidden)

    def logit_head(self, dtype: torch.dtype) -> LogitHead | None:
        """The model's output projection as a plain matrix in `dtype` (a copy), or None where it is not one
        (quantized or sharded across ranks, a bias, or a logits processor of its own kind)."""
        model = self._runner.model
        head, proc = getattr(model, "lm_head", None), getattr(model, "logits_processor", None)
        if head is None or type(proc) is not LogitsProcessor or proc.logits_as_input:
            return None
        if (getattr(head, "tp_size", 1) != 1 or getattr(head, "bias", None) is not None
                or not isinstance(getattr(head, "quant_method", None), UnquantizedEmbeddingMethod)):
            return None
        weight = head.weight[: proc.org_vocab_size]
        return LogitHead(weight.to(dtype).contiguous(), proc.soft_cap, float(proc.scale))
