"""Router weights on disk: safetensors (float16) with the model shape and provenance as metadata.

Shipped weights live in `sekv_vllm/router/shipped/<model name>.safetensors`, beside a JSON file
naming the command, data and figures that produced them.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from safetensors import safe_open

from sekv_vllm.router.network import ModelShape, ZoomRouter

FORMAT = "sekv-router-v1"
SHIPPED_DIR = Path(__file__).parent / "shipped"


class RouterWeightsError(ValueError):
    """Router weights are missing or do not fit the model; the message says which and why."""


def save_router(router: ZoomRouter, path: str | Path, *, model_name: str, provenance: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "format": FORMAT,
        "model_name": model_name,
        "shape": json.dumps(vars(router.shape)),
        "d_r": str(router.d_r),
        "r_max": str(router.r_max),
        "gate_hidden": str(router.gate_hidden),
        "provenance": json.dumps(provenance),
    }
    tensors = {k: v.detach().to(torch.float16).contiguous() for k, v in router.state_dict().items()}
    save_file(tensors, str(path), metadata=meta)
    return path


def read_metadata(path: str | Path) -> dict:
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    if meta.get("format") != FORMAT:
        raise RouterWeightsError(f"router_weights: {path} is not a sekv router file (format {meta.get('format')!r}, "
                                 f"expected {FORMAT!r})")
    return meta


def check_router(path: str | Path, expected: ModelShape) -> dict:
    """The metadata of the router file at `path`, refused unless it was trained for a model of
    `expected` shape (reads the header only)."""
    path = Path(path)
    if not path.is_file():
        raise RouterWeightsError(f"router_weights: no file at {path}")
    meta = read_metadata(path)
    shape = ModelShape(**json.loads(meta["shape"]))
    if shape != expected:
        raise RouterWeightsError(
            f"router_weights: {path} was trained for {meta['model_name']} ({shape.describe()}); "
            f"this model has {expected.describe()}. Train one for it with `sekv-vllm train-router` "
            f"or set zoom_policy to 'span_score'"
        )
    return meta


def load_router(path: str | Path, expected: ModelShape) -> ZoomRouter:
    """The router stored at `path`, refused unless it was trained for a model of `expected` shape."""
    meta = check_router(path, expected)
    router = ZoomRouter(expected, d_r=int(meta["d_r"]), r_max=int(meta["r_max"]), gate_hidden=int(meta["gate_hidden"]))
    router.load_state_dict({k: v.float() for k, v in load_file(str(path)).items()})
    router.requires_grad_(False)
    return router


def shipped_weights() -> dict[str, Path]:
    """Model name -> shipped router file."""
    return {p.stem: p for p in sorted(SHIPPED_DIR.glob("*.safetensors"))}


def resolve_weights(router_weights: str | None, model_name: str) -> Path:
    """The configured file, else the shipped one for `model_name` (a model folder's name)."""
    if router_weights:
        return Path(router_weights)
    shipped = shipped_weights()
    if model_name not in shipped:
        raise RouterWeightsError(
            f"router_weights: no shipped router for model {model_name!r} (shipped: {sorted(shipped)}); "
            f"give router_weights (train one with `sekv-vllm train-router`) or set zoom_policy to 'span_score'"
        )
    return shipped[model_name]
