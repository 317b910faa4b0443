"""Two attention partials merged by their log-sum-exps as one Triton kernel (CUDA): a bucket's
rows attend to their prefix and to their own keys in two calls (`attention.chunked_fork_partials`),
and the merge in plain PyTorch took a dozen elementwise kernels a layer."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_common import _on


@triton.jit
def _merge_fwd(out_a, lse_a, out_b, lse_b, y, s_at, s_ah, s_la, s_bt, s_bh, s_lb, s_yt, s_yh,
               D: tl.constexpr, BD: tl.constexpr):
    # Program (t, h): token t's head h, its D values.
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    a_lse = tl.load(lse_a + h * s_la + t)
    b_lse = tl.load(lse_b + h * s_lb + t)
    b_lse = tl.where((b_lse == b_lse) & (b_lse != float("inf")), b_lse, float("-inf"))  # no keys: +inf from flash
    top = tl.maximum(a_lse, b_lse)
    weight_a, weight_b = tl.exp(a_lse - top), tl.exp(b_lse - top)
    cols = tl.arange(0, BD)
    m = cols < D
    a = tl.load(out_a + t * s_at + h * s_ah + cols, mask=m, other=0.0).to(tl.float32)
    b = tl.load(out_b + t * s_bt + h * s_bh + cols, mask=m, other=0.0).to(tl.float32)
    merged = (a * weight_a + b * weight_b) / (weight_a + weight_b)
    tl.store(y + t * s_yt + h * s_yh + cols, merged.to(y.dtype.element_ty), mask=m)


def merge_partials(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """`naive.merge_partials_reference` as one kernel: outputs [T, H, D] (each head's D values
    contiguous), log-sum-exps [H, T] float32 (each head's tokens contiguous); written into `out`
    when given (out_a itself will do: each value is read before it is written)."""
    tokens, heads, width = out_a.shape
    for name, x in (("out_a", out_a), ("out_b", out_b)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} needs each head's values contiguous, got strides {x.stride()}")
    for name, x in (("lse_a", lse_a), ("lse_b", lse_b)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} needs each head's tokens contiguous, got strides {x.stride()}")
    y = torch.empty_like(out_a) if out is None else out
    if tokens:
        with _on(out_a.device):
            _merge_fwd[(tokens, heads)](out_a, lse_a, out_b, lse_b, y, out_a.stride(0), out_a.stride(1),
                                        lse_a.stride(0), out_b.stride(0), out_b.stride(1), lse_b.stride(0),
                                        y.stride(0), y.stride(1), D=width, BD=triton.next_power_of_2(width))
    return y
