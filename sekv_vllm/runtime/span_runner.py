"""SeKV as one method of the runtime: compression into spans (span_compression.py), decode through its
zoom policy (the trained router or the untrained score) with the C++ kernel or its torch reference
(span_decoder.py), the output spanified as it grows (torch only)."""
from __future__ import annotations

import logging
from types import ModuleType

import torch

from sekv_vllm.config import SeKVConfig
from sekv_vllm.core import LayerSpanMemory
from sekv_vllm.core.low_rank import Eigh
from sekv_vllm.ops.small_eigh import load_small_eigh, small_eigh
from sekv_vllm.ops.cpu_build import KernelBuildError
from sekv_vllm.ops.span_decode import load_span_decode
from sekv_vllm.policies import ZoomPolicy, make_policy
from sekv_vllm.pool import HostPool
from sekv_vllm.router import ModelShape
from sekv_vllm.runtime.method_runner import MethodRunner
from sekv_vllm.runtime.request_state import RequestMemory, SpanifiedRows
from sekv_vllm.runtime.row_placement import OWN_BLOCK
from sekv_vllm.runtime.span_compression import SpanCompression
from sekv_vllm.runtime.span_decoder import SpanDecoder

logger = logging.getLogger("sekv_vllm")


def load_kernel(choice: str) -> ModuleType | None:
    """The C++ decode kernel, or None for the torch path (`SeKVConfig.decode_kernel`)."""
    if choice == "torch":
        return None
    try:
        kernel = load_span_decode()
    except KernelBuildError as err:
        if choice == "cpp":
            raise RuntimeError(f"sekv.decode_kernel is 'cpp' but the C++ kernel cannot be built here: {err}; "
                               "allowed: 'auto' (fall back to torch, logged) or 'torch'") from None
        logger.warning("sekv: C++ decode kernel unavailable (%s); decoding with the torch ops", err)
        return None
    logger.info("sekv: decode attention: C++ kernel (decode_kernel=%s)", choice)
    return kernel


def load_eigh(choice: str) -> Eigh:
    """The spans' eigensolver: the C++ kernel, or torch's (`SeKVConfig.decode_kernel` chooses both kernels)."""
    if choice == "torch":
        return torch.linalg.eigh
    try:
        load_small_eigh()
    except KernelBuildError as err:
        if choice == "cpp":
            raise RuntimeError(f"sekv.decode_kernel is 'cpp' but the C++ eigensolver cannot be built here: {err}; "
                               "allowed: 'auto' (fall back to torch, logged) or 'torch'") from None
        logger.warning("sekv: C++ eigensolver unavailable (%s); compressing with torch.linalg.eigh", err)
        return torch.linalg.eigh
    return small_eigh


class SpanRunner(MethodRunner):
    """SeKV's requests of one worker. layer_names in model order (the policy's layer index)."""

    needs_surprisal = True

    def __init__(self, config: SeKVConfig, layer_names: list[str], pool: HostPool[LayerSpanMemory],
                 shape: ModelShape | None = None, model_name: str = "") -> None:
        self.config = config
        self.layer_index = {name: i for i, name in enumerate(layer_names)}
        self.policy: ZoomPolicy = make_policy(config.zoom_policy, shape=shape, model_name=model_name,
                                              router_weights=config.router_weights)
        self.compression = SpanCompression(config, layer_names, self.policy, pool, OWN_BLOCK,
                                           load_eigh(config.decode_kernel))
        self.spans = SpanDecoder(self.policy, pool, config.max_span, config.recall_keys, config.whole_span_share,
                                  config.whole_span_min_share, config.exact_fallback_coverage)
        self.kernel: ModuleType | None = load_kernel(config.decode_kernel)

    @property
    def writes_new_rows(self) -> bool:
        return self.kernel is not None  # the kernel appends the newest rows in place

    def full_kv_reason(self, prompt_len: int, budget: int, kv_bits: int | None) -> str:
        window = self.config.window
        return f"prompt ({prompt_len}) fits in the window ({window})" if prompt_len <= window else ""

    def compress(self, mem: RequestMemory) -> str:
        reason = self.compression.compress_prompt(mem)
        if reason:
            return reason
        dtype = next(iter(mem.rows.values())).pages.dtype
        if self.kernel is not None and dtype != torch.float32:
            # `decode_kernel: cpp` with such a cache is refused at start-up (integration/vllm/v0_32/shims.py)
            logger.warning("sekv: the C++ decode kernel reads float32 KV rows, these are %s: decoding with "
                           "the torch ops", dtype)
            self.kernel = None
        return reason

    def attend(self, mems: list[RequestMemory], layer_name: str, q: torch.Tensor, scale: float,
               new_k: torch.Tensor | None, new_v: torch.Tensor | None) -> torch.Tensor:
        batch = self.spans.batch(mems, layer_name)
        layer = self.layer_index[layer_name]
        if self.kernel is not None:
            rows = [m.rows[layer_name] for m in mems]
            got = self.spans.attend_kernel(self.kernel, batch, layer, q, rows, new_k, new_v, scale)
        else:
            full = [m.rows[layer_name].view() for m in mems]
            got = self.spans.attend_torch(batch, layer, q, full, scale)
        for mem, zoomed, recalled, exact in zip(mems, got.zoomed.tolist(), got.recalled.tolist(), got.exact.tolist()):
            mem.decode_calls += 1
            mem.zoomed_spans_total += zoomed
            mem.recalled_keys_total += recalled
            mem.exact_heads_total += exact
        return got.out

    def window_due(self, mem: RequestMemory) -> bool:
        return self.compression.window_due(mem)

    def grow_output(self, mem: RequestMemory) -> SpanifiedRows | None:
        part = self.compression.spanify_window(mem)
        if part is not None:
            self.spans.forget(mem.req_id)
        return part

    def forget(self, req_id: str) -> None:
        self.spans.forget(req_id)
