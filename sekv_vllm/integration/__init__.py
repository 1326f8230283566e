"""Engine adapters; vllm/ is the only one so far."""
