"""KV-cache methods by name. SeKV (`sekv`, the runtime's span path) and the row-keeping methods.

Adding a row-keeping method: a file here (a `RowKeepingMethod` subclass) and its line below.
"""
from __future__ import annotations

from sekv_vllm.methods.base import PromptRows, RowKeepingMethod, gather_kept
from sekv_vllm.methods.snapkv import SnapKV
from sekv_vllm.methods.streaming_llm import StreamingLLM
from sekv_vllm.methods.tova import TOVA

SEKV = "sekv"
ROW_METHODS: dict[str, type[RowKeepingMethod]] = {
    StreamingLLM.name: StreamingLLM,
    SnapKV.name: SnapKV,
    TOVA.name: TOVA,
}
METHOD_NAMES: tuple[str, ...] = (SEKV, *ROW_METHODS)

__all__ = ["METHOD_NAMES", "ROW_METHODS", "SEKV", "PromptRows", "RowKeepingMethod", "SnapKV", "StreamingLLM", "TOVA",
           "gather_kept"]
