"""Linear maps of one input with their LoRA updates, as one autograd node.

A LoRA projection computes x W^T + s (x A^T) B^T. Run through autograd op by op, each one costs
about a dozen recorded operations forward and as many nodes backward (casts of the float32
adapters, transposes, two products and a sum), and the layers of a Qwen3.5 decoder have eight
of them. On the GPU machine that host work, not the arithmetic, bounds a training update
(docs/design.md). Here the projections that read one input (a delta-rule layer's four input
projections, attention's query, key and value, the MLP's gate and up) run as one autograd
node: one product of x with their stacked A matrices, one product per output for the base and
one for its update, and in the backward the matching products, written out by hand.

The arithmetic is the one mixed-precision training does: float32 adapter weights, products in
x's dtype with float32 accumulation, gradients of the adapters returned in float32.
"""

from __future__ import annotations

import torch


def _stacked(tensors: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The tensors stacked along dim 0, in `dtype` (one cast for the stack, not one each)."""
    stacked = tensors[0] if len(tensors) == 1 else torch.cat(tensors)
    return stacked.to(dtype)


def _scaled(parts: torch.Tensor, ranks: list[int], scales: tuple[float, ...]) -> torch.Tensor:
    """parts [T, sum r] with the columns of map i times s_i (one product when all s_i agree)."""
    if len(set(scales)) == 1:
        return parts * scales[0]
    return torch.cat([part * scale for part, scale in zip(parts.split(ranks, dim=1), scales)], dim=1)


class _LoraLinear(torch.autograd.Function):
    """Outputs x W_i^T + s_i (x A_i^T) B_i^T for frozen W_i; gradients for x, A_i and B_i."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scales: tuple[float, ...], *weights: torch.Tensor):
        count = len(scales)
        bases, downs, ups = weights[:count], list(weights[count:2 * count]), list(weights[2 * count:])
        ranks = [down.shape[0] for down in downs]
        down_all = _stacked(downs, x.dtype)  # [sum r, D]
        scaled = _scaled(x @ down_all.t(), ranks, scales)  # [T, sum r]
        if len(set(ranks)) == 1:
            up_all = _stacked(ups, x.dtype).split([up.shape[0] for up in ups])  # one cast for all B_i
        else:
            up_all = [up.to(x.dtype) for up in ups]
        outputs = tuple(torch.addmm(x @ base.t(), part, up.t())
                        for base, up, part in zip(bases, up_all, scaled.split(ranks, dim=1)))
        ctx.save_for_backward(x, down_all, scaled, *bases, *up_all)
        ctx.scales, ctx.ranks = scales, ranks
        ctx.adapter_dtypes = [down.dtype for down in downs], [up.dtype for up in ups]
        return outputs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads: torch.Tensor | None):
        x, down_all, scaled, *rest = ctx.saved_tensors
        count = len(ctx.scales)
        bases, ups = rest[:count], rest[count:]
        grads = [torch.zeros(x.shape[0], base.shape[0], dtype=x.dtype, device=x.device) if grad is None else grad
                 for grad, base in zip(grads, bases)]
        # The gradient at x A^T of every map, scaled by its s_i: [T, sum r].
        reduced = _scaled(torch.cat([grad @ up for grad, up in zip(grads, ups)], dim=1), ctx.ranks, ctx.scales)
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = reduced @ down_all
            for grad, base in zip(grads, bases):
                grad_x.addmm_(grad, base)
        if not any(ctx.needs_input_grad[2 + count:]):
            return (grad_x, None, *([None] * 3 * count))
        down_dtypes, up_dtypes = ctx.adapter_dtypes
        grad_downs = reduced.t() @ x  # [sum r, D]
        if len(set(down_dtypes)) == 1:
            grad_downs = grad_downs.to(down_dtypes[0]).split(ctx.ranks, dim=0)
        else:
            grad_downs = [grad.to(dtype) for grad, dtype in zip(grad_downs.split(ctx.ranks, dim=0), down_dtypes)]
        grad_ups = [(grad.t() @ part).to(dtype)
                    for grad, part, dtype in zip(grads, scaled.split(ctx.ranks, dim=1), up_dtypes)]
        return (grad_x, None, *([None] * count), *grad_downs, *grad_ups)


def lora_linear(x: torch.Tensor, bases: list[torch.Tensor], downs: list[torch.Tensor], ups: list[torch.Tensor],
                scales: list[float]) -> list[torch.Tensor]:
    """x W_i^T + s_i (x A_i^T) B_i^T for each i, as one autograd node.

    Args:
        x: [T, D] the shared input.
        bases: W_i [O_i, D], frozen (no gradient is computed for them).
        downs: A_i [r_i, D]; ups: B_i [O_i, r_i] (float32 master weights, typically).
        scales: s_i, LoRA's alpha / r.

    Returns:
        [T, O_i] outputs in x's dtype.
    """
    if any(base.requires_grad for base in bases):
        raise ValueError("lora_linear computes no gradient for the base weights; they must be frozen")
    return list(_LoraLinear.apply(x, tuple(float(scale) for scale in scales), *bases, *downs, *ups))


def lora_linear_reference(x, bases, downs, ups, scales):
    """The same maps through autograd, op by op: the test oracle."""
    return [x @ base.t() + scale * ((x @ down.to(x.dtype).t()) @ up.to(x.dtype).t())
            for base, down, up, scale in zip(bases, downs, ups, scales)]
