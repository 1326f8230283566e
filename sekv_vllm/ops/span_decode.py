"""sekv's decode step on CPU as one C++ kernel per layer (`csrc/cpu/span_decode.cpp`).

The kernel scores every span, zooms each request's best spans within its budget and attends
full rows, summaries and zoomed spans (through their factors) in one softmax, one (request,
KV head) per thread, without gathering or copying rows. Its torch reference is the runtime's
torch path (`ZoomPolicy.span_scores`, `segment_budgeted_zoom`, `batched_mixed_attention`);
tests hold the two together. It is compiled once per machine with torch's C++ extension
builder (g++, OpenMP; cached under TORCH_EXTENSIONS_DIR, about a minute the first time).
"""
from __future__ import annotations

import functools
from types import ModuleType

from sekv_vllm.ops.cpu_build import build_cpu_extension


@functools.cache
def load_span_decode() -> ModuleType:
    """The compiled extension (built on first call); KernelBuildError says why it is unavailable."""
    return build_cpu_extension("sekv_span_decode", "span_decode.cpp", "the C++ decode kernel")
