"""Zoom policies by name. Adding one: a file here, an entry in POLICIES, a row in the test matrix."""
from __future__ import annotations

from sekv_vllm.policies.base import ZoomPolicy, budgeted_zoom
from sekv_vllm.policies.router import RouterPolicy
from sekv_vllm.policies.span_score import SpanScorePolicy
from sekv_vllm.router import ModelShape, load_router, resolve_weights

POLICIES: dict[str, type[ZoomPolicy]] = {SpanScorePolicy.name: SpanScorePolicy, RouterPolicy.name: RouterPolicy}


def make_policy(name: str, *, shape: ModelShape | None = None, model_name: str = "",
                router_weights: str | None = None) -> ZoomPolicy:
    """The policy `name`; the router loads its weights (given, or shipped for `model_name`) and
    refuses weights trained for another model shape."""
    if name not in POLICIES:
        raise ValueError(f"zoom_policy: unknown policy {name!r}; allowed: {sorted(POLICIES)}")
    if name == RouterPolicy.name:
        if shape is None:
            raise ValueError("zoom_policy 'router' needs the model's shape (layers, heads, head_dim)")
        return RouterPolicy(load_router(resolve_weights(router_weights, model_name), shape))
    return POLICIES[name]()


__all__ = ["POLICIES", "RouterPolicy", "SpanScorePolicy", "ZoomPolicy", "budgeted_zoom", "make_policy"]
