"""Public ops: each has a float32 torch reference and dispatches to a kernel where one runs."""
from sekv_vllm.ops.span_rebuild import span_rebuild, span_rebuild_reference

__all__ = ["span_rebuild", "span_rebuild_reference"]
