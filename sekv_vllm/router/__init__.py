"""The trained zoom-in router (pure torch) and its weight files."""
from sekv_vllm.router.network import ModelShape, ZoomRouter
from sekv_vllm.router.weights import RouterWeightsError, check_router, load_router, resolve_weights, save_router, shipped_weights

__all__ = ["ModelShape", "RouterWeightsError", "check_router", "ZoomRouter", "load_router", "resolve_weights", "save_router",
           "shipped_weights"]
