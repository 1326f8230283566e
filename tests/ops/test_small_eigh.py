"""The C++ eigensolver (Householder tridiagonalisation and implicit QL, 16 matrices per SIMD register) against
torch.linalg.eigh."""
import pytest
import torch

from sekv_vllm.core import segment_prompt
from sekv_vllm.core.low_rank import gated_span_rows
from sekv_vllm.ops.small_eigh import load_small_eigh, small_eigh
from sekv_vllm.ops.cpu_build import KernelBuildError


@pytest.fixture(scope="module", autouse=True)
def kernel_or_skip():
    try:
        load_small_eigh()
    except KernelBuildError as err:
        pytest.skip(f"C++ eigensolver not buildable here: {err}")


def gram(batch, n, rank, seed):
    """Gram matrices X X^T of rows X [n, 64] of the given rank, of scales from 1e-2 to 1e2."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*batch, n, rank, generator=g) @ torch.randn(*batch, rank, 64, generator=g)
    x = x * 10 ** (torch.rand(*batch, 1, 1, generator=g) * 4 - 2)
    return x @ x.mT


@pytest.mark.parametrize("batch, n, rank", [((37,), 32, 32), ((3, 5), 32, 7), ((16,), 8, 8), ((1,), 1, 1),
                                            ((21,), 64, 64), ((18,), 32, 64)])
def test_the_decomposition_equals_torchs(batch, n, rank):
    """Batches not a multiple of 16, rank-deficient (padded spans), n of 1 to 64."""
    a = gram(batch, n, rank, seed=n + rank)
    evals, vecs = small_eigh(a)
    want, want_vecs = torch.linalg.eigh(a)
    scale = a.abs().amax(dim=(-2, -1), keepdim=True)
    assert evals.shape == want.shape and vecs.shape == want_vecs.shape
    assert ((evals - want).abs() <= 1e-5 * scale[..., 0]).all()  # ascending, as torch's
    assert torch.allclose(vecs.mT @ vecs, torch.eye(n).expand_as(vecs), atol=1e-4)  # orthonormal
    assert ((vecs * evals[..., None, :]) @ vecs.mT - a).abs().le(1e-5 * scale).all()  # rebuilds a
    # each eigenvector equals torch's up to its sign where its eigenvalue stands apart from the others
    gap = torch.cat([want.diff(dim=-1), torch.full_like(want[..., :1], float("inf"))], dim=-1)
    gap = torch.minimum(gap, torch.cat([torch.full_like(want[..., :1], float("inf")), want.diff(dim=-1)], dim=-1))
    apart = gap > 1e-2 * scale[..., 0]
    agree = (vecs * want_vecs).sum(dim=-2).abs()  # |cos| per eigenvector
    assert (agree[apart] > 1 - 1e-3).all()


def test_indefinite_repeated_and_already_diagonal_matrices():
    g = torch.Generator().manual_seed(5)
    sym = torch.randn(20, 32, 32, generator=g)
    cases = torch.cat([
        sym + sym.mT,  # indefinite
        torch.zeros(3, 32, 32),
        torch.eye(32).expand(3, 32, 32) * 2.0,  # one eigenvalue, 32 times
        torch.diag_embed(torch.randn(5, 32, generator=g)),  # already diagonal: nothing to rotate
        torch.block_diag(torch.ones(16, 16), torch.zeros(16, 16))[None],  # rank 1 among zeros
    ])
    evals, vecs = small_eigh(cases)
    want = torch.linalg.eigvalsh(cases)
    scale = cases.abs().amax(dim=(-2, -1)).clamp(min=1.0)
    assert ((evals - want).abs() <= 1e-5 * scale[:, None]).all()
    assert torch.allclose(vecs.mT @ vecs, torch.eye(32).expand_as(vecs), atol=1e-4)
    assert ((vecs * evals[..., None, :]) @ vecs.mT - cases).abs().le(1e-5 * scale[:, None, None]).all()


def test_gated_rows_are_the_same_with_either_solver():
    g = torch.Generator().manual_seed(3)
    T, Hkv, D = 600, 3, 64
    k = torch.randn(T, Hkv, D, generator=g) * (torch.rand(T, 1, 1, generator=g) + 0.5)
    layout = segment_prompt(torch.rand(T, generator=g) * 5, window=16, alpha=1.0, l_min=4, max_span=32)

    def gates_of(singular):
        return torch.sigmoid(singular / singular[..., :1].clamp(min=1e-12) * 4 - 1)

    want = gated_span_rows(k, layout.span_start, layout.span_len, gates_of)
    got = gated_span_rows(k, layout.span_start, layout.span_len, gates_of, eigh=small_eigh)
    assert torch.allclose(got.coef, want.coef, atol=1e-4 * float(k.abs().max()))


def test_bad_input_is_refused():
    with pytest.raises(RuntimeError, match="float32"):
        small_eigh(torch.eye(4, dtype=torch.float64)[None])
