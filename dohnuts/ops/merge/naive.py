"""The plain-PyTorch merge of two attention partials: the oracle of `fused`."""

from __future__ import annotations

import torch

from ..plain import wide


def merge_partials_reference(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                             lse_b: torch.Tensor) -> torch.Tensor:
    """Attention over two disjoint sets of keys from each set's output [T, H, D] and log-sum-exp
    [H, T]: each output weighted by its share of the whole softmax, in out_a's dtype. A query
    without keys in the second set (flash attention's log-sum-exp +inf, output 0) takes the
    first's alone."""
    lse_b = torch.where(torch.isfinite(lse_b), lse_b, float("-inf"))
    lse = torch.logaddexp(lse_a, lse_b)
    weight_a, weight_b = (torch.exp(part - lse).t().unsqueeze(-1) for part in (lse_a, lse_b))
    return (wide(out_a) * weight_a + wide(out_b) * weight_b).to(out_a.dtype)
