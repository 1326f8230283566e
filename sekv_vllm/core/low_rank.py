"""Per-span, per-KV-head rank-r SVD bases and the rebuild of token rows from them.

A span's rows X [|S|, D] (one KV head) are stored as coefficients C = U_r diag(s_r) = X V_r
[|S|, r] and a basis B = V_r^T [r, D], with r = min(|S|, D, r_max); X_hat = C B.
V_r (the top right singular vectors) comes from the symmetric eigendecomposition of the
Gram matrix X^T X: the same subspace as a truncated SVD at half its cost on CPU, and since
C = X V_r with V_r orthonormal, r = rank(X) rebuilds X exactly. (The reference code's
randomized SVD only approximates the subspace.)
Coefficients are stored per token, spans back to back, so no padding is kept.
When the factors would take more bytes than the rows themselves (r (|S| + D) >= |S| D, e.g.
every span at r = |S| <= r_max), `rows_if_smaller` keeps the rebuilt rows instead (basis None):
the same values, fewer bytes in the host pool, and less work to attend.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from sekv_vllm.core.span_summary import span_token_index


@dataclass(frozen=True)
class SpanBases:
    """Low-rank factors of every span of one layer, for keys or for values.

    coef:       [P, Hkv, R]    U diag(s) rows, P = total span tokens, spans in order; [P, Hkv, D]
                               the token rows themselves when basis is None
    basis:      [S, Hkv, R, D] V^T of each span (rows past a span's rank are zero), or None
    row_offset: [S] int64      first row of each span in `coef`
    span_len:   [S] int64
    """

    coef: torch.Tensor
    basis: torch.Tensor | None
    row_offset: torch.Tensor
    span_len: torch.Tensor

    @property
    def nbytes(self) -> int:
        parts = (self.coef, self.basis, self.row_offset, self.span_len)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)

    @property
    def factored(self) -> bool:
        return self.basis is not None


Eigh = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def fit_span_bases(
    x: torch.Tensor, span_start: torch.Tensor, span_len: torch.Tensor, r_max: int, eigh: Eigh = torch.linalg.eigh
) -> SpanBases:
    """Rank-r factors of each span of x.

    x: [T, Hkv, D]; span_start, span_len: [S] int64
    eigh: `torch.linalg.eigh` or a solver that returns the same (e.g. `ops.small_eigh`)
    """
    T, Hkv, D = x.shape
    S = span_start.numel()
    row_offset = torch.cumsum(span_len, 0) - span_len
    if S == 0:
        return SpanBases(x.new_zeros(0, Hkv, 0), x.new_zeros(0, Hkv, 0, D), row_offset, span_len)
    xs, valid = _padded_spans(x, span_start, span_len)  # [S, Hkv, L, D]
    L = xs.shape[2]
    R = min(L, D, r_max)
    if L < D:
        coef, basis = _top_factors_by_rows(xs, R, eigh)
    else:
        _, eigvec = eigh(xs.mT @ xs)  # ascending eigenvalues: the top R are last
        v_r = eigvec[..., -R:].flip(-1)  # [S, Hkv, D, R]
        coef, basis = xs @ v_r, v_r.mT
    coef = coef.permute(0, 2, 1, 3)[valid]  # [P, Hkv, R]
    return SpanBases(coef.to(x.dtype).contiguous(), basis.to(x.dtype).contiguous(), row_offset, span_len)


def _padded_spans(x: torch.Tensor, span_start: torch.Tensor, span_len: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, Hkv, D] -> (xs [S, Hkv, L, D] float32, each span's rows padded with zero rows to L = the longest,
    valid [S, L] bool). Zero rows change neither a span's Gram matrix's nonzero spectrum nor its subspace."""
    index, valid = span_token_index(span_start, span_len)
    return (x.float()[index] * valid[:, :, None, None]).permute(0, 2, 1, 3).contiguous(), valid


def _top_factors_by_rows(xs: torch.Tensor, R: int, eigh: Eigh) -> tuple[torch.Tensor, torch.Tensor]:
    """U_r diag(s_r) and V_r^T of xs [S, Hkv, L, D] with L < D, from the smaller Gram matrix X X^T
    (an L x L eigendecomposition: ~2.5x cheaper than D x D at L = D / 2): V_r^T = diag(1 / s_r) U_r^T X.
    Directions with s ~ 0 (padding, rank deficiency) get a zero basis row: their coefficients are ~0
    too, so the rebuild C B = U_r U_r^T X loses nothing.
    returns coef [S, Hkv, L, R], basis [S, Hkv, R, D]
    """
    evals, u = eigh(xs @ xs.mT)  # ascending: the top R are last
    u_r = u[..., -R:].flip(-1)  # [S, Hkv, L, R]
    s_r = evals[..., -R:].flip(-1).clamp_min(0).sqrt()  # [S, Hkv, R]
    tiny = s_r <= s_r[..., :1] * 1e-5
    inv = torch.where(tiny, torch.zeros_like(s_r), 1 / s_r.masked_fill(tiny, 1))
    return u_r * s_r.masked_fill(tiny, 0)[..., None, :], (u_r * inv[..., None, :]).mT @ xs


def gated_span_rows(
    x: torch.Tensor, span_start: torch.Tensor, span_len: torch.Tensor,
    gates_of: Callable[[torch.Tensor], torch.Tensor | None], eigh: Eigh = torch.linalg.eigh,
) -> SpanBases | None:
    """The spans' rows with every singular direction scaled by its gate, kept as rows (basis None):
    X' = U diag(g) U^T X per span and KV head (X = U diag(s) V^T), what `as_rows(gate_bases(fit_span_bases(x,
    ..., r_max), g))` keeps when r_max >= every span's length, without making the factors.

    x: [T, Hkv, D]; span_start, span_len: [S] int64 (S >= 1)
    gates_of(singular [S, Hkv, R] float32, descending, R = min(L, D)) -> g [S, Hkv, R], or None (then None)
    eigh: as `fit_span_bases`'s
    """
    D = x.shape[2]
    xs, valid = _padded_spans(x, span_start, span_len)  # [S, Hkv, L, D]
    L = xs.shape[2]
    # The smaller Gram matrix: X X^T (L x L, its eigenvectors U) or X^T X (D x D, V; X' = X V diag(g) V^T).
    by_rows = L < D
    evals, vecs = eigh(xs @ xs.mT if by_rows else xs.mT @ xs)  # ascending
    R = min(L, D)
    vecs, s = vecs[..., -R:].flip(-1), evals[..., -R:].flip(-1).clamp_min(0).sqrt()
    if by_rows:  # directions with s ~ 0 carry nothing; `fit_span_bases` gives them s = 0
        s = s.masked_fill(s <= s[..., :1] * 1e-5, 0)
    gates = gates_of(s)
    if gates is None:
        return None
    project = (vecs * gates[..., None, :]) @ vecs.mT
    rows = project @ xs if by_rows else xs @ project  # [S, Hkv, L, D]
    row_offset = torch.cumsum(span_len, 0) - span_len
    return SpanBases(rows.permute(0, 2, 1, 3)[valid].to(x.dtype).contiguous(), None, row_offset, span_len)


def span_rows(x: torch.Tensor, span_start: torch.Tensor, span_len: torch.Tensor) -> SpanBases:
    """The spans of x [T, Hkv, D] kept as their rows (basis None): what `fit_span_bases` followed by
    `rows_if_smaller` keeps when r_max >= every span's length, without a decomposition."""
    index, valid = span_token_index(span_start, span_len)
    row_offset = torch.cumsum(span_len, 0) - span_len
    return SpanBases(x[index[valid]].contiguous(), None, row_offset, span_len)


def rows_if_smaller(bases: SpanBases) -> SpanBases:
    """The bases as rebuilt token rows (basis None) when those take no more bytes than the factors."""
    if not bases.factored or bases.span_len.numel() == 0:
        return bases
    P, Hkv, R = bases.coef.shape
    D = bases.basis.shape[-1]
    if P * Hkv * D > bases.coef.numel() + bases.basis.numel():
        return bases
    return as_rows(bases)


def as_rows(bases: SpanBases) -> SpanBases:
    """The same spans with the host pool keeping their rebuilt rows (basis None)."""
    if not bases.factored:
        return bases
    (rows,), _ = rebuild_spans_of(torch.arange(bases.span_len.numel(), device=bases.span_len.device), bases)
    return SpanBases(rows.to(bases.coef.dtype).contiguous(), None, bases.row_offset, bases.span_len)


def append_span_bases(first: SpanBases, more: SpanBases) -> SpanBases:
    """The spans of `first`, then those of `more`, in the same form (both factored or both rows);
    factors of different ranks are zero-padded to the larger (a zero column rebuilds nothing)."""
    if first.factored != more.factored:
        raise ValueError("append_span_bases: both must keep factors or both rows")
    coef_a, coef_b, basis_a, basis_b = first.coef, more.coef, first.basis, more.basis
    if first.factored:
        R = max(coef_a.shape[2], coef_b.shape[2])
        coef_a, coef_b = (torch.nn.functional.pad(c, (0, R - c.shape[2])) for c in (coef_a, coef_b))
        basis_a, basis_b = (torch.nn.functional.pad(b, (0, 0, 0, R - b.shape[2])) for b in (basis_a, basis_b))
    return SpanBases(
        torch.cat([coef_a, coef_b]).contiguous(),
        torch.cat([basis_a, basis_b]).contiguous() if first.factored else None,
        torch.cat([first.row_offset, more.row_offset + first.coef.shape[0]]),
        torch.cat([first.span_len, more.span_len]),
    )


def rebuild_spans(bases: SpanBases, span_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows of the chosen spans, rebuilt from their factors.

    span_ids: [Z] int64 spans to rebuild
    returns (rows [M, Hkv, D] float32, row_span [M] int64 span id of each row), M = sum of lengths
    """
    (rows,), row_span = rebuild_spans_of(span_ids, bases)
    return rows, row_span


def rebuild_spans_of(span_ids: torch.Tensor, *bases: SpanBases) -> tuple[list[torch.Tensor], torch.Tensor]:
    """`rebuild_spans` for several factorisations of the same spans (keys and values),
    sharing the row index. Returns ([rows [M, Hkv, D] float32 per bases], row_span [M])."""
    first = bases[0]
    Hkv, D = first.coef.shape[1], (first.basis.shape[3] if first.factored else first.coef.shape[2])
    if span_ids.numel() == 0:
        return [first.coef.new_zeros(0, Hkv, D, dtype=torch.float32) for _ in bases], span_ids.new_zeros(0)
    index, valid = span_token_index(first.row_offset[span_ids], first.span_len[span_ids])  # [Z, L]
    out = []
    for b in bases:
        if not b.factored:
            out.append(b.coef.float()[index][valid])
            continue
        coef = b.coef.float()[index].permute(0, 2, 1, 3)  # [Z, Hkv, L, R]
        rows = torch.matmul(coef, b.basis.float()[span_ids])  # [Z, Hkv, L, D]
        out.append(rows.permute(0, 2, 1, 3)[valid])
    return out, span_ids[:, None].expand_as(index)[valid]


def span_factors(bases: SpanBases, span_ids: torch.Tensor, heads: torch.Tensor, length: int,
                 rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The factors of chosen (span, KV head) pairs, padded to a common shape, no row rebuilt.

    span_ids, heads: [P] int64; length >= their longest span; rank >= the stored rank (>= D when
    the bases hold rows: the rows are the coefficients of the identity basis)
    returns (coef [P, length, rank] float32, zero past each span's end and past its rank;
             basis [P, rank, D] float32)
    """
    if bases.factored:
        S, Hkv, R, D = bases.basis.shape
    else:
        S, Hkv, R = bases.span_len.numel(), bases.coef.shape[1], bases.coef.shape[2]
        D = R
    o_l = torch.arange(length, device=span_ids.device)
    lens = bases.span_len[span_ids][:, None]
    rows = bases.row_offset[span_ids][:, None] + torch.minimum(o_l[None, :], lens - 1)  # [P, length]
    # One flat gather each (row * Hkv + head): far cheaper on CPU than two-tensor indexing.
    coef = bases.coef.reshape(-1, R).index_select(0, (rows * Hkv + heads[:, None]).flatten())
    coef = coef.view(-1, length, R).float() * (o_l[None, :] < lens)[..., None]  # [P, length, R]
    if bases.factored:
        basis = bases.basis.reshape(S * Hkv, R, D).index_select(0, span_ids * Hkv + heads).float()  # [P, R, D]
    else:
        basis = torch.eye(D, device=bases.coef.device).expand(span_ids.numel(), D, D)
    if rank > R:
        coef = torch.nn.functional.pad(coef, (0, rank - R))
        basis = torch.nn.functional.pad(basis, (0, 0, 0, rank - R))
    return coef, basis


def span_of_rows(bases: SpanBases) -> torch.Tensor:
    """[P] int64: the span of every coefficient row."""
    return torch.repeat_interleave(torch.arange(bases.span_len.numel(), device=bases.span_len.device), bases.span_len)


def singular_values(bases: SpanBases) -> torch.Tensor:
    """[S, Hkv, R] float32 singular values of each span (coef = U diag(s), so s = column norms)."""
    S, Hkv, R = bases.basis.shape[0], bases.coef.shape[1], bases.coef.shape[2]
    sq = torch.zeros(S, Hkv, R, dtype=torch.float32, device=bases.coef.device).index_add_(0, span_of_rows(bases), bases.coef.float() ** 2)
    return sq.sqrt()


def gate_bases(bases: SpanBases, gates: torch.Tensor) -> SpanBases:
    """The factors rebuilding U diag(g * s) V^T: gates [S, Hkv, R] scale each span's coefficients."""
    coef = (bases.coef.float() * gates[span_of_rows(bases)]).to(bases.coef.dtype)
    return SpanBases(coef, bases.basis, bases.row_offset, bases.span_len)
