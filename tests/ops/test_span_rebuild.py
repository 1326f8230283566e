"""Triton span rebuild vs its float32 torch reference (TRITON_INTERPRET=1 on CPU, CUDA if present)."""
import os

import pytest
import torch

from sekv_vllm.ops import span_rebuild_reference

triton = pytest.importorskip("triton")


def rel_err(a, b):
    return float((a - b).norm() / b.norm().clamp(min=1e-12))


def devices():
    out = []
    if os.environ.get("TRITON_INTERPRET") == "1":
        out.append("cpu")
    if torch.cuda.is_available():
        out.append("cuda")
    return out or [pytest.param("cpu", marks=pytest.mark.skip(reason="needs TRITON_INTERPRET=1 or a GPU"))]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("P, S, Hkv, R, D, M", [(63, 5, 3, 27, 60, 63), (200, 7, 1, 32, 64, 17), (9, 2, 2, 1, 16, 4)])
def test_kernel_matches_reference_on_odd_shapes(device, P, S, Hkv, R, D, M):
    from sekv_vllm.triton_kernels.span_rebuild import span_rebuild_triton

    g = torch.Generator().manual_seed(P + M)
    coef = torch.randn(P, Hkv, R, generator=g)
    basis = torch.randn(S, Hkv, R, D, generator=g)
    row = torch.randint(0, P, (M,), generator=g)
    span = torch.randint(0, S, (M,), generator=g)
    got = span_rebuild_triton(*(t.to(device) for t in (coef, basis, row, span))).cpu()
    assert rel_err(got, span_rebuild_reference(coef, basis, row, span)) < 1e-5


@pytest.mark.parametrize("device", devices())
def test_kernel_indexes_past_int32_on_large_tables(device):
    """Offsets beyond 2**31 elements would wrap in int32; the kernel computes them in int64."""
    from sekv_vllm.triton_kernels.span_rebuild import span_rebuild_triton

    if device == "cpu":
        pytest.skip("the interpreter would need a 4 GiB table: checked on GPU only")
    Hkv, R, D = 1, 1, 16
    S = 2**31 // (Hkv * R * D) + 8  # basis offsets of the last spans exceed int32
    basis = torch.zeros(S, Hkv, R, D, device=device, dtype=torch.float16)
    basis[-1] = 1.0
    coef = torch.ones(1, Hkv, R, device=device)
    out = span_rebuild_triton(coef, basis, torch.zeros(1, dtype=torch.long, device=device),
                              torch.tensor([S - 1], device=device))
    assert torch.allclose(out.cpu(), torch.ones(1, Hkv, D))


def test_public_op_validates_shapes_and_matches_reference():
    from sekv_vllm.ops import span_rebuild

    g = torch.Generator().manual_seed(0)
    coef, basis = torch.randn(20, 3, 8, generator=g), torch.randn(4, 3, 8, 60, generator=g)
    row, span = torch.randint(0, 20, (11,), generator=g), torch.randint(0, 4, (11,), generator=g)
    assert rel_err(span_rebuild(coef, basis, row, span), span_rebuild_reference(coef, basis, row, span)) < 1e-5
    with pytest.raises(ValueError, match=r"coef must be \[P, Hkv, R\] and basis \[S, Hkv, R, D\]"):
        span_rebuild(coef[0], basis, row, span)
