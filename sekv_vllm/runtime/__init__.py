"""Per-request SeKV state for a serving engine (torch only, no vLLM import)."""
from sekv_vllm.runtime.figures import CompressionFigures, EnginePages
from sekv_vllm.runtime.request_memory import RequestMemory, SeKVRuntime, SpanifiedRows, Status
from sekv_vllm.runtime.span_budget import SpanCosts, SpanPlan, plan_layout, summary_dtype

__all__ = ["CompressionFigures", "EnginePages", "RequestMemory", "SeKVRuntime", "SpanCosts", "SpanPlan", "SpanifiedRows", "Status", "plan_layout",
           "summary_dtype"]
