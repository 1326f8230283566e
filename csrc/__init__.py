"""C++ sources of sekv's CPU kernels, compiled on first use (`sekv_vllm.ops.span_decode`)."""
