"""The plain-PyTorch references of SwiGLU and the attention's output gate: the oracles of `fused`."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def gated_reference(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(gate)
