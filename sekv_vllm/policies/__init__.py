"""Zoom policies by name. Adding one: a file here, an entry in POLICIES, a row in the test matrix."""
from __future__ import annotations

from sekv_vllm.policies.base import QueryTerms, ZoomPolicy, budgeted_zoom, segment_budgeted_zoom, segment_key_recall
from sekv_vllm.policies.router import RouterPolicy
from sekv_vllm.policies.span_score import SpanScorePolicy
from sekv_vllm.router import ModelShape, load_router, resolve_weights, shipped_weights

POLICIES: dict[str, type[ZoomPolicy]] = {SpanScorePolicy.name: SpanScorePolicy, RouterPolicy.name: RouterPolicy}


def choose_policy(name: str, router_weights: str | None, model_name: str) -> tuple[str, str]:
    """(policy, why): `auto` is the router when router weights are given or shipped for
    `model_name` (a model folder's name), else span_score; other names are themselves."""
    if name != "auto":
        return name, "configured"
    if router_weights:
        return RouterPolicy.name, "auto: router_weights given"
    if model_name in shipped_weights():
        return RouterPolicy.name, f"auto: router weights shipped for {model_name}"
    return SpanScorePolicy.name, (f"auto: no router weights shipped for {model_name!r} (shipped: "
                                  f"{sorted(shipped_weights())}); train one with `sekv-vllm train-router`")


def make_policy(name: str, *, shape: ModelShape | None = None, model_name: str = "",
                router_weights: str | None = None) -> ZoomPolicy:
    """The policy `name` (`auto`: see choose_policy); the router loads its weights (given, or
    shipped for `model_name`) and refuses weights trained for another model shape."""
    name, _ = choose_policy(name, router_weights, model_name)
    if name not in POLICIES:
        raise ValueError(f"zoom_policy: unknown policy {name!r}; allowed: {sorted(POLICIES)}")
    if name == RouterPolicy.name:
        if shape is None:
            raise ValueError("zoom_policy 'router' needs the model's shape (layers, heads, head_dim)")
        return RouterPolicy(load_router(resolve_weights(router_weights, model_name), shape))
    return POLICIES[name]()


__all__ = ["POLICIES", "QueryTerms", "RouterPolicy", "SpanScorePolicy", "ZoomPolicy", "budgeted_zoom", "choose_policy",
           "make_policy", "segment_budgeted_zoom", "segment_key_recall"]
