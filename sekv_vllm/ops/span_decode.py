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
import importlib.resources
import logging
from types import ModuleType

logger = logging.getLogger("sekv_vllm")


class KernelBuildError(RuntimeError):
    """The C++ decode kernel could not be compiled or loaded here."""


@functools.cache
def load_span_decode() -> ModuleType:
    """The compiled extension (built on first call); KernelBuildError says why it is unavailable."""
    try:
        from torch.utils.cpp_extension import load

        source = importlib.resources.files("sekv_vllm.csrc") / "cpu" / "span_decode.cpp"
        if not source.is_file():
            raise FileNotFoundError(f"{source} is missing from this installation")
        logger.info("sekv: loading the C++ decode kernel (compiled on first use, about a minute)")
        # -fno-trapping-math lets the branch-free exp/log loops vectorise (nothing reads FP exceptions);
        # no -ffast-math: results stay those of the written operation order.
        return load(name="sekv_span_decode", sources=[str(source)],
                    extra_cflags=["-O3", "-march=native", "-fopenmp", "-fno-trapping-math"],
                    extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as err:  # a compiler, header or linker failure: all mean "not here"
        raise KernelBuildError(f"{type(err).__name__}: {err}") from err
