"""Our Triton RMSNorm kernels: plain, after a residual addition, per head with the rotary embedding, gated.

`rms_norm`, `add_rms_norm`, `norm_rotate` and `rms_norm_gated` are single-launch kernels (CUDA
only) for the same math as FLA's; `dohnuts.ops.kernels` passes Qwen3.5's `1 + weight` scale.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_common import REQUEST_ROWS, _norm_grad, _on, _row_tile, _rows_layout

# -- RMSNorm ---------------------------------------------------------------------------------------
#
# The same math as FLA's fused kernels, launched with one call and no autotuning, so a training
# step (host-bound: its layers issue thousands of launches) spends microseconds, not a quarter
# of a millisecond, of host time on each.

ROWS = 16  # rows per RMSNorm program


@triton.jit(do_not_specialize=REQUEST_ROWS)
def _rms_norm_fwd(x, scale, y, rstd, R, B, s0, s1, eps, D: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr):
    # Row r of the [A, B, D] input lies at (r // B) * s0 + (r % B) * s1; the output is contiguous.
    rows, cols, m_r, m = _row_tile(R, D, BR, BD)
    start = (rows // B) * s0 + (rows % B) * s1
    xs = tl.load(x + start[:, None] + cols[None, :], mask=m, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(xs * xs, axis=1) / D + eps)
    w = tl.load(scale + cols, mask=cols < D, other=0.0).to(tl.float32)
    tl.store(y + rows[:, None] * D + cols[None, :], (xs * r[:, None] * w[None, :]).to(y.dtype.element_ty), mask=m)
    tl.store(rstd + rows, r, mask=m_r)


@triton.jit(do_not_specialize=REQUEST_ROWS)
def _rms_norm_bwd(x, scale, rstd, dy, dx, R, B, s0, s1, D: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr):
    rows, cols, m_r, m = _row_tile(R, D, BR, BD)
    start = (rows // B) * s0 + (rows % B) * s1
    xs = tl.load(x + start[:, None] + cols[None, :], mask=m, other=0.0).to(tl.float32)
    r = tl.load(rstd + rows, mask=m_r, other=0.0)
    w = tl.load(scale + cols, mask=cols < D, other=0.0).to(tl.float32)
    g = tl.load(dy + rows[:, None] * D + cols[None, :], mask=m, other=0.0).to(tl.float32) * w[None, :]
    grad = _norm_grad(g, xs * r[:, None], r, D)  # y = (x r) w, so g = dy w
    tl.store(dx + rows[:, None] * D + cols[None, :], grad.to(dx.dtype.element_ty), mask=m)


def _norm_launch(width: int) -> tuple[int, int, int]:
    """(block, rows per program, warps) of a norm over `width` channels: about 4,096 elements a
    program, so the float32 tiles stay in registers."""
    block = triton.next_power_of_2(max(width, 1))
    return block, max(1, min(ROWS, 4096 // block)), 4 if block <= 512 else 8


class RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale, eps):
        x, (count, inner, s0, s1) = _rows_layout(x)
        width = x.shape[-1]
        rows = count * inner
        y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
        block, per_program, warps = _norm_launch(width)
        with _on(x.device):
            _rms_norm_fwd[(triton.cdiv(rows, per_program),)](x, scale, y, rstd, rows, inner, s0, s1, eps, width,
                                                             per_program, block, num_warps=warps)
        ctx.save_for_backward(x, scale, rstd)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x, scale, rstd = ctx.saved_tensors
        return (*_rms_norm_grads(x, scale, rstd, dy, ctx.needs_input_grad[1]), None)


def _rms_norm_grads(x, scale, rstd, dy, scale_grad: bool):
    """(dx, dscale or None) of y = x / rms(x) * scale from dy, with the forward's rstd."""
    # The layout of the x handed back, which a saved-tensor hook may have repacked.
    x, (count, inner, s0, s1) = _rows_layout(x)
    width = x.shape[-1]
    rows = count * inner
    dy = dy.contiguous()
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    block, per_program, warps = _norm_launch(width)
    with _on(x.device):
        _rms_norm_bwd[(triton.cdiv(rows, per_program),)](x, scale, rstd, dy, dx, rows, inner, s0, s1, width,
                                                         per_program, block, num_warps=warps)
    dscale = None
    if scale_grad:  # the recipe's norms are frozen: rarely needed, so plain PyTorch
        normed = x.float().reshape(rows, width) * rstd[:, None]
        dscale = (dy.float().reshape(rows, width) * normed).sum(0).to(scale.dtype)
    return dx, dscale


def rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * scale over the last axis, in float32, returned in x's dtype (contiguous).
    x: [T, D] or [T, H, D] (any strides with unit stride along D); scale: [D]."""
    if scale.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm: scale {tuple(scale.shape)} does not match x {tuple(x.shape)}")
    return RMSNorm.apply(x, scale.contiguous(), eps)


@triton.jit(do_not_specialize=REQUEST_ROWS)
def _add_rms_norm_fwd(x, residual, scale, total, y, rstd, R, eps, D: tl.constexpr, BR: tl.constexpr,
                      BD: tl.constexpr):
    # The sum is rounded to x's dtype, then normed: as an addition followed by RMSNorm would.
    rows, cols, m_r, m = _row_tile(R, D, BR, BD)
    offsets = rows[:, None] * D + cols[None, :]
    added = (tl.load(x + offsets, mask=m, other=0.0).to(tl.float32)
             + tl.load(residual + offsets, mask=m, other=0.0).to(tl.float32)).to(total.dtype.element_ty)
    tl.store(total + offsets, added, mask=m)
    xs = added.to(tl.float32)
    r = tl.rsqrt(tl.sum(xs * xs, axis=1) / D + eps)
    w = tl.load(scale + cols, mask=cols < D, other=0.0).to(tl.float32)
    tl.store(y + offsets, (xs * r[:, None] * w[None, :]).to(y.dtype.element_ty), mask=m)
    tl.store(rstd + rows, r, mask=m_r)


class AddRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, scale, eps):
        x, residual = x.contiguous(), residual.contiguous()
        width = x.shape[-1]
        rows = x.numel() // max(width, 1)
        total, y = torch.empty_like(x), torch.empty_like(x)
        rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
        block, per_program, warps = _norm_launch(width)
        with _on(x.device):
            _add_rms_norm_fwd[(triton.cdiv(rows, per_program),)](x, residual, scale, total, y, rstd, rows, eps, width,
                                                                 per_program, block, num_warps=warps)
        ctx.save_for_backward(total, scale, rstd)
        return total, y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dtotal, dy):
        # Autograd materialises an output's unused gradient as zeros: both arrive as tensors.
        total, scale, rstd = ctx.saved_tensors
        grad, dscale = _rms_norm_grads(total, scale, rstd, dy, ctx.needs_input_grad[2])
        grad = grad + dtotal
        return grad, grad, dscale, None


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, scale: torch.Tensor, eps: float):
    """(x + residual, its RMSNorm times scale) in one pass: the sum in x's dtype, the norm in
    float32 from it, returned in x's dtype. x, residual: [..., D] of one shape; scale: [D]."""
    if residual.shape != x.shape or residual.dtype != x.dtype or scale.shape != x.shape[-1:]:
        raise ValueError(f"add_rms_norm: x {tuple(x.shape)} {x.dtype}, residual {tuple(residual.shape)} "
                         f"{residual.dtype} and scale {tuple(scale.shape)} do not fit together")
    return AddRMSNorm.apply(x, residual, scale.contiguous(), eps)


# -- RMSNorm of attention heads fused with the partial rotary embedding ----------------------------
#
# Attention's query and key are normed per head, then their first R channels rotated: apart,
# that is a norm and six elementwise kernels (negate, two concatenations, two products, a sum)
# per tensor, 84 launches a Qwen3.5-0.8B forward. `norm_rotate` does both in one pass.


