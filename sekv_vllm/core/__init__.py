"""The SeKV method in plain torch. Nothing under core/ imports vLLM."""
from sekv_vllm.core.low_rank import SpanBases, fit_span_bases, gate_bases, rebuild_spans, singular_values
from sekv_vllm.core.mixed_attention import exact_attention, mixed_attention
from sekv_vllm.core.segmentation import SpanLayout, segment_prompt, surprisal_threshold
from sekv_vllm.core.span_memory import LayerSpanMemory, append_spans, attend_memory, compress_layer
from sekv_vllm.core.span_keys import SpanKeys, concat_span_keys, scoring_nbytes, span_keys
from sekv_vllm.core.span_summary import summarize_spans

__all__ = [
    "LayerSpanMemory",
    "SpanBases",
    "SpanKeys",
    "SpanLayout",
    "append_spans",
    "attend_memory",
    "compress_layer",
    "concat_span_keys",
    "exact_attention",
    "fit_span_bases",
    "gate_bases",
    "mixed_attention",
    "rebuild_spans",
    "scoring_nbytes",
    "segment_prompt",
    "singular_values",
    "span_keys",
    "summarize_spans",
    "surprisal_threshold",
]
