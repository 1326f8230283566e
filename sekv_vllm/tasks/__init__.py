"""Long-context text and tasks for training the router and for the benchmark suite (no vLLM import)."""
