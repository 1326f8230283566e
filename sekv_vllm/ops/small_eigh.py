"""Eigendecompositions of many small symmetric matrices on CPU as one C++ kernel (`csrc/cpu/small_eigh.cpp`).

The router's key gates need one per span, KV head and layer (a 32 x 32 Gram matrix at the defaults:
~11K per 4K prompt at a 12.5% budget). LAPACK solves them one by one (`torch.linalg.eigh`, the
reference); the kernel reduces 16 matrices at once to tridiagonal form (Householder) and diagonalises them
(implicit QL), one per SIMD lane, and groups of 16 on every thread. Compiled once per machine like the
decode kernel (`span_decode.py`).
"""
from __future__ import annotations

import functools
from types import ModuleType

import torch

from sekv_vllm.ops.cpu_build import build_cpu_extension

# QL iterations per eigenvalue at most (each converges in 1-3; the cap only bounds a pathological matrix).
_MAX_ITER = 30


@functools.cache
def load_small_eigh() -> ModuleType:
    """The compiled extension (built on first call); KernelBuildError says why it is unavailable."""
    return build_cpu_extension("sekv_small_eigh", "small_eigh.cpp", "the C++ eigensolver")


def small_eigh(gram: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`torch.linalg.eigh` of gram [..., n, n] (float32, CPU, symmetric): eigenvalues [..., n] ascending and
    eigenvectors [..., n, n] as columns (each up to its sign, as from any solver)."""
    *batch, n, _ = gram.shape
    evals, vecs = load_small_eigh().small_eigh(gram=gram.reshape(-1, n, n), max_iter=_MAX_ITER)
    return evals.reshape(*batch, n), vecs.reshape(*batch, n, n)
