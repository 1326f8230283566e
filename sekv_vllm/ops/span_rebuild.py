"""Rebuild token rows of zoomed spans from low-rank factors."""
from __future__ import annotations

import os

import torch


def span_rebuild_reference(coef: torch.Tensor, basis: torch.Tensor, row: torch.Tensor, span: torch.Tensor) -> torch.Tensor:
    """Float32 reference.

    coef:  [P, Hkv, R]     per-token coefficients U diag(s)
    basis: [S, Hkv, R, D]  per-span V^T
    row:   [M] int64       coef row of each output row
    span:  [M] int64       span of each output row
    returns [M, Hkv, D] float32
    """
    return torch.einsum("mhr,mhrd->mhd", coef.float()[row], basis.float()[span])


def _triton_usable(t: torch.Tensor) -> bool:
    if t.is_cuda:
        return True
    return os.environ.get("TRITON_INTERPRET") == "1"


def span_rebuild(coef: torch.Tensor, basis: torch.Tensor, row: torch.Tensor, span: torch.Tensor) -> torch.Tensor:
    """The Triton kernel on GPU (or under TRITON_INTERPRET=1), else the torch reference.

    Example: rows = span_rebuild(bases.coef, bases.basis, row_index, row_span)
    """
    if coef.dim() != 3 or basis.dim() != 4:
        raise ValueError(f"coef must be [P, Hkv, R] and basis [S, Hkv, R, D]; got {tuple(coef.shape)}, {tuple(basis.shape)}")
    if _triton_usable(coef):
        try:
            from sekv_vllm.triton_kernels.span_rebuild import span_rebuild_triton
        except ImportError:
            return span_rebuild_reference(coef, basis, row, span)
        return span_rebuild_triton(coef, basis, row.long(), span.long())
    return span_rebuild_reference(coef, basis, row, span)
