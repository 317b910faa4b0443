"""The LoRA projections' one-node autograd against autograd's op-by-op reference."""

import pytest
import torch

from dohnuts.ops.lora import lora_linear, lora_linear_reference


def _maps(dtype, ranks, outputs, width=24, generator=None):
    """Frozen bases in `dtype`; float32 (float64 for float64) adapters with non-zero B."""
    adapter = torch.float64 if dtype == torch.float64 else torch.float32
    bases = [torch.randn(out, width, generator=generator).to(dtype) for out in outputs]
    downs = [torch.randn(rank, width, generator=generator).to(adapter).requires_grad_() for rank in ranks]
    ups = [(0.5 * torch.randn(out, rank, generator=generator)).to(adapter).requires_grad_()
           for out, rank in zip(outputs, ranks)]
    return bases, downs, ups


@pytest.mark.parametrize("ranks, outputs, scales", [
    ([4], [40], [2.0]),
    ([4, 4, 4, 4], [48, 3, 3, 16], [2.0, 2.0, 2.0, 2.0]),
    ([2, 8, 4], [8, 5, 12], [1.0, 0.25, 3.0]),  # ranks and scales differing: the general paths
])
@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-12), (torch.bfloat16, 2e-2)])
def test_lora_linear_matches_autograd_in_outputs_and_every_gradient(ranks, outputs, scales, dtype, tolerance):
    """Max abs error relative to the largest value of each output and gradient: float64 runs
    the same math (1e-12); bf16 differs only by the order of its roundings."""
    generator = torch.Generator().manual_seed(0)
    bases, downs, ups = _maps(dtype, ranks, outputs, generator=generator)
    x = torch.randn(2 * 7, 24, generator=generator).to(dtype).requires_grad_()
    weights = [torch.randn(14, out, generator=generator) for out in outputs]
    results = []
    for run in (lora_linear, lora_linear_reference):
        outs = run(x, bases, downs, ups, scales)
        loss = sum((out.double() * weight.double()).sum() for out, weight in zip(outs, weights))
        results.append([*outs, *torch.autograd.grad(loss, [x, *downs, *ups])])
    for ours, reference in zip(*results):
        assert ours.dtype == reference.dtype and ours.shape == reference.shape
        scale = reference.double().abs().max()
        assert scale > 0 and ((ours.double() - reference.double()).abs().max() / scale).item() <= tolerance


def test_lora_linear_handles_unused_outputs_and_frozen_adapters():
    generator = torch.Generator().manual_seed(1)
    bases, downs, ups = _maps(torch.float64, [4, 4], [6, 9], generator=generator)
    x = torch.randn(5, 24, generator=generator, dtype=torch.float64, requires_grad=True)
    first, _ = lora_linear(x, bases, downs, ups, [2.0, 2.0])  # the second output takes no gradient
    reference, _ = lora_linear_reference(x, bases, downs, ups, [2.0, 2.0])
    ours = torch.autograd.grad(first.sum(), [x, *downs, *ups])
    expected = torch.autograd.grad(reference.sum(), [x, *downs, *ups], allow_unused=True)
    for a, b, weight in zip(ours, expected, [x, *downs, *ups]):
        assert torch.allclose(a, torch.zeros_like(weight) if b is None else b, atol=1e-12)
    assert expected[-1] is None and not ours[-1].any()  # the unused output's B: a zero gradient
    frozen = [weight.detach() for weight in downs + ups]  # frozen adapters: only x takes a gradient
    out = lora_linear(x, bases, frozen[:2], frozen[2:], [2.0, 2.0])
    (grad_x,) = torch.autograd.grad(sum(o.sum() for o in out), [x])
    expected = torch.autograd.grad(sum(o.sum() for o in lora_linear_reference(x, bases, frozen[:2], frozen[2:],
                                                                              [2.0, 2.0])), [x])[0]
    assert torch.allclose(grad_x, expected, atol=1e-12)


def test_lora_linear_refuses_base_weights_that_take_gradients():
    bases, downs, ups = _maps(torch.float32, [2], [3])
    with pytest.raises(ValueError, match="frozen"):
        lora_linear(torch.randn(4, 24), [bases[0].requires_grad_()], downs, ups, [1.0])
