"""Triton pieces our kernel families share: the launch device, row tiles and layouts, the norm's gradient.

Our Triton kernels are for CUDA only; `dohnuts.ops.kernels` chooses them. All of them also run
on the CPU, under Triton's interpreter (TRITON_INTERPRET=1), which the tests use
(`tests/ops/triton_interpreted.py`).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

# Triton compiles a kernel afresh for each class an integer argument falls in (1, a multiple of
# 16, any other), so a count that follows the request (its tokens or rows, its markers, its
# forked states) compiled a new variant of every kernel that took it on the first request of a
# new class: a stall of seconds on a user's request (issue 37). These arguments are left
# unspecialised; they bound loops and masks, never strides or address alignment.
REQUEST_ROWS = ("R",)
REQUEST_ELEMENTS = ("N",)
REQUEST_STATES = ("G",)


def _on(device: torch.device):
    """Launch on `device` rather than the current CUDA device (the CPU: Triton's interpreter)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


@triton.jit
def _row_tile(R, D: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr):
    """This program's BR rows of R and the BD columns of D: (rows, cols, row mask, tile mask)."""
    rows = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
    cols = tl.arange(0, BD)
    m_r = rows < R
    return rows, cols, m_r, m_r[:, None] & (cols[None, :] < D)


@triton.jit
def _norm_grad(g, normed, r, D: tl.constexpr):
    """The gradient of x from g, the gradient of normed = x r with r = (|x|^2 / D + eps)^-1/2
    per row: r (g - normed (g . normed) / D). D = 1 is the L2 norm."""
    return r[:, None] * (g - normed * (tl.sum(g * normed, axis=1) / D)[:, None])


def _rows_view(x: torch.Tensor):
    """(A, B, s0, s1) such that row r of x's [..., D] rows starts at (r // B) * s0 + (r % B) * s1:
    for contiguous x, 2-D x or 3-D x with unit stride along D; None when x is laid out otherwise."""
    if x.is_contiguous():
        return x.numel() // max(x.shape[-1], 1), 1, x.shape[-1], 0
    if x.stride(-1) != 1:
        return None
    if x.dim() == 2:
        return x.shape[0], 1, x.stride(0), 0
    if x.dim() == 3:
        return x.shape[0], x.shape[1], x.stride(0), x.stride(1)
    return None


def _even_rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(x, the distance between its rows of the last axis) when its rows are evenly spaced (x
    contiguous, or a column block of a wider projection output, read in place), else (a
    contiguous copy, its width)."""
    layout = _rows_view(x)
    if layout is None or layout[1] != 1:
        x = x.contiguous()
        return x, x.shape[-1]
    return x, layout[2]


def _rows_layout(x: torch.Tensor):
    """(x, its `_rows_view`), x made contiguous first when the kernels cannot read its layout."""
    layout = _rows_view(x)
    if layout is None:
        x = x.contiguous()
        layout = _rows_view(x)
    return x, layout
