"""Triton kernel: rebuild token rows of zoomed spans from their low-rank factors.

out[m, h, :] = coef[row[m], h, :] @ basis[span[m], h, :, :]
Float32 torch twin: `sekv_vllm.ops.span_rebuild.span_rebuild_reference`.
"""
import triton
import triton.language as tl


@triton.jit
def span_rebuild_kernel(
    p_coef,  # [P, Hkv, R]
    p_basis,  # [S, Hkv, R, D]
    p_row,  # [M] int64: coef row of each output row
    p_span,  # [M] int64: span of each output row
    p_out,  # [M, Hkv, D] float32
    Hkv,
    R,
    D,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    i_m = tl.program_id(0)
    i_h = tl.program_id(1)
    # int64 offsets: P * Hkv * R and S * Hkv * R * D overflow int32 on long prompts.
    row = tl.load(p_row + i_m).to(tl.int64)
    span = tl.load(p_span + i_m).to(tl.int64)
    o_r = tl.arange(0, BLOCK_R)
    o_d = tl.arange(0, BLOCK_D)
    m_r = o_r < R
    m_d = o_d < D
    b_c = tl.load(p_coef + (row * Hkv + i_h) * R + o_r, mask=m_r, other=0.0).to(tl.float32)
    o_basis = ((span * Hkv + i_h) * R + o_r[:, None]) * D + o_d[None, :]
    b_b = tl.load(p_basis + o_basis, mask=m_r[:, None] & m_d[None, :], other=0.0).to(tl.float32)
    b_out = tl.sum(b_c[:, None] * b_b, axis=0)
    tl.store(p_out + (i_m.to(tl.int64) * Hkv + i_h) * D + o_d, b_out, mask=m_d)


def span_rebuild_triton(coef, basis, row, span):
    """Launcher. coef [P, Hkv, R], basis [S, Hkv, R, D], row/span [M] int64 -> [M, Hkv, D] float32."""
    import torch

    P, Hkv, R = coef.shape
    S, Hkv_b, R_b, D = basis.shape
    assert (Hkv, R) == (Hkv_b, R_b), "coef and basis disagree on Hkv or R"
    assert row.shape == span.shape and row.dim() == 1
    M = row.numel()
    out = torch.empty(M, Hkv, D, dtype=torch.float32, device=coef.device)
    if M == 0:
        return out
    grid = (M, Hkv)
    span_rebuild_kernel[grid](
        coef.contiguous(), basis.contiguous(), row.contiguous(), span.contiguous(), out,
        Hkv, R, D, BLOCK_R=triton.next_power_of_2(R), BLOCK_D=triton.next_power_of_2(D),
    )
    return out
