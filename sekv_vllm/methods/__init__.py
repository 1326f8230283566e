"""KV-cache methods by name. SeKV (`sekv`, the runtime's span path) and the others.

Adding a method: a file here (a `MethodSettings` subclass; a `RowKeepingMethod` for a choice of rows)
and its line below.
"""
from __future__ import annotations

from sekv_vllm.methods.base import MethodSettings, PromptRows, RowKeepingMethod, gather_kept
from sekv_vllm.methods.h2o import H2O
from sekv_vllm.methods.kv_quantization import KVQuantSettings
from sekv_vllm.methods.quest import Quest
from sekv_vllm.methods.snapkv import SnapKV
from sekv_vllm.methods.streaming_llm import StreamingLLM
from sekv_vllm.methods.tova import TOVA

SEKV = "sekv"
METHODS: dict[str, type[MethodSettings]] = {
    StreamingLLM.name: StreamingLLM,
    SnapKV.name: SnapKV,
    TOVA.name: TOVA,
    H2O.name: H2O,
    Quest.name: Quest,
}
ROW_METHODS: dict[str, type[RowKeepingMethod]] = {n: m for n, m in METHODS.items() if issubclass(m, RowKeepingMethod)}
# the methods whose kept rows may be quantized (`kv_bits`)
QUANTIZING_METHODS: tuple[str, ...] = tuple(n for n, m in METHODS.items() if issubclass(m, KVQuantSettings))
METHOD_NAMES: tuple[str, ...] = (SEKV, *METHODS)

__all__ = ["H2O", "METHODS", "METHOD_NAMES", "QUANTIZING_METHODS", "ROW_METHODS", "SEKV", "MethodSettings",
           "PromptRows", "Quest", "RowKeepingMethod", "SnapKV", "StreamingLLM", "TOVA", "gather_kept"]
