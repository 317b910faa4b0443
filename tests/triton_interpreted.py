"""Our Triton kernels (dohnuts.triton_ops) against their references, run on the CPU by Triton's
interpreter. `test_kernels.py` runs this file in a subprocess with TRITON_INTERPRET=1, which
Triton reads when the kernels are defined. Exits non-zero on the first mismatch."""

import os
import sys

import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

from dohnuts import kernels, triton_ops  # noqa: E402

TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}


def close(name, actual, expected):
    try:
        torch.testing.assert_close(actual, expected, **TOLERANCE)
    except AssertionError as error:
        sys.exit(f"{name}: {error}")


def grads(outputs, inputs, seed):
    generator = torch.Generator().manual_seed(seed)
    weights = [torch.randn(out.shape, generator=generator) for out in outputs]
    total = sum((out * w).sum() for out, w in zip(outputs, weights))
    return torch.autograd.grad(total, inputs, allow_unused=True)


def check_split_heads():
    for total, heads, key_dim, value_heads, value_dim in [(63, 2, 8, 4, 6), (17, 3, 16, 3, 16), (1, 1, 4, 2, 4)]:
        width = 2 * heads * key_dim + value_heads * value_dim
        mixed = torch.randn(total, width + 5)[:, 2:2 + width].requires_grad_()  # rows read with a stride
        ours = triton_ops.split_heads(mixed, heads, key_dim, value_heads, value_dim)
        reference = kernels.split_heads_reference(mixed, heads, key_dim, value_heads, value_dim)
        for name, a, b in zip("qkv", ours, reference):
            close(f"split_heads {name}", a, b)
        close("split_heads grad", grads(ours, [mixed], 0)[0], grads(reference, [mixed], 0)[0])


def check_conv_split_heads():
    heads, key_dim, value_heads, value_dim, width = 2, 8, 4, 6, 4
    channels = 2 * heads * key_dim + value_heads * value_dim
    for lengths in ([63, 1, 17, 64, 130], [3], [2, 70]):
        cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
        for with_state in (False, True):
            for keep in (False, True):
                x = torch.randn(sum(lengths), channels, requires_grad=True)
                weight = torch.randn(channels, width, requires_grad=True)
                state = torch.randn(len(lengths), channels, width, requires_grad=True) if with_state else None
                inputs = [x, weight] + ([state] if with_state else [])
                ours = triton_ops.conv_split_heads(x, weight, state, keep, cu, cu, None, heads, key_dim, value_heads,
                                                   value_dim)
                reference = kernels.conv_split_heads_reference(x, weight, state, keep, cu.long(), heads, key_dim,
                                                               value_heads, value_dim)
                case = f"conv_split_heads lengths={lengths} state={with_state} final={keep}"
                for name, a, b in zip(["q", "k", "v", "final"], ours, reference):
                    if b is None:
                        assert a is None, f"{case}: {name}"
                    else:
                        close(f"{case} {name}", a, b)
                outputs = [out for out in ours if out is not None]
                expected = [out for out in reference if out is not None]
                for name, a, b in zip(["x", "weight", "state"], grads(outputs, inputs, 1), grads(expected, inputs, 1)):
                    close(f"{case} grad {name}", a, b)


if __name__ == "__main__":
    check_split_heads()
    check_conv_split_heads()
    print("ok")
