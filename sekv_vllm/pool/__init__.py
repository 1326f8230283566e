"""Host-side memory for span bases."""
from sekv_vllm.pool.host_pool import HostPool

__all__ = ["HostPool"]
