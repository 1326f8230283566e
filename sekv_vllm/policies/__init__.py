"""Zoom policies by name. Adding one: a file here, an entry in POLICIES, a row in the test matrix."""
from sekv_vllm.policies.base import ZoomPolicy, budgeted_zoom
from sekv_vllm.policies.span_score import SpanScorePolicy

POLICIES: dict[str, type[ZoomPolicy]] = {SpanScorePolicy.name: SpanScorePolicy}


def make_policy(name: str) -> ZoomPolicy:
    if name not in POLICIES:
        raise ValueError(f"zoom_policy: unknown policy {name!r}; allowed: {sorted(POLICIES)}")
    return POLICIES[name]()


__all__ = ["POLICIES", "SpanScorePolicy", "ZoomPolicy", "budgeted_zoom", "make_policy"]
