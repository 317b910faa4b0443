"""Plain-PyTorch references of the RMSNorm kernels (Qwen3.5's `1 + weight` scale): the oracle of `fused`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..plain import wide


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    normed = wide(x) * torch.rsqrt(wide(x).pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (1.0 + wide(weight))).to(x.dtype)


def add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual, `rms_norm_reference` of that sum)."""
    total = x + residual
    return total, rms_norm_reference(total, weight, eps)


def norm_rotate_reference(x, weight, cos, sin, eps):
    return rotate(rms_norm_reference(x, weight, eps), cos, sin)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Partial rotary embedding on the first R channels of x [T, H, D]; cos, sin [T, R]."""
    width = cos.shape[-1]
    rotated, rest = x[..., :width], x[..., width:]
    first, second = rotated.chunk(2, dim=-1)
    turned = torch.cat([-second, first], dim=-1)
    rotated = rotated * cos[:, None, :] + turned * sin[:, None, :]
    return torch.cat([rotated, rest], dim=-1)


def split_rotate_reference(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """(q, k, v), each [T, H, D] contiguous, of the vision tower's qkv output [T, 3, H, D], q and
    k turned over all D channels by cos, sin [T, D] in float32, as transformers' vision blocks do."""
    query, key, value = qkv.unbind(1)
    cos, sin = cos.float(), sin.float()
    return (*(rotate(x.float(), cos, sin).to(x.dtype) for x in (query, key)), value.contiguous())


def rms_norm_gated_reference(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    normed = wide(x) * torch.rsqrt(wide(x).pow(2).mean(-1, keepdim=True) + eps)
    return (weight * normed.to(x.dtype) * F.silu(wide(gate))).to(x.dtype)
