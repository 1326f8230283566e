"""The trained zoom-in router (pure torch) and its weight files."""
from sekv_vllm.router.network import ModelShape, ZoomRouter
from sekv_vllm.router.weights import RouterWeightsError, load_router, resolve_weights, save_router, shipped_weights

__all__ = ["ModelShape", "RouterWeightsError", "ZoomRouter", "load_router", "resolve_weights", "save_router",
           "shipped_weights"]