@triton.jit(do_not_specialize=REQUEST_ROWS)
def _norm_rotate_fwd(x, scale, cos, sin, y, rstd, R, H, s0, s1, eps, D: tl.constexpr, ROT: tl.constexpr,
                     BR: tl.constexpr, BD: tl.constexpr):
    # Row r is head r % H of token r // H, at (r // H) * s0 + (r % H) * s1; y is contiguous.
    rows, cols, m_r, m = _row_tile(R, D, BR, BD)
    token = rows // H
    start = token * s0 + (rows % H) * s1
    xs = tl.load(x + start[:, None] + cols[None, :], mask=m, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(xs * xs, axis=1) / D + eps)
    w = tl.load(scale + cols, mask=cols < D, other=0.0).to(tl.float32)
    normed = xs * r[:, None] * w[None, :]
    # The first ROT channels turn: channel j < ROT/2 pairs with j + ROT/2, y_j = n_j cos - n_pair sin,
    # and y_pair = n_pair cos + n_j sin (the tables repeat each frequency in both halves).
    turning = cols < ROT
    pair = tl.where(cols < ROT // 2, cols + ROT // 2, cols - ROT // 2)
    m_turn = m_r[:, None] & turning[None, :]
    partner = tl.load(x + start[:, None] + pair[None, :], mask=m_turn, other=0.0).to(tl.float32)
    partner = partner * r[:, None] * tl.load(scale + pair, mask=turning, other=0.0).to(tl.float32)[None, :]
    at = token[:, None] * ROT + cols[None, :]
    c = tl.load(cos + at, mask=m_turn, other=1.0).to(tl.float32)
    s = tl.load(sin + at, mask=m_turn, other=0.0).to(tl.float32)
    sign = tl.where(cols < ROT // 2, -1.0, 1.0)
    out = tl.where(turning[None, :], normed * c + sign[None, :] * partner * s, normed)
    tl.store(y + rows[:, None] * D + cols[None, :], out.to(y.dtype.element_ty), mask=m)
    tl.store(rstd + rows, r, mask=m_r)


class NormRotate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale, cos, sin, eps):
        if x.stride(-1) != 1:
            x = x.contiguous()
        total, heads, width = x.shape
        rows = total * heads
        y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
        cos, sin = cos.contiguous(), sin.contiguous()
        block, per_program, warps = _norm_launch(width)
        with _on(x.device):
            _norm_rotate_fwd[(triton.cdiv(rows, per_program),)](x, scale, cos, sin, y, rstd, rows, heads, x.stride(0),
                                                                x.stride(1), eps, width, cos.shape[-1], per_program,
                                                                block, num_warps=warps)
        ctx.save_for_backward(x, scale, cos, sin, rstd)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x, scale, cos, sin, rstd = ctx.saved_tensors
        # Undo the turn (its transpose), then the norm's gradient.
        half = cos.shape[-1] // 2
        c, s = cos[:, None, :half].float(), sin[:, None, :half].float()
        first, second, rest = dy.float().split([half, half, dy.shape[-1] - 2 * half], dim=-1)
        dnormed = torch.cat([first * c + second * s, second * c - first * s, rest], dim=-1)
        dx, dscale = _rms_norm_grads(x, scale, rstd, dnormed, ctx.needs_input_grad[1])
        return dx, dscale, None, None, None


def norm_rotate(x: torch.Tensor, scale: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * scale over the last axis, then its first R channels turned by the rotary
    tables, in float32, returned in x's dtype (contiguous).

    Args:
        x: [T, H, D] (any strides with unit stride along D); scale: [D].
        cos, sin: [T, R] rotary tables, each frequency in both halves (R even, at most D), as
            `decoder.rotary_tables` makes them: the backward reads the first half only.
    """
    if x.dim() != 3 or scale.shape != x.shape[-1:]:
        raise ValueError(f"norm_rotate: x {tuple(x.shape)} must be [T, H, D] with a scale of D, got "
                         f"{tuple(scale.shape)}")
    if cos.shape != sin.shape or cos.shape[0] != x.shape[0] or cos.shape[-1] % 2 or cos.shape[-1] > x.shape[-1]:
        raise ValueError(f"norm_rotate: tables cos {tuple(cos.shape)} and sin {tuple(sin.shape)} do not fit x "
                         f"{tuple(x.shape)}")
    return NormRotate.apply(x, scale.contiguous(), cos, sin, eps)


# The vision tower's query and key are turned over all their channels (no norm), each in float32:
# in plain PyTorch a conversion, a negation, a concatenation, two products and a sum per tensor,
# then copies of q, k and v out of the qkv product, some 17 launches a block. `split_rotate` reads
# the qkv output in place and writes q and k turned and v, contiguous, in one (forward only: the
# tower is frozen).


@triton.jit
def _turned(qkv, base, cols, pair, sign, c, s, m):
    """A [BR, D] tile of heads starting at base, turned: x cos + sign x_pair sin, float32."""
    xs = tl.load(qkv + base[:, None] + cols[None, :], mask=m, other=0.0).to(tl.float32)
    partner = tl.load(qkv + base[:, None] + pair[None, :], mask=m, other=0.0).to(tl.float32)
    return xs * c + sign[None, :] * partner * s


@triton.jit(do_not_specialize=REQUEST_ROWS)
def _split_rotate_fwd(qkv, cos, sin, q, k, v, R, H, stride, D: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr):
    # Row r is head r % H of token r // H: its query at (r // H) * stride + (r % H) * D, its key
    # H * D further, its value 2 H D further; q, k and v are contiguous [T, H, D]. Channel j < D/2
    # pairs with j + D/2 (the tables repeat each frequency in both halves).
    rows, cols, m_r, m = _row_tile(R, D, BR, BD)
    token = rows // H
    start = token * stride + (rows % H) * D
    pair = tl.where(cols < D // 2, cols + D // 2, cols - D // 2)
    sign = tl.where(cols < D // 2, -1.0, 1.0)
    at = token[:, None] * D + cols[None, :]
    c = tl.load(cos + at, mask=m, other=1.0).to(tl.float32)
    s = tl.load(sin + at, mask=m, other=0.0).to(tl.float32)
    out = rows[:, None] * D + cols[None, :]
    tl.store(q + out, _turned(qkv, start, cols, pair, sign, c, s, m).to(q.dtype.element_ty), mask=m)
    tl.store(k + out, _turned(qkv, start + H * D, cols, pair, sign, c, s, m).to(k.dtype.element_ty), mask=m)
    tl.store(v + out, tl.load(qkv + start[:, None] + 2 * H * D + cols[None, :], mask=m), mask=m)


def split_rotate(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """(q, k, v), each [T, H, D] contiguous in qkv's dtype, of qkv [T, 3, H, D] (its last three
    axes contiguous, as a linear layer's output viewed so), q and k turned over all D channels by
    cos, sin [T, D] (each frequency in both halves) in float32. No gradient."""
    total, three, heads, width = qkv.shape
    if three != 3 or width % 2 or qkv.stride(3) != 1 or qkv.stride(2) != width or qkv.stride(1) != heads * width:
        raise ValueError(f"split_rotate: qkv {tuple(qkv.shape)} with strides {qkv.stride()} is not [T, 3, H, D] "
                         f"with its last three axes contiguous")
    if cos.shape != (total, width) or sin.shape != cos.shape:
        raise ValueError(f"split_rotate: tables cos {tuple(cos.shape)} and sin {tuple(sin.shape)} do not fit qkv "
                         f"{tuple(qkv.shape)}")
    q, k, v = (torch.empty(total, heads, width, dtype=qkv.dtype, device=qkv.device) for _ in range(3))
    rows = total * heads
    block, per_program, warps = _norm_launch(width)
    with _on(qkv.device):
        _split_rotate_fwd[(triton.cdiv(rows, per_program),)](qkv, cos.contiguous(), sin.contiguous(), q, k, v, rows,
                                                             heads, qkv.stride(0), width, per_program, block,
                                                             num_warps=warps)
    return q, k, v


@triton.jit(do_not_specialize=REQUEST_ROWS)
def _rms_norm_gated_fwd(x, gate, weight, y, rstd, R, eps, GB, gs0, gs1, D: tl.constexpr, BR: tl.constexpr,
                        BD: tl.constexpr):
    # Row r of the gate lies at (r // GB) * gs0 + (r % GB) * gs1 (a column block of a wider
    # projection output is read in place); x and y are contiguous.
    rows, cols, m_r, m = _row_tile(R, D, BR, BD)
    offsets = rows[:, None] * D + cols[None, :]
    xs = tl.load(x + offsets, mask=m, other=0.0).to(tl.float32)
    gate_start = (rows // GB) * gs0 + (rows % GB) * gs1
    zs = tl.load(gate + gate_start[:, None] + cols[None, :], mask=m, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(xs * xs, axis=1) / D + eps)
    w = tl.load(weight + cols, mask=cols < D, other=0.0).to(tl.float32)
    out = xs * r[:, None] * w[None, :] * (zs * tl.sigmoid(zs))
    tl.store(y + offsets, out.to(y.dtype.element_ty), mask=m)
    tl.store(rstd + rows, r, mask=m_r)


@triton.jit(do_not_specialize=REQUEST_ROWS)
def _rms_norm_gated_bwd(x, gate, weight, rstd, dy, dx, dgate, R, D: tl.constexpr, BR: tl.constexpr,
                        BD: tl.constexpr):
    rows, cols, m_r, m = _row_tile(R, D, BR, BD)
    offsets = rows[:, None] * D + cols[None, :]
    xs = tl.load(x + offsets, mask=m, other=0.0).to(tl.float32)
    zs = tl.load(gate + offsets, mask=m, other=0.0).to(tl.float32)
    d = tl.load(dy + offsets, mask=m, other=0.0).to(tl.float32)
    r = tl.load(rstd + rows, mask=m_r, other=0.0)
    w = tl.load(weight + cols, mask=cols < D, other=0.0).to(tl.float32)
    sig = tl.sigmoid(zs)
    normed = xs * r[:, None]
    # y = n w silu(z): the gradient of n is dy w silu(z), then through the norm as in RMSNorm.
    grad_x = _norm_grad(d * w[None, :] * (zs * sig), normed, r, D)
    grad_z = d * normed * w[None, :] * sig * (1.0 + zs * (1.0 - sig))
    tl.store(dx + offsets, grad_x.to(dx.dtype.element_ty), mask=m)
    tl.store(dgate + offsets, grad_z.to(dgate.dtype.element_ty), mask=m)


class RMSNormGated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gate, weight, eps):
        x = x.contiguous()
        gate, (_, inner, s0, s1) = _rows_layout(gate)
        width = x.shape[-1]
        rows = x.numel() // max(width, 1)
        y = torch.empty_like(x)
        rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
        block, per_program, warps = _norm_launch(width)
        with _on(x.device):
            _rms_norm_gated_fwd[(triton.cdiv(rows, per_program),)](x, gate, weight, y, rstd, rows, eps, inner, s0, s1,
                                                                   width, per_program, block, num_warps=warps)
        ctx.save_for_backward(x, gate, weight, rstd)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x, gate, weight, rstd = ctx.saved_tensors
        gate = gate.contiguous()  # the backward reads it packed (a copy only for a column block)
        width = x.shape[-1]
        rows = x.numel() // max(width, 1)
        dy = dy.contiguous()
        dx, dgate = torch.empty_like(x), torch.empty_like(gate)
        block, per_program, warps = _norm_launch(width)
        with _on(x.device):
            _rms_norm_gated_bwd[(triton.cdiv(rows, per_program),)](x, gate, weight, rstd, dy, dx, dgate, rows, width,
                                                                   per_program, block, num_warps=warps)
        dweight = None
        if ctx.needs_input_grad[2]:  # frozen in the recipe: plain PyTorch when it is not
            normed = x.float().reshape(rows, width) * rstd[:, None]
            silu = torch.nn.functional.silu(gate.float().reshape(rows, width))
            dweight = (dy.float().reshape(rows, width) * normed * silu).sum(0).to(weight.dtype)
        return dx, dgate, dweight, None


def rms_norm_gated(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * weight * silu(gate) over the last axis, in float32, returned in x's dtype.
    x, gate: [..., D] of one shape; weight: [D]."""
    if gate.shape != x.shape or weight.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm_gated: gate {tuple(gate.shape)} and weight {tuple(weight.shape)} do not match "
                         f"x {tuple(x.shape)}")
    return RMSNormGated.apply(x, gate, weight.contiguous(), eps)
