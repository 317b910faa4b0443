"""Our own Triton kernels, for CUDA only; `dohnuts.kernels` chooses them and holds their
plain-PyTorch references.

`split_heads` turns the delta rule's convolved q|k|v channels [T, 2*H*K + HV*V] into the
contiguous, L2-normalised q and k [T, H, K] and the contiguous v [T, HV, V] that
flash-linear-attention's chunked delta rule reads, in one pass. Done apart, this is three
strided copies (FLA makes its inputs contiguous) and two L2-norm passes inside FLA.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

EPS = 1e-6  # FLA's and Hugging Face's L2-norm epsilon, added to the sum of squares


@triton.jit
def _split_heads_fwd(mixed, q, k, v, rstd, T, stride, H: tl.constexpr, K: tl.constexpr, HV: tl.constexpr,
                     V: tl.constexpr, eps, BT: tl.constexpr, BD: tl.constexpr):
    # Program (token block, slot): slots 0..H-1 are q heads, H..2H-1 k heads, 2H.. v heads.
    i_t, i_s = tl.program_id(0), tl.program_id(1)
    o_t = (i_t * BT + tl.arange(0, BT)).to(tl.int64)
    o_d = tl.arange(0, BD)
    m_t = o_t < T
    if i_s < 2 * H:
        m = m_t[:, None] & (o_d[None, :] < K)
        x = tl.load(mixed + o_t[:, None] * stride + i_s * K + o_d[None, :], mask=m, other=0.0).to(tl.float32)
        r = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) + eps)
        y = (x * r[:, None]).to(q.dtype.element_ty)
        if i_s < H:
            tl.store(q + o_t[:, None] * (H * K) + i_s * K + o_d[None, :], y, mask=m)
        else:
            tl.store(k + o_t[:, None] * (H * K) + (i_s - H) * K + o_d[None, :], y, mask=m)
        tl.store(rstd + o_t * (2 * H) + i_s, r, mask=m_t)
    else:
        # Names apart from the other branch's: Triton wants one type per name across branches.
        m_v = m_t[:, None] & (o_d[None, :] < V)
        head = i_s - 2 * H
        x_v = tl.load(mixed + o_t[:, None] * stride + 2 * H * K + head * V + o_d[None, :], mask=m_v, other=0.0)
        tl.store(v + o_t[:, None] * (HV * V) + head * V + o_d[None, :], x_v, mask=m_v)


@triton.jit
def _split_heads_bwd(dmixed, q, k, rstd, dq, dk, dv, T, H: tl.constexpr, K: tl.constexpr, HV: tl.constexpr,
                     V: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    i_t, i_s = tl.program_id(0), tl.program_id(1)
    o_t = (i_t * BT + tl.arange(0, BT)).to(tl.int64)
    o_d = tl.arange(0, BD)
    m_t = o_t < T
    width = 2 * H * K + HV * V
    if i_s < 2 * H:
        m = m_t[:, None] & (o_d[None, :] < K)
        if i_s < H:
            offset = o_t[:, None] * (H * K) + i_s * K + o_d[None, :]
            y = tl.load(q + offset, mask=m, other=0.0).to(tl.float32)
            dy = tl.load(dq + offset, mask=m, other=0.0).to(tl.float32)
        else:
            offset = o_t[:, None] * (H * K) + (i_s - H) * K + o_d[None, :]
            y = tl.load(k + offset, mask=m, other=0.0).to(tl.float32)
            dy = tl.load(dk + offset, mask=m, other=0.0).to(tl.float32)
        r = tl.load(rstd + o_t * (2 * H) + i_s, mask=m_t, other=0.0)
        # y = x r with r = (|x|^2 + eps)^-1/2: dx = r (dy - (dy . y) y).
        dx = r[:, None] * (dy - tl.sum(dy * y, axis=1)[:, None] * y)
        tl.store(dmixed + o_t[:, None] * width + i_s * K + o_d[None, :], dx.to(dmixed.dtype.element_ty), mask=m)
    else:
        m_v = m_t[:, None] & (o_d[None, :] < V)
        head = i_s - 2 * H
        g_v = tl.load(dv + o_t[:, None] * (HV * V) + head * V + o_d[None, :], mask=m_v, other=0.0)
        tl.store(dmixed + o_t[:, None] * width + 2 * H * K + head * V + o_d[None, :], g_v.to(dmixed.dtype.element_ty),
                 mask=m_v)


BLOCK_TOKENS = 16


class SplitHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, mixed: torch.Tensor, heads: int, key_dim: int, value_heads: int, value_dim: int):
        total = mixed.shape[0]
        if mixed.stride(-1) != 1:
            mixed = mixed.contiguous()
        q = mixed.new_empty(total, heads, key_dim)
        k = mixed.new_empty(total, heads, key_dim)
        v = mixed.new_empty(total, value_heads, value_dim)
        rstd = mixed.new_empty(total, 2 * heads, dtype=torch.float32)
        block = triton.next_power_of_2(max(key_dim, value_dim))
        grid = (triton.cdiv(total, BLOCK_TOKENS), 2 * heads + value_heads)
        _split_heads_fwd[grid](mixed, q, k, v, rstd, total, mixed.stride(0), heads, key_dim, value_heads, value_dim,
                               EPS, BLOCK_TOKENS, block)
        ctx.save_for_backward(q, k, rstd)
        ctx.shape = (heads, key_dim, value_heads, value_dim, block)
        return q, k, v

    @staticmethod
    def backward(ctx, dq, dk, dv):
        q, k, rstd = ctx.saved_tensors
        heads, key_dim, value_heads, value_dim, block = ctx.shape
        total = q.shape[0]
        dq = torch.zeros_like(q) if dq is None else dq.contiguous()
        dk = torch.zeros_like(k) if dk is None else dk.contiguous()
        dv = q.new_zeros(total, value_heads, value_dim) if dv is None else dv.contiguous()
        dmixed = q.new_empty(total, 2 * heads * key_dim + value_heads * value_dim)
        grid = (triton.cdiv(total, BLOCK_TOKENS), 2 * heads + value_heads)
        _split_heads_bwd[grid](dmixed, q, k, rstd, dq, dk, dv, total, heads, key_dim, value_heads, value_dim,
                               BLOCK_TOKENS, block)
        return dmixed, None, None, None, None


def split_heads(mixed: torch.Tensor, heads: int, key_dim: int, value_heads: int, value_dim: int):
    """mixed [T, 2*H*K + HV*V] (unit stride along channels) -> (q [T, H, K], k [T, H, K], v [T, HV, V]),
    contiguous, q and k L2-normalised per head in float32."""
    return SplitHeads.apply(mixed, heads, key_dim, value_heads, value_dim)
