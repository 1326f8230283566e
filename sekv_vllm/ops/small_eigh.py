"""Eigendecompositions of many small symmetric matrices on CPU as one C++ kernel (`csrc/cpu/small_eigh.cpp`).

The router's key gates need one per span, KV head and layer (a 32 x 32 Gram matrix at the defaults:
~11K per 4K prompt at a 12.5% budget). LAPACK solves them one by one (`torch.linalg.eigh`, the
reference); the kernel runs a cyclic Jacobi on 16 matrices at once, one per SIMD lane, and groups of
16 on every thread. Compiled once per machine like the decode kernel (`span_decode.py`).
"""
from __future__ import annotations

import functools
from types import ModuleType

import torch

from sekv_vllm.ops.cpu_build import build_cpu_extension

# Sweeps stop once every matrix's off-diagonal mass is below this share of its total (squared
# Frobenius norms): float32 rounding; 10 sweeps at most (32 x 32 Gram matrices need 6-8).
_TOLERANCE = 1e-14
_MAX_SWEEPS = 10


@functools.cache
def load_small_eigh() -> ModuleType:
    """The compiled extension (built on first call); KernelBuildError says why it is unavailable."""
    return build_cpu_extension("sekv_small_eigh", "small_eigh.cpp", "the C++ eigensolver")


def small_eigh(gram: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`torch.linalg.eigh` of gram [..., n, n] (float32, CPU, symmetric): eigenvalues [..., n] ascending and
    eigenvectors [..., n, n] as columns (each up to its sign, as from any solver)."""
    *batch, n, _ = gram.shape
    evals, vecs = load_small_eigh().small_eigh(gram=gram.reshape(-1, n, n), max_sweeps=_MAX_SWEEPS, tol=_TOLERANCE)
    evals, order = evals.sort(dim=-1)
    vecs = vecs.gather(2, order[:, None, :].expand(-1, n, n))
    return evals.reshape(*batch, n), vecs.reshape(*batch, n, n)
