"""SwiGLU, silu(gate) * up, and the attention's output gate, x * sigmoid(gate), each as one
Triton kernel forward and one backward (CUDA)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_common import REQUEST_ELEMENTS, REQUEST_ROWS, _even_rows, _on, _row_tile, _rows_layout

# -- SwiGLU ----------------------------------------------------------------------------------------
#
# The same math as FLA's fused kernels, launched with one call and no autotuning, so a training
# step (host-bound: its layers issue thousands of launches) spends microseconds, not a quarter
# of a millisecond, of host time on each.

BLOCK = 1024  # elements per SwiGLU program
# Programs by rows (a row's block of BLOCK columns each) rather than by runs of BLOCK elements of
# the flattened output: no element then finds its row and column by a 64-bit division, which the
# GPU runs as a software routine of dozens of instructions an element (about as many as a
# bandwidth-bound kernel has time for). Alone on one H100 (`bench.kernel_sweep.elementwise_sweep`,
# run 2026-12-07-7501ba3-d44-sweep) by rows of 1,024 took 7.3 us at 1,500 tokens and 22.9 at
# 3,000, against 15.4 and 30.2 by runs; but one-question requests of those lengths ran 0.3 to 0.4
# ms slower with it on their second call (its process first, the default's after: runs -long-rows
# and -long-again), so it stays off until an A/B in both orders on the H200 says.
BY_ROWS = False
# Warps a SwiGLU forward program: Triton's default. At 3,000 tokens the forward moved about 2.2 TB/s
# of the H200's 4.8 (run 2026-12-06-b91994e-c43, `long_row_profile`). Larger blocks on 8 warps
# gained nothing on one H100 (`bench.kernel_sweep.elementwise_sweep`, run
# 2026-12-07-7501ba3-d44-sweep): blocks of 2,048 took 15.8 and 31.0 us at 1,500 and 3,000 tokens
# against 15.4 and 30.2 for the default's 1,024 on 4.
WARPS = 4


@triton.jit(do_not_specialize=REQUEST_ELEMENTS)
def _swiglu_fwd(gate, up, y, N, width, sg, su, BN: tl.constexpr):
    # Element e of the [N / width, width] output is row e // width, column e % width; gate and up
    # rows are read with their own strides (two column blocks of one projection output, in place).
    offsets = tl.program_id(0).to(tl.int64) * BN + tl.arange(0, BN)
    m = offsets < N
    row, col = offsets // width, offsets % width
    g = tl.load(gate + row * sg + col, mask=m, other=0.0).to(tl.float32)
    u = tl.load(up + row * su + col, mask=m, other=0.0).to(tl.float32)
    tl.store(y + offsets, (g * tl.sigmoid(g) * u).to(y.dtype.element_ty), mask=m)


@triton.jit
def _swiglu_rows_fwd(gate, up, y, width, sg, su, BN: tl.constexpr):
    # Program (r, c): row r, columns c * BN onwards, of the [rows, width] output (BY_ROWS).
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    m = cols < width
    g = tl.load(gate + row * sg + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(up + row * su + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(y + row * width + cols, (g * tl.sigmoid(g) * u).to(y.dtype.element_ty), mask=m)


@triton.jit(do_not_specialize=REQUEST_ELEMENTS)
def _swiglu_bwd(gate, up, dy, dgate, dup, N, BN: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BN + tl.arange(0, BN)
    m = offsets < N
    g = tl.load(gate + offsets, mask=m, other=0.0).to(tl.float32)
    u = tl.load(up + offsets, mask=m, other=0.0).to(tl.float32)
    d = tl.load(dy + offsets, mask=m, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    tl.store(dup + offsets, (d * g * sig).to(dup.dtype.element_ty), mask=m)
    tl.store(dgate + offsets, (d * u * sig * (1.0 + g * (1.0 - sig))).to(dgate.dtype.element_ty), mask=m)


class SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        (gate, gate_stride), (up, up_stride) = _even_rows(gate), _even_rows(up)
        y = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
        count, width = gate.numel(), gate.shape[-1]
        with _on(gate.device):
            if BY_ROWS:
                if count:
                    _swiglu_rows_fwd[(count // width, triton.cdiv(width, BLOCK))](gate, up, y, width, gate_stride,
                                                                                   up_stride, BLOCK, num_warps=WARPS)
            else:
                _swiglu_fwd[(triton.cdiv(count, BLOCK),)](gate, up, y, count, width, gate_stride, up_stride, BLOCK,
                                                          num_warps=WARPS)
        ctx.save_for_backward(gate, up)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        gate, up = (x.contiguous() for x in ctx.saved_tensors)  # a copy only for column blocks
        dy = dy.contiguous()
        dgate, dup = torch.empty_like(gate), torch.empty_like(up)
        count = gate.numel()
        with _on(gate.device):
            _swiglu_bwd[(triton.cdiv(count, BLOCK),)](gate, up, dy, dgate, dup, count, BLOCK)
        return dgate, dup


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, computed in float32, returned in gate's dtype. gate, up: one shape."""
    if gate.shape != up.shape:
        raise ValueError(f"swiglu: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ (no broadcasting)")
    return SwiGLU.apply(gate, up)


