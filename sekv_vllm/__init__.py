"""sekv-vllm: SeKV KV-cache compression as a vLLM plugin."""
__version__ = "0.1.0"
