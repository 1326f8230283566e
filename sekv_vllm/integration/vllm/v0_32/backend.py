"""SeKV attention backend for vLLM's CPU platform.

Prefill is vLLM's own exact attention over its pages. The builder plans once per step for
every layer: which token rows the SeKV runtime captures (a prefilling request's prompt rows),
which decode rows it answers (a compressed request's newest row, whose K/V the same call
appends to its window), and vLLM metadata for the rows that stay exact. The impl executes: vLLM's kernel for the exact rows, the SeKV mixed
attention for the compressed ones. A compressed request's rows live in the pages it keeps, in
sekv's own layout (vLLM's kernel never reads those pages again); a prefilling request's rows are
captured into sekv's own buffer (compression reads them once).

        batch rows:   [ decode, decode, decode | prefill chunk ... ]
        compressed:   [   yes ,   no  ,  yes   |       no         ]
        exact subset: [          row 1         |   prefill rows   ]  -> vLLM's CPU kernel
        sekv rows:    [ row 0 ,         row 2  ]                    -> runtime.attend_batch, all at once
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm import _custom_ops as ops
from vllm import envs
from vllm.forward_context import get_forward_context
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)

from sekv_vllm.integration.vllm.runner_bridge import current_bridge


@dataclass
class SeKVStepPlan:
    """What one step does for SeKV requests; shared by every layer.

    captures:    (req_id, first token row, rows, first position) of prefilling requests' rows the runtime keeps
    attend_rows: [A] int64 token rows of compressed decode requests, answered by the runtime (which keeps
                 their K/V rows too)
    attend_ids:  their request ids
    exact_rows:  [E] int64 token rows left to vLLM's kernel (None: all rows are SeKV's)
    exact:       vLLM metadata for exactly those rows (None: all rows are SeKV's)
    decode_failed: set by the first layer whose compressed decode raised; those requests have failed,
                 later layers give their rows zeros
    """

    captures: list[tuple[str, int, int, int]]
    attend_rows: torch.Tensor
    attend_ids: list[str]
    exact_rows: torch.Tensor | None
    exact: CPUAttentionMetadata | None
    decode_failed: bool = False


@dataclass
class SeKVAttentionMetadata(CPUAttentionMetadata):
    sekv: SeKVStepPlan | None = None


class SeKVMetadataBuilder(CPUAttentionMetadataBuilder):
    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> CPUAttentionMetadata:
        meta = super().build(common_prefix_len, common_attn_metadata, fast_build)
        bridge = current_bridge()
        if bridge is None or not bridge.has_active():
            return meta
        cm = common_attn_metadata
        num_reqs = cm.num_reqs
        runtime = bridge.runtime
        req_ids = bridge.batch_req_ids(num_reqs)
        qsl = cm.query_start_loc_cpu.tolist()
        seq_lens = cm.seq_lens.cpu().tolist()

        captures, attend_rows, attend_ids, exact_reqs = [], [], [], []
        for i, req_id in enumerate(req_ids):
            n = qsl[i + 1] - qsl[i]
            if runtime.is_compressed(req_id):
                # Its newest row is decoded from the compressed state. A preempted request's
                # recompute (n > 1) also runs its other rows, which the runtime already holds,
                # through vLLM's kernel: only the newest row's output is used.
                mem = runtime.get(req_id)
                last = seq_lens[i] - 1
                if last == mem.next_position and bridge.sync_pages(req_id):
                    attend_rows.append(qsl[i + 1] - 1)
                    attend_ids.append(req_id)
                if n > 1 or last != mem.next_position or not runtime.is_compressed(req_id):
                    exact_reqs.append(i)  # a request failed just now runs exact: its output is dropped
                continue
            if runtime.is_active(req_id):
                captures.append((req_id, qsl[i], n, seq_lens[i] - n))
            exact_reqs.append(i)
        if not captures and not attend_rows:
            return meta
        if attend_rows and any(qsl[i + 1] - qsl[i] > 1 for i in exact_reqs):
            bridge.steps_mixing_prefill_and_compressed_decode += 1
        if not attend_rows:
            exact_rows, exact = None, meta
        elif exact_reqs:
            exact_rows, exact = self._subset(meta, cm, exact_reqs)
        else:
            exact_rows, exact = None, None
        plan = SeKVStepPlan(captures, torch.tensor(attend_rows, dtype=torch.int64), attend_ids, exact_rows, exact)
        return SeKVAttentionMetadata(**vars(meta), sekv=plan)

    def _subset(
        self, meta: CPUAttentionMetadata, cm: CommonAttentionMetadata, reqs: list[int]
    ) -> tuple[torch.Tensor, CPUAttentionMetadata]:
        """Metadata for the requests `reqs` alone, with their token rows in the full batch."""
        qsl = cm.query_start_loc_cpu
        idx = torch.tensor(reqs, dtype=torch.int64)
        lens = (qsl[1:] - qsl[:-1])[idx]
        token_rows = torch.cat([torch.arange(int(qsl[i]), int(qsl[i + 1])) for i in reqs])
        sub_qsl = torch.zeros(len(reqs) + 1, dtype=qsl.dtype)
        torch.cumsum(lens, 0, out=sub_qsl[1:])
        seq_lens = cm.seq_lens[idx].contiguous()
        scheduler_metadata = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=len(reqs),
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            seq_lens=seq_lens,
            dtype=self.dtype,
            query_start_loc=sub_qsl,
            causal=meta.causal,
            sliding_window_size=self.window_size,
            isa=self.isa,
            enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
            dynamic_causal=None,
            kv_cache_dtype=self.kv_cache_dtype,
        )
        sub = CPUAttentionMetadata(
            num_actual_tokens=int(token_rows.numel()),
            max_query_len=int(lens.max()),
            query_start_loc=sub_qsl,
            max_seq_len=int(seq_lens.max()),
            seq_lens=seq_lens,
            block_table=meta.block_table[idx].contiguous(),
            slot_mapping=meta.slot_mapping[token_rows],
            scheduler_metadata=scheduler_metadata,
            causal=meta.causal,
        )
        return token_rows, sub


class SeKVAttentionImpl(CPUAttentionBackendImpl):
    def do_kv_cache_update(self, layer, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
        """vLLM writes every new token's K/V into its slot before attention; a compressed request's
        newest row goes to sekv instead (the runtime appends it to its rows). Its slot lies in a page
        the request keeps, which may hold sekv's rows in sekv's layout: writing it there would
        overwrite some of them."""
        meta = get_forward_context().attn_metadata
        plan = getattr(meta.get(layer.layer_name) if isinstance(meta, dict) else meta, "sekv", None)
        if plan is not None and plan.attend_rows.numel():
            n = slot_mapping.shape[0]
            vllm_rows = torch.ones(n, dtype=torch.bool)
            vllm_rows[plan.attend_rows] = False
            key, value, slot_mapping = key[:n][vllm_rows], value[:n][vllm_rows], slot_mapping[vllm_rows]
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)

    def forward(
        self,
        layer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: CPUAttentionMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """query: [num_tokens, H, D]; kv_cache: [num_blocks, Hkv, block_size, 2 * D]."""
        plan = getattr(attn_metadata, "sekv", None)
        if plan is None:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                   output_scale, output_block_scale)
        runtime = current_bridge().runtime
        name = layer.layer_name
        for req_id, row, n, start in plan.captures:
            q = query[row : row + n].view(n, self.num_heads, self.head_size)
            runtime.capture(req_id, name, start, key[row : row + n], value[row : row + n], q)
        if plan.exact is not None and plan.exact_rows is None:
            super().forward(layer, query, key, value, kv_cache, plan.exact, output, output_scale, output_block_scale)
        elif plan.exact is not None:
            out_exact = output.new_empty((plan.exact_rows.numel(), *output.shape[1:]))
            super().forward(layer, query[plan.exact_rows], key, value, kv_cache, plan.exact, out_exact,
                            output_scale, output_block_scale)
            output[plan.exact_rows] = out_exact
        if plan.attend_ids and not plan.decode_failed:
            rows = plan.attend_rows
            q = query[rows].view(-1, self.num_heads, self.head_size)
            k = key[rows].view(-1, self.num_kv_heads, self.head_size)
            v = value[rows].view(-1, self.num_kv_heads, self.head_size)
            out = output.view(output.shape[0], self.num_heads, self.head_size)
            try:
                out[rows] = runtime.attend_batch(plan.attend_ids, name, q, self.scale, k, v).to(out.dtype)
            except Exception as err:
                # One call decodes every compressed request of the step: all of them fail, the rest go on.
                plan.decode_failed = True
                for req_id in plan.attend_ids:
                    current_bridge().request_failed(req_id, "compressed decode", err)
        if plan.decode_failed:
            output[plan.attend_rows] = 0
        return output


class SeKVAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_name() -> str:
        # vLLM looks a backend up by an existing enum member's name; this one replaces CPU_ATTN.
        return "CPU_ATTN"

    @staticmethod
    def get_impl_cls() -> type[SeKVAttentionImpl]:
        return SeKVAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[SeKVMetadataBuilder]:
        return SeKVMetadataBuilder