# -- the attention's output gate ---------------------------------------------------------------
#
# x * sigmoid(gate) with the gate read where the query projection wrote it (interleaved with the
# query, `decoder.attention_inputs`). In plain PyTorch that was two launches a layer: the sigmoid of
# the strided gate (not vectorised: 21.7 us a layer at 3,000 tokens on the H200) and the product
# (7.9 us), 177 us of a 3,000-token request's 11 ms (run 2026-12-06-3eaad48-b43, `long_row_profile`).

GATE_ELEMENTS = 4096  # elements a program of the gate's kernels
# A layout's rows a block (XB, GB) are 1 for a contiguous tensor and the heads for a strided
# view; a bucket's pieces pass the gate contiguous in their capture but strided in the warm-up
# before it, so these stay unspecialised (a value of 1 is otherwise compiled in): a variant first
# met inside a capture would compile there, which CUDA refuses. They feed no alignment.
GATE_LAYOUT = (*REQUEST_ROWS, "XB", "GB")


@triton.jit
def _gate_tiles(x, gate, rows, cols, m, XB, xs0, xs1, GB, gs0, gs1):
    """x's and the gate's [BR, D] tiles at rows, float32: row r of x at (r // XB) * xs0 +
    (r % XB) * xs1, of the gate likewise."""
    x_start = (rows // XB) * xs0 + (rows % XB) * xs1
    gate_start = (rows // GB) * gs0 + (rows % GB) * gs1
    xs = tl.load(x + x_start[:, None] + cols[None, :], mask=m, other=0.0).to(tl.float32)
    zs = tl.load(gate + gate_start[:, None] + cols[None, :], mask=m, other=0.0).to(tl.float32)
    return xs, zs


@triton.jit(do_not_specialize=GATE_LAYOUT)
def _gated_fwd(x, gate, y, R, XB, xs0, xs1, GB, gs0, gs1, D: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr):
    # y is contiguous.
    rows, cols, m_r, m = _row_tile(R, D, BR, BD)
    xs, zs = _gate_tiles(x, gate, rows, cols, m, XB, xs0, xs1, GB, gs0, gs1)
    tl.store(y + rows[:, None] * D + cols[None, :], (xs * tl.sigmoid(zs)).to(y.dtype.element_ty), mask=m)


@triton.jit(do_not_specialize=GATE_LAYOUT)
def _gated_bwd(x, gate, dy, dx, dgate, R, XB, xs0, xs1, GB, gs0, gs1, D: tl.constexpr, BR: tl.constexpr,
               BD: tl.constexpr):
    # dy, dx and dgate are contiguous; x and the gate are read in place, as the forward read them.
    rows, cols, m_r, m = _row_tile(R, D, BR, BD)
    xs, zs = _gate_tiles(x, gate, rows, cols, m, XB, xs0, xs1, GB, gs0, gs1)
    offsets = rows[:, None] * D + cols[None, :]
    d = tl.load(dy + offsets, mask=m, other=0.0).to(tl.float32)
    sig = tl.sigmoid(zs)
    tl.store(dx + offsets, (d * sig).to(dx.dtype.element_ty), mask=m)
    tl.store(dgate + offsets, (d * xs * sig * (1.0 - sig)).to(dgate.dtype.element_ty), mask=m)


def _gate_launch(x: torch.Tensor, gate: torch.Tensor):
    """(x, gate, the rows, their layouts' (rows a block, stride, stride) each, block, rows per
    program: a power of two) of the gate's kernels; x or the gate made contiguous only where the
    kernels cannot read its layout."""
    x, (count, x_inner, xs0, xs1) = _rows_layout(x)
    gate, (_, gate_inner, gs0, gs1) = _rows_layout(gate)
    width = x.shape[-1]
    block = triton.next_power_of_2(max(width, 1))
    return (x, gate, count * x_inner, (x_inner, xs0, xs1, gate_inner, gs0, gs1), block,
            max(1, GATE_ELEMENTS // block))


class Gated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gate):
        x, gate, rows, layout, block, per_program = _gate_launch(x, gate)
        y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        with _on(x.device):
            _gated_fwd[(triton.cdiv(rows, per_program),)](x, gate, y, rows, *layout, x.shape[-1], per_program, block)
        ctx.save_for_backward(x, gate)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        # The layouts are read again: a saved-tensor hook may hand back repacked tensors.
        x, gate, rows, layout, block, per_program = _gate_launch(*ctx.saved_tensors)
        dy = dy.contiguous()
        dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        dgate = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
        with _on(x.device):
            _gated_bwd[(triton.cdiv(rows, per_program),)](x, gate, dy, dx, dgate, rows, *layout, x.shape[-1],
                                                          per_program, block)
        return dx, dgate


def gated(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(gate), computed in float32, returned contiguous in x's dtype. x, gate: one
    shape, [T, D] or [T, H, D], any strides with unit stride along the last axis."""
    if gate.shape != x.shape or gate.dtype != x.dtype:
        raise ValueError(f"gated: x {tuple(x.shape)} {x.dtype} and gate {tuple(gate.shape)} {gate.dtype} differ (no "
                         f"broadcasting or promotion)")
    return Gated.apply(x, gate)
