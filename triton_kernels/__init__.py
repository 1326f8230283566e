"""Triton kernels of sekv-vllm, installed as `sekv_vllm.triton_kernels`."""
