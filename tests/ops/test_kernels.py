"""Kernel references against independent formulas (CPU) and fused kernels against references (GPU)."""

import logging
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dohnuts.ops import backends, derived_cache, kernels
from dohnuts.ops.attention import attention_reference
from dohnuts.ops.conv.naive import causal_conv1d_reference, conv_split_heads_reference
from dohnuts.ops.delta_rule import chunk
from dohnuts.ops.delta_rule.naive import decay, gated_delta_rule_chunked, gated_delta_rule_reference
from dohnuts.ops.norm.naive import (
    norm_rotate_reference,
    rms_norm_gated_reference,
    rms_norm_reference,
    split_rotate_reference,
)
from dohnuts.ops.plain import l2norm
from dohnuts.ops.swiglu.naive import gated_reference, swiglu_reference

LENGTHS = [63, 1, 17, 64]  # odd sizes, a single token, exactly one 64-token chunk


def _cu(lengths, device="cpu"):
    return torch.tensor([0] + lengths, device=device).cumsum(0)


def _naive_delta_rule(q, k, v, g, beta, state):
    """Per-token, per-head delta rule written with explicit matrices. q, k [T, H, K]; v [T, H, V]."""
    q = q / q.norm(dim=-1, keepdim=True).clamp_min(1e-12) * q.shape[-1] ** -0.5
    k = k / k.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    out = torch.zeros(v.shape)
    for t in range(q.shape[0]):
        for h in range(q.shape[1]):
            decayed = state[h] * torch.exp(g[t, h])
            error = v[t, h] - decayed.T @ k[t, h]
            state[h] = decayed + torch.outer(k[t, h], beta[t, h] * error)
            out[t, h] = state[h].T @ q[t, h]
    return out, state


def _delta_inputs(total, heads=2, value_heads=4, key_dim=8, value_dim=6, device="cpu", dtype=torch.float32):
    generator = torch.Generator(device="cpu").manual_seed(0)
    make = lambda *shape: torch.randn(*shape, generator=generator).to(device, dtype)  # noqa: E731
    q, k, v = make(1, total, heads, key_dim), make(1, total, heads, key_dim), make(1, total, value_heads, value_dim)
    g = -F.softplus(make(1, total, value_heads)).float()
    beta = torch.sigmoid(make(1, total, value_heads))
    return q, k, v, g, beta


def test_holding_derived_keeps_what_a_capture_read_after_the_cache_replaced_it():
    """A graph captured inside `holding_derived` holds the kept constants it read: after an
    in-place change has the cache make a new one, the old one (the memory a stale replay reads)
    is still alive, held by the list, and outside the block nothing is collected."""
    import gc
    import weakref

    weight = torch.nn.Parameter(torch.randn(5), requires_grad=False)
    derived_cache.derived(weight, "1+w", lambda w: 1.0 + w)
    with derived_cache.holding_derived() as held:
        old = derived_cache.derived(weight, "1+w", lambda w: 1.0 + w)
    assert len(held) == 1 and held[0] is old
    watch = weakref.ref(old)
    del old
    with torch.no_grad():
        weight.add_(1.0)
    new = derived_cache.derived(weight, "1+w", lambda w: 1.0 + w)  # replaces the cache's entry
    gc.collect()
    assert watch() is held[0] and new is not held[0]
    torch.testing.assert_close(new, 1.0 + weight, rtol=0, atol=0)
    derived_cache.derived(weight, "1+w", lambda w: 1.0 + w)
    assert len(held) == 1  # collected only inside the block
    held.clear()
    gc.collect()
    assert watch() is None  # released with its holder


def test_derived_constants_are_kept_per_version_and_never_cut_gradients():
    weight = torch.nn.Parameter(torch.randn(5), requires_grad=False)
    calls = []

    def plus_one(w):
        calls.append(1)
        return 1.0 + w.float()

    first = derived_cache.derived(weight, "1+w", plus_one)
    assert derived_cache.derived(weight, "1+w", plus_one) is first and len(calls) == 1
    assert derived_cache.derived(weight, "other", plus_one) is not first and len(calls) == 2  # tags are separate
    with torch.no_grad():
        weight.mul_(3.0)  # in place: a new version
    torch.testing.assert_close(derived_cache.derived(weight, "1+w", plus_one), 1.0 + weight, rtol=0, atol=0)
    assert len(calls) == 3
    weight.data = torch.randn(5, dtype=torch.float64)  # new storage and dtype
    torch.testing.assert_close(derived_cache.derived(weight, "1+w", plus_one), 1.0 + weight.float(), rtol=0, atol=0)
    trained = torch.nn.Parameter(torch.randn(5))
    out = derived_cache.derived(trained, "1+w", plus_one)
    out.sum().backward()
    torch.testing.assert_close(trained.grad, torch.ones(5))  # computed afresh, in the autograd graph
    assert derived_cache.derived(trained, "1+w", plus_one) is not out
    # A derivation that gives the parameter back (float() of a float32 weight) is not kept:
    # the entry would keep its own weak key alive.
    plain = torch.nn.Parameter(torch.randn(3), requires_grad=False)
    assert derived_cache.derived(plain, "float", torch.Tensor.float) is plain
    assert "float" not in derived_cache._DERIVED.get(plain, {})


def test_delta_rule_reference_matches_explicit_per_head_recurrence_on_packed_sequences():
    total = sum(LENGTHS)
    q, k, v, g, beta = _delta_inputs(total)
    start = torch.randn(len(LENGTHS), 4, 8, 6)
    out, final = gated_delta_rule_reference(q, k, v, g, beta, start.clone(), True, _cu(LENGTHS))
    for index, (begin, end) in enumerate(zip(_cu(LENGTHS)[:-1].tolist(), _cu(LENGTHS)[1:].tolist())):
        # Grouped values: key head h serves value heads 2h and 2h + 1.
        span = slice(begin, end)
        expected, state = _naive_delta_rule(q[0, span].repeat_interleave(2, 1), k[0, span].repeat_interleave(2, 1),
                                            v[0, span], g[0, span], beta[0, span], start[index].clone())
        torch.testing.assert_close(out[0, begin:end], expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(final[index], state, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk_size", [64, 16, 5])
def test_chunked_delta_rule_equals_the_recurrence_in_outputs_states_and_gradients(chunk_size):
    inputs = [t.double().requires_grad_() for t in _delta_inputs(sum(LENGTHS))]
    start = torch.randn(len(LENGTHS), 4, 8, 6, dtype=torch.float64)
    cu = _cu(LENGTHS)
    # float64 inputs are computed in float32 inside; compare at float32 precision.
    out, final = gated_delta_rule_chunked(*inputs, start, True, cu, chunk_size=chunk_size)
    ref, ref_final = gated_delta_rule_reference(*inputs, start, True, cu)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final, ref_final, rtol=1e-5, atol=1e-5)
    weights = torch.randn_like(out)
    grads = torch.autograd.grad((out * weights).sum(), inputs)
    ref_grads = torch.autograd.grad((ref * weights).sum(), inputs)
    for name, grad, expected in zip(["q", "k", "v", "g", "beta"], grads, ref_grads):
        torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-5, msg=name)


def test_delta_rule_writes_into_out_without_autograd_and_refuses_it_with():
    total = sum(LENGTHS)
    q, k, v, g, beta = (x[0] for x in _delta_inputs(total))
    cu = _cu(LENGTHS).to(torch.int32)
    A_log, dt_bias = torch.randn(4), torch.randn(4)
    args = (q, k, v, g, beta, cu, cu, max(LENGTHS), None, A_log, dt_bias)
    expected, _ = kernels.delta_rule(*args)
    larger = torch.full((total + 4, *v.shape[1:]), 5.0)
    with torch.no_grad():
        out, final = kernels.delta_rule(*args, out=larger[1:1 + total])
    assert out.data_ptr() == larger[1].data_ptr() and final is None
    torch.testing.assert_close(larger[1:1 + total], expected)
    assert larger[0].eq(5).all() and larger[1 + total:].eq(5).all()
    with pytest.raises(ValueError, match="forward passes only"):
        kernels.delta_rule(q.requires_grad_(), *args[1:], out=larger[1:1 + total])


def test_delta_rule_state_carries_a_sequence_across_a_split():
    q, k, v, g, beta = _delta_inputs(40)
    whole, whole_state = gated_delta_rule_reference(q, k, v, g, beta, None, True)
    head, tail = slice(None, 25), slice(25, None)
    first, state = gated_delta_rule_reference(*(x[:, head] for x in (q, k, v, g, beta)), None, True)
    second, final = gated_delta_rule_reference(*(x[:, tail] for x in (q, k, v, g, beta)), state, True)
    torch.testing.assert_close(torch.cat([first, second], 1), whole, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(final, whole_state, rtol=1e-5, atol=1e-6)


def test_conv_split_heads_through_parents_equals_forked_states_with_their_gradient():
    lengths, heads, key_dim, value_heads, value_dim = [5, 3, 9], 2, 4, 2, 6
    channels = 2 * heads * key_dim + value_heads * value_dim
    cu = _cu(lengths).to(torch.int32)
    x = torch.randn(sum(lengths), channels, dtype=torch.float64)
    weight = torch.randn(channels, 4, dtype=torch.float64)
    shared = torch.randn(2, channels, 4, dtype=torch.float64, requires_grad=True)
    parents = torch.tensor([1, -1, 0])
    shape = (heads, key_dim, value_heads, value_dim)
    ours = kernels.conv_split_heads(x, weight, shared, False, cu, cu, None, *shape, parents, True)
    states = kernels.fork_states(shared, parents, True)
    forked = kernels.conv_split_heads(x, weight, states, False, cu, cu, None, *shape)
    for a, b in zip(ours[:3], forked[:3]):
        torch.testing.assert_close(a, b)
    # The gradient reaches the shared states' rows (the orphan's zero state takes none).
    grad = torch.autograd.grad(sum(out.sum() for out in ours[:3]), shared)[0]
    assert grad[0].abs().sum() > 0 and grad[1].abs().sum() > 0


def test_causal_conv_reference_matches_conv1d_per_sequence_with_carried_state():
    dim, width = 5, 4
    x = torch.randn(1, sum(LENGTHS), dim)
    weight = torch.randn(dim, width)
    start = torch.randn(len(LENGTHS), dim, width)
    out, final = causal_conv1d_reference(x, weight, start, True, _cu(LENGTHS))
    for index, (begin, end) in enumerate(zip(_cu(LENGTHS)[:-1].tolist(), _cu(LENGTHS)[1:].tolist())):
        sequence = torch.cat([start[index], x[0, begin:end].T], dim=1)  # [D, W + L]
        expected = F.silu(F.conv1d(sequence[None], weight[:, None, :], groups=dim)[0, :, 1:]).T
        torch.testing.assert_close(out[0, begin:end], expected, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(final[index], sequence[:, -width:])


def test_norms_follow_the_qwen3_5_conventions():
    x, gate, weight = torch.randn(3, 8), torch.randn(3, 8), torch.randn(8)
    rms = x / x.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()
    torch.testing.assert_close(rms_norm_reference(x, weight, 1e-6), rms * (1 + weight))
    torch.testing.assert_close(rms_norm_gated_reference(x, gate, weight, 1e-6), rms * weight * F.silu(gate))


# -- fused kernels on the GPU, against the references, in bf16 tolerance ----------------------

BF16 = {"rtol": 2e-2, "atol": 2e-2}


def _relative_error(actual, expected):
    return ((actual.float() - expected.float()).norm() / expected.float().norm().clamp_min(1e-6)).item()


def _assert_gradients_close(ours, reference, inputs: dict, limit: float):
    """The gradients of sum(out * probe) over the outputs, for one random probe per output,
    reach every named input within `limit` relative error of the reference's."""
    probes = [torch.randn(out.shape, device=out.device) for out in ours]
    grads = torch.autograd.grad(sum((out.float() * p).sum() for out, p in zip(ours, probes)), list(inputs.values()))
    expected = torch.autograd.grad(sum((out.float() * p).sum() for out, p in zip(reference, probes)),
                                   list(inputs.values()))
    for name, grad, reference_grad in zip(inputs, grads, expected):
        assert _relative_error(grad, reference_grad) < limit, name


@pytest.mark.gpu
def test_fused_kernels_are_installed_on_cuda():
    assert kernels.fused(torch.zeros(1, device="cuda")) is not None, "flash-linear-attention is not importable"


@pytest.mark.gpu
@pytest.mark.parametrize("width", [63, 128, 1024])
def test_fused_norms_and_swiglu_match_references(width):
    assert backends._triton_kernels() is not None, "no Triton: the test would compare the reference with itself"
    x = torch.randn(2, 63, width, device="cuda", dtype=torch.bfloat16)
    gate = torch.randn(2, 63, width, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(width, device="cuda", dtype=torch.bfloat16) * 0.1
    torch.testing.assert_close(kernels.rms_norm(x, weight, 1e-6), rms_norm_reference(x, weight, 1e-6), **BF16)
    torch.testing.assert_close(kernels.rms_norm_gated(x, gate, weight + 1, 1e-6),
                               rms_norm_gated_reference(x, gate, weight + 1, 1e-6), **BF16)
    torch.testing.assert_close(kernels.swiglu(x, gate), swiglu_reference(x, gate), **BF16)


@pytest.mark.gpu
def test_triton_rms_norm_and_swiglu_gradients_match_references():
    """Our Triton RMSNorm on a [T, H, D] view read with strides (as the attention's q norm reads
    it) and on 2-D rows of the hidden width, the gated RMSNorm of the delta rule's output, and
    SwiGLU: outputs and gradients in bf16."""
    assert backends._triton_kernels() is not None, "no Triton: the test would compare the reference with itself"
    wide = torch.randn(63, 8, 512, device="cuda", dtype=torch.bfloat16)
    for x in (wide[..., :256].detach(), torch.randn(63, 1024, device="cuda", dtype=torch.bfloat16)):
        x.requires_grad_()
        weight = (torch.randn(x.shape[-1], device="cuda") * 0.1).to(torch.bfloat16).requires_grad_()
        ours, reference = kernels.rms_norm(x, weight, 1e-6), rms_norm_reference(x, weight, 1e-6)
        torch.testing.assert_close(ours, reference, **BF16)
        _assert_gradients_close([ours], [reference], {"x": x, "weight": weight}, 2e-2)
    x, z = (torch.randn(63, 16, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    weight = (1.0 + 0.1 * torch.randn(128, device="cuda")).to(torch.bfloat16).requires_grad_()
    ours, reference = kernels.rms_norm_gated(x, z, weight, 1e-6), rms_norm_gated_reference(x, z, weight, 1e-6)
    torch.testing.assert_close(ours, reference, **BF16)
    _assert_gradients_close([ours], [reference], {"x": x, "gate": z, "weight": weight}, 2e-2)
    gate, up = (torch.randn(63, 3584, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    ours, reference = kernels.swiglu(gate, up), swiglu_reference(gate, up)
    torch.testing.assert_close(ours, reference, **BF16)
    _assert_gradients_close([ours], [reference], {"gate": gate, "up": up}, 2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("block", [512, 1024])
def test_swiglu_by_rows_matches_the_reference_and_the_flat_programs(block, monkeypatch):
    """SwiGLU with programs by rows (`swiglu.fused.BY_ROWS`) on column blocks of the MLP's packed
    output at the Qwen3.5-0.8B width (3,584: with 1,024 columns a program, a partial last block)
    and of 1,287 rows: against the reference within bf16's tolerance, and equal to the flat
    programs' output bit for bit (the same float32 arithmetic an element)."""
    from helpers import SpiedKernel

    from dohnuts.ops.swiglu import fused

    assert backends._triton_kernels() is not None, "no Triton: the test would compare the reference with itself"
    mlp = torch.randn(1287, 2 * 3584, device="cuda", dtype=torch.bfloat16)
    gate, up = mlp[:, :3584], mlp[:, 3584:]
    monkeypatch.setattr(fused, "BLOCK", block)
    flat = kernels.swiglu(gate, up)
    monkeypatch.setattr(fused, "BY_ROWS", True)
    spied = SpiedKernel(fused._swiglu_rows_fwd)
    monkeypatch.setattr(fused, "_swiglu_rows_fwd", spied)
    by_rows = kernels.swiglu(gate, up)
    assert len(spied.calls) == 1, "BY_ROWS did not launch the programs by rows"
    torch.testing.assert_close(by_rows, swiglu_reference(gate, up), **BF16)
    assert torch.equal(by_rows, flat)


@pytest.mark.gpu
def test_the_vision_split_rotate_matches_its_reference_on_cuda(monkeypatch):
    """The vision tower's q, k and v out of its qkv product (Qwen3.5-0.8B's 12 heads of 64, bf16,
    a 512 x 512 image's 1,024 patches and one more), q and k turned in float32: against the
    reference within bf16's rounding; v copied exactly; and the kernel taken (no gradient)."""
    from helpers import SpiedKernel

    from dohnuts.ops.norm import fused

    assert backends._triton_kernels() is not None, "no Triton: the test would compare the reference with itself"
    spied = SpiedKernel(fused._split_rotate_fwd)
    monkeypatch.setattr(fused, "_split_rotate_fwd", spied)
    total = 1025
    qkv = torch.randn(total, 3 * 12 * 64, device="cuda", dtype=torch.bfloat16).view(total, 3, 12, 64)
    angles = torch.randn(total, 32, device="cuda") * 20
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    ours, reference = kernels.split_rotate(qkv, cos, sin), split_rotate_reference(qkv, cos, sin)
    assert len(spied.calls) == 1, "the Triton kernel was not launched"
    for a, b in zip(ours[:2], reference[:2]):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)
    assert torch.equal(ours[2], reference[2]) and all(x.is_contiguous() for x in ours)


@pytest.mark.gpu
def test_packed_projection_kernels_match_references_on_cuda():
    """The kernels a packed projection's output feeds, in bf16 at the Qwen3.5-0.8B widths, against
    their references, outputs and gradients: the head norm fused with the rotary embedding on
    query heads interleaved with their gates (read in place), the residual addition fused with
    the next RMSNorm, SwiGLU and the gated RMSNorm on column blocks of one output."""
    assert backends._triton_kernels() is not None, "no Triton: the test would compare the reference with itself"
    total = 63
    projected = torch.randn(total, 8 * 512 + 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    query = projected[:, :4096].view(total, 8, 512)[..., :256]
    weight = (torch.randn(256, device="cuda") * 0.1).to(torch.bfloat16).requires_grad_()
    angles = torch.randn(total, 32, device="cuda")
    cos, sin = (f(torch.cat([angles, angles], -1)).to(torch.bfloat16) for f in (torch.cos, torch.sin))
    ours = kernels.norm_rotate(query, weight, cos, sin, 1e-6)
    reference = norm_rotate_reference(query, weight, cos, sin, 1e-6)
    torch.testing.assert_close(ours, reference, **BF16)
    _assert_gradients_close([ours], [reference], {"projected": projected, "weight": weight}, 2e-2)
    x, residual = (torch.randn(total, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    weight = (torch.randn(1024, device="cuda") * 0.1).to(torch.bfloat16).requires_grad_()
    ours = kernels.add_rms_norm(x, residual, weight, 1e-6)
    added = x + residual
    reference = (added, rms_norm_reference(added, weight, 1e-6))
    torch.testing.assert_close(ours[0], reference[0], rtol=0, atol=0)  # the same bf16 sum
    torch.testing.assert_close(ours[1], reference[1], **BF16)
    _assert_gradients_close(list(ours), list(reference), {"x": x, "residual": residual, "weight": weight}, 2e-2)
    mlp = torch.randn(total, 2 * 3584, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ours, reference = (f(mlp[:, :3584], mlp[:, 3584:]) for f in (kernels.swiglu, swiglu_reference))
    torch.testing.assert_close(ours, reference, **BF16)
    _assert_gradients_close([ours], [reference], {"mlp": mlp}, 2e-2)
    mixer = torch.randn(total, 8224, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = torch.randn(total, 16, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gate = mixer[:, 6144:8192].view(total, 16, 128)
    norm = (1.0 + 0.1 * torch.randn(128, device="cuda")).to(torch.bfloat16)
    ours, reference = (f(out, gate, norm, 1e-6) for f in (kernels.rms_norm_gated, rms_norm_gated_reference))
    torch.testing.assert_close(ours, reference, **BF16)
    _assert_gradients_close([ours], [reference], {"out": out, "mixer": mixer}, 2e-2)
    # The attention's output gate, read in place between the query heads, on a transposed view
    # of an attention output [H, T, D] and on a contiguous one.
    attended = torch.randn(8, total, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gate = projected[:, :4096].view(total, 8, 512)[..., 256:]
    contiguous = attended.detach().transpose(0, 1).contiguous().requires_grad_()
    for x, leaf in ((attended.transpose(0, 1), attended), (contiguous, contiguous)):
        ours, reference = (f(x, gate) for f in (kernels.gated, gated_reference))
        torch.testing.assert_close(ours, reference, **BF16)
        _assert_gradients_close([ours], [reference], {"x": leaf, "projected": projected}, 2e-2)


@pytest.mark.gpu
def test_fused_gated_delta_rule_matches_reference_forward_and_gradients():
    total = sum(LENGTHS)
    inputs = [t.requires_grad_() for t in _delta_inputs(total, heads=2, value_heads=4, key_dim=64, value_dim=64,
                                                         device="cuda", dtype=torch.bfloat16)]
    start = torch.randn(len(LENGTHS), 4, 64, 64, device="cuda") * 0.1
    cu = _cu(LENGTHS, "cuda").to(torch.int32)
    out, final = kernels.chunk_gated_delta_rule(*inputs, start, True, cu)
    ref, ref_final = gated_delta_rule_reference(*inputs, start, True, cu.long())
    assert _relative_error(out, ref) < 1e-2 and _relative_error(final, ref_final) < 1e-2
    grads = torch.autograd.grad(out.float().square().sum(), inputs)
    ref_grads = torch.autograd.grad(ref.float().square().sum(), inputs)
    for name, grad, expected in zip(["q", "k", "v", "g", "beta"], grads, ref_grads):
        assert _relative_error(grad, expected) < 2e-2, name


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_gated_delta_rule_with_the_decay_in_kernel_matches_reference(dtype):
    # float32 compiles FLA's backward afresh (tilelang): minutes on a cold cache.
    """The raw gate input with A_log and dt_bias (FLA computes Qwen3.5's decay as it reads it)
    against the reference on the decay computed apart: forward and every gradient."""
    assert kernels.fused(torch.zeros(1, device="cuda")) is not None, "flash-linear-attention is not importable"
    total = sum(LENGTHS)
    q, k, v, _, beta = _delta_inputs(total, heads=2, value_heads=4, key_dim=64, value_dim=64, device="cuda",
                                     dtype=dtype)
    generator = torch.Generator(device="cpu").manual_seed(1)
    gate = torch.randn(1, total, 4, generator=generator).to("cuda", dtype)
    A_log, dt_bias = (torch.randn(4, generator=generator).to("cuda", dtype) * 0.5 for _ in range(2))
    inputs = [t.requires_grad_() for t in (q, k, v, gate, beta, A_log, dt_bias)]
    start = torch.randn(len(LENGTHS), 4, 64, 64, device="cuda") * 0.1
    cu = _cu(LENGTHS, "cuda").to(torch.int32)
    out, final = kernels.chunk_gated_delta_rule(q, k, v, gate, beta, start, True, cu, A_log=A_log, dt_bias=dt_bias)
    ref, ref_final = gated_delta_rule_reference(q, k, v, decay(gate, A_log, dt_bias), beta, start,
                                                True, cu.long())
    assert _relative_error(out, ref) < 1e-2 and _relative_error(final, ref_final) < 1e-2
    grads = torch.autograd.grad(out.float().square().sum(), inputs)
    ref_grads = torch.autograd.grad(ref.float().square().sum(), inputs)
    for name, grad, expected in zip(["q", "k", "v", "gate", "beta", "A_log", "dt_bias"], grads, ref_grads):
        assert _relative_error(grad, expected) < 2e-2, name


@pytest.mark.gpu
def test_fla_gradient_flows_into_the_forked_prefix_state():
    """The path of rows continuing shared prefixes when A_log and dt_bias train (`delta_rule`
    with their gradients: the prefix states forked, then FLA's chunked kernels) against the float32
    recurrence: the output and the gradients of q, k, v, the gate, beta, A_log, dt_bias and of
    the prefix states themselves, which carry every row's gradient back into its prefix (bf16)."""
    assert kernels.fused(torch.zeros(1, device="cuda")) is not None, "flash-linear-attention is not importable"
    lengths = [40, 17, 64, 5, 30]
    total = sum(lengths)
    q, k, v, _, beta = _delta_inputs(total, heads=2, value_heads=4, key_dim=64, value_dim=64, device="cuda",
                                     dtype=torch.bfloat16)
    q, k = l2norm(q.float()).bfloat16(), l2norm(k.float()).bfloat16()
    generator = torch.Generator(device="cpu").manual_seed(3)
    gate = torch.randn(1, total, 4, generator=generator).to("cuda", torch.bfloat16)
    A_log, dt_bias = (torch.randn(4, generator=generator).to("cuda") * 0.5 for _ in range(2))
    states = (torch.randn(2, 4, 64, 64, generator=generator) * 0.1).to("cuda")
    parents = torch.tensor([0, 1, 0, -1, 1], device="cuda")
    inputs = [t.requires_grad_() for t in (q, k, v, gate, beta, A_log, dt_bias, states)]
    cu = _cu(lengths, "cuda").to(torch.int32)
    out, _ = kernels.delta_rule(q[0], k[0], v[0], gate[0], beta[0], cu, cu.cpu(), max(lengths), None, A_log, dt_bias,
                                states, parents, True)
    out = out[None]
    reference, _ = gated_delta_rule_reference(q, k, v, decay(gate, A_log, dt_bias), beta,
                                              kernels.fork_states(states, parents, True), False, cu.long(),
                                              normalise=False)
    assert _relative_error(out, reference) < 1e-2
    weights = torch.randn(out.shape, generator=generator).to("cuda")
    grads = torch.autograd.grad((out.float() * weights).sum(), inputs)
    expected = torch.autograd.grad((reference.float() * weights).sum(), inputs)
    names = ["q", "k", "v", "gate", "beta", "A_log", "dt_bias", "prefix states"]
    for name, grad, reference_grad in zip(names, grads, expected):
        assert _relative_error(grad, reference_grad) < 2e-2, name
    assert grads[-1][0].abs().sum() > 0 and grads[-1][1].abs().sum() > 0  # both prefixes get their rows' gradient


def _forked_inputs(lengths, heads, value_heads, width, seed):
    """bf16 CUDA inputs of the inference delta-rule kernels for packed sequences of `lengths`:
    q, k (L2-normalised), v, the raw gate, beta, A_log, dt_bias, three prefix states and each
    sequence's parent among them (-1, 0, 1, 2, -1, ...), and int32 cumulative lengths."""
    total = sum(lengths)
    q, k, v, _, beta = _delta_inputs(total, heads=heads, value_heads=value_heads, key_dim=width, value_dim=width,
                                     device="cuda", dtype=torch.bfloat16)
    q, k = l2norm(q.float()).bfloat16(), l2norm(k.float()).bfloat16()
    generator = torch.Generator(device="cpu").manual_seed(seed)
    gate = torch.randn(1, total, value_heads, generator=generator).to("cuda", torch.bfloat16)
    A_log, dt_bias = (torch.randn(value_heads, generator=generator).to("cuda") * 0.5 for _ in range(2))
    states = torch.randn(3, value_heads, width, width, generator=generator).to("cuda") * 0.1
    parents = torch.tensor([n % 4 - 1 for n in range(len(lengths))], device="cuda")
    return q, k, v, gate, beta, A_log, dt_bias, states, parents, _cu(lengths, "cuda").to(torch.int32)


@pytest.mark.gpu
@pytest.mark.parametrize("heads, value_heads, width", [(16, 16, 128), (2, 4, 40)])
def test_delta_rule_rows_matches_reference_and_fla_on_forked_states(heads, value_heads, width):
    """The one-program-a-row kernel (bf16, rows of 1 to 64 tokens continuing forked states, some
    without a parent) against the float32 recurrence and FLA's chunked kernels on the same rows;
    also fed beta's logits, whose sigmoid it then takes itself (as the decoder runs it)."""
    lengths = [1, 15, 16, 17, 33, 63, 64, 28, 44]
    q, k, v, gate, beta, A_log, dt_bias, states, parents, cu = _forked_inputs(lengths, heads, value_heads, width, 2)
    from dohnuts.ops.delta_rule.rows import delta_rule_rows as rows

    with torch.no_grad():
        ours = rows(q[0], k[0], v[0], gate[0], beta[0], states, parents, cu, max(lengths), A_log, dt_bias)[None]
        from_logits = rows(q[0], k[0], v[0], gate[0], torch.logit(beta[0].float()).to(beta.dtype), states, parents,
                           cu, max(lengths), A_log, dt_bias, beta_logits=True)[None]
        forked = kernels.fork_states(states, parents, True)
        fla, _ = kernels.chunk_gated_delta_rule(q, k, v, gate, beta, forked, False, cu, False, cu.cpu(), None,
                                                A_log, dt_bias)
    reference, _ = gated_delta_rule_reference(q, k, v, decay(gate, A_log, dt_bias), beta, forked,
                                              False, cu.long(), normalise=False)
    assert _relative_error(ours, reference) < 1e-2
    assert _relative_error(ours, fla) < 1e-2
    assert _relative_error(from_logits, reference) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("parts_below", [2**31, 0], ids=["parts and walk", "one kernel"])
@pytest.mark.parametrize("heads, value_heads, width", [(16, 16, 128), (2, 4, 40)])
def test_delta_rule_scan_matches_reference_and_fla(heads, value_heads, width, parts_below, monkeypatch):
    """The whole-sequence scan (bf16, sequences of 1 to 2,048 tokens, its bound) by each of its
    paths: from zero
    states keeping the final states (as prefixes run), and from forked states (as long rows run),
    against the float32 recurrence and FLA's chunked kernels on the same sequences; also fed
    beta's logits, whose sigmoid it then takes itself; and routed on the device, as a bucket runs it."""
    lengths = [1, 15, 16, 17, 65, 130, 257, 700, 2048, 44]
    q, k, v, gate, beta, A_log, dt_bias, states, parents, cu = _forked_inputs(lengths, heads, value_heads, width, 3)
    from dohnuts.ops.delta_rule import scan as module
    from dohnuts.ops.delta_rule.scan import delta_rule_scan as scan
    from dohnuts.ops.plan import chunk_plan, padded_plan

    monkeypatch.setattr(module, "PARTS_BELOW", parts_below)

    log_decay = decay(gate, A_log, dt_bias)
    forked = kernels.fork_states(states, parents, True)
    with torch.no_grad():
        fresh, final = scan(q[0], k[0], v[0], gate[0], beta[0], None, None, cu, True, A_log, dt_bias)
        continued, _ = scan(q[0], k[0], v[0], gate[0], beta[0], states, parents, cu, False, A_log, dt_bias)
        logits = torch.logit(beta[0].float()).to(beta.dtype)
        fresh_from_logits, final_from_logits = scan(q[0], k[0], v[0], gate[0], logits, None, None, cu, True, A_log,
                                                    dt_bias, beta_logits=True)
        # Routed on the device as a bucket's graph runs it (a padded plan naming a last, empty
        # sequence), to the same path: 5 of the 10 sequences are over 64 tokens, so under 8 the
        # count picks the parts and walk, under 0 the one kernel. The routed parts failed to
        # compile after 5111a3d, so every such bucket ran eagerly; the interpreter had passed them.
        monkeypatch.setattr(module, "PARTS_BELOW", 8 if parts_below else 0)
        padded_cu = torch.cat([cu, cu[-1:]])
        plan = padded_plan(lengths + [0], len(chunk_plan(lengths)) + 3).to(q.device)
        routed, routed_final = scan(q[0], k[0], v[0], gate[0], beta[0], None, None, padded_cu, True, A_log, dt_bias,
                                    chunks=plan, routed=True)
        routed_continued, _ = scan(q[0], k[0], v[0], gate[0], beta[0], states, parents, cu, False, A_log, dt_bias,
                                   routed=True)
        fla_fresh, fla_final = kernels.fused(q)["chunk_gated_delta_rule"](
            q, k, v, gate, beta, output_final_state=True, cu_seqlens=cu, use_qk_l2norm_in_kernel=False,
            use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)
        fla_continued, _ = kernels.fused(q)["chunk_gated_delta_rule"](
            q, k, v, gate, beta, initial_state=forked, cu_seqlens=cu, use_qk_l2norm_in_kernel=False,
            use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)
    reference, reference_final = gated_delta_rule_reference(q, k, v, log_decay, beta, None, True, cu.long(),
                                                            normalise=False)
    reference_continued, _ = gated_delta_rule_reference(q, k, v, log_decay, beta, forked, False, cu.long(),
                                                        normalise=False)
    assert _relative_error(fresh[None], reference) < 1e-2 and _relative_error(fresh[None], fla_fresh) < 1e-2
    assert _relative_error(final, reference_final) < 1e-2 and _relative_error(final, fla_final) < 1e-2
    assert _relative_error(continued[None], reference_continued) < 1e-2
    assert _relative_error(continued[None], fla_continued) < 1e-2
    assert _relative_error(fresh_from_logits[None], reference) < 1e-2
    assert _relative_error(final_from_logits, reference_final) < 1e-2
    assert _relative_error(routed[None], reference) < 1e-2
    assert _relative_error(routed_final[:-1], reference_final) < 1e-2
    assert _relative_error(routed_continued[None], reference_continued) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("weak", [False, True], ids=["decay", "weak decay"])
def test_one_long_sequence_walked_in_64_token_steps_matches_the_reference(weak):
    """One long sequence walked as `kernels.delta_rule` walks it alone or in a one-row bucket
    (`scan.delta_rule_scan`'s `one_long`: 64-token steps, ALONE_VALUES values a program; bf16,
    the Qwen3.5-0.8B widths, 2,816 tokens then padding of 300 and an empty sequence): from zero
    and from forked states (the long one's among them), keeping the final states, against the
    float32 recurrence within the scan's own tolerance; also with decays of about -0.01 a token,
    under which the state entering each step weighs on all of it."""
    from dohnuts.ops.delta_rule import scan

    lengths = [2816, 300, 0]
    q, k, v, gate, beta, A_log, dt_bias, states, parents, cu = _forked_inputs(lengths, 16, 16, 128, 5)
    parents = parents.flip(0)  # 1, 0, -1: the long sequence continues a state too
    if weak:
        A_log = torch.full_like(A_log, -4.0)
    log_decay = decay(gate, A_log, dt_bias)
    forked = kernels.fork_states(states, parents, True)
    with torch.no_grad():
        fresh, final = scan.delta_rule_scan(q[0], k[0], v[0], gate[0], beta[0], None, None, cu, True, A_log, dt_bias,
                                            one_long=True)
        continued, continued_final = scan.delta_rule_scan(q[0], k[0], v[0], gate[0], beta[0], states, parents, cu,
                                                          True, A_log, dt_bias, one_long=True)
    reference, reference_final = gated_delta_rule_reference(q, k, v, log_decay, beta, None, True, cu.long(),
                                                            normalise=False)
    reference_continued, reference_continued_final = gated_delta_rule_reference(
        q, k, v, log_decay, beta, forked, True, cu.long(), normalise=False)
    assert _relative_error(fresh[None], reference) < 1e-2
    assert _relative_error(final, reference_final) < 1e-2
    assert _relative_error(continued[None], reference_continued) < 1e-2
    assert _relative_error(continued_final, reference_continued_final) < 1e-2


@pytest.mark.gpu
def test_inference_walks_sequences_past_the_gradient_bound_and_never_calls_fla(monkeypatch):
    """Forward only, `kernels.delta_rule` sends sequences of any length to the scan (here a
    prefix of 5,000 tokens, past `SCAN_TOKENS`, beside short ones): FLA, which tunes its kernels
    on a first long sequence for seconds (issue 37), is never called at inference. Against the
    float32 recurrence, as the scan's own test."""
    from dohnuts.ops.delta_rule import scan as module

    lengths = [5000, 17, 64, 3]
    assert max(lengths) > module.SCAN_TOKENS and module.FORWARD_TOKENS is None
    q, k, v, gate, beta, A_log, dt_bias, _, _, cu = _forked_inputs(lengths, 16, 16, 128, 4)

    def refused(*args, **kwargs):
        raise AssertionError("FLA's chunked kernels were called at inference")

    monkeypatch.setattr(kernels, "chunk_gated_delta_rule", refused)
    with torch.no_grad():
        ours, final = kernels.delta_rule(q[0], k[0], v[0], gate[0], beta[0], cu, cu.cpu(), max(lengths), None,
                                         A_log, dt_bias, output_final_state=True)
    reference, reference_final = gated_delta_rule_reference(q, k, v, decay(gate, A_log, dt_bias), beta, None, True,
                                                            cu.long(), normalise=False)
    assert _relative_error(ours[None], reference) < 1e-2 and _relative_error(final, reference_final) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("heads, value_heads, width", [(16, 16, 128), (2, 4, 40)])
def test_delta_rule_gradient_matches_reference_and_fla(heads, value_heads, width):
    """delta_rule.backward.delta_rule in bf16 (sequences of 1 to 1,100 tokens), its gradients against
    autograd through the float32 recurrence and through FLA's chunked kernels, to 2% relative
    (norm-wise): from zero states keeping the final states (the prefixes, with a gradient at
    the final states), and from forked states (the rows, with the states' gradient)."""
    from dohnuts.ops.delta_rule import backward

    lengths = [1, 15, 16, 17, 65, 130, 257, 700, 1100, 44]
    q, k, v, gate, beta, A_log, dt_bias, states, parents, cu = _forked_inputs(lengths, heads, value_heads, width, 4)
    leaves = {name: x.detach().requires_grad_() for name, x in
              {"q": q, "k": k, "v": v, "gate": gate, "beta": beta, "states": states}.items()}
    q, k, v, gate, beta, states = leaves.values()
    fla = kernels.fused(q)["chunk_gated_delta_rule"]
    gates = {"use_qk_l2norm_in_kernel": False, "use_gate_in_kernel": True, "A_log": A_log, "dt_bias": dt_bias}
    fresh_inputs = {name: leaves[name] for name in ("q", "k", "v", "gate", "beta")}
    ours = backward.delta_rule(q[0], k[0], v[0], gate[0], beta[0], None, None, cu, True, A_log, dt_bias)
    reference = gated_delta_rule_reference(q, k, v, decay(gate, A_log, dt_bias), beta, None, True,
                                           cu.long(), normalise=False)
    theirs = fla(q, k, v, gate, beta, output_final_state=True, cu_seqlens=cu, **gates)
    ours = (ours[0][None], ours[1])
    assert _relative_error(ours[0], reference[0]) < 1e-2 and _relative_error(ours[1], reference[1]) < 1e-2
    _assert_gradients_close(ours, reference, fresh_inputs, 2e-2)
    ours = backward.delta_rule(q[0], k[0], v[0], gate[0], beta[0], None, None, cu, True, A_log, dt_bias)
    _assert_gradients_close((ours[0][None], ours[1]), theirs, fresh_inputs, 2e-2)

    ours = backward.delta_rule(q[0], k[0], v[0], gate[0], beta[0], states, parents, cu, False, A_log, dt_bias)
    forked = kernels.fork_states(states, parents, True)
    reference = gated_delta_rule_reference(q, k, v, decay(gate, A_log, dt_bias), beta, forked, False,
                                           cu.long(), normalise=False)
    assert _relative_error(ours[0][None], reference[0]) < 1e-2
    _assert_gradients_close([ours[0][None]], [reference[0]], leaves, 2e-2)
    ours = backward.delta_rule(q[0], k[0], v[0], gate[0], beta[0], states, parents, cu, False, A_log, dt_bias)
    theirs = fla(q, k, v, gate, beta, initial_state=kernels.fork_states(states, parents, True), cu_seqlens=cu,
                 **gates)
    _assert_gradients_close([ours[0][None]], [theirs[0]], leaves, 2e-2)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    """tests/ops/triton_interpreted.py run once in a subprocess under Triton's interpreter: its
    result and the path of the kernel variants it launched (JSON, `record_launches`)."""
    pytest.importorskip("triton")
    launches = tmp_path_factory.mktemp("launches") / "launches.json"
    script = Path(__file__).with_name("triton_interpreted.py")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
           "DOHNUTS_LAUNCHES": str(launches)}
    result = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=1200)
    return result, launches


def test_triton_kernels_match_references_under_triton_interpreter(interpreted):
    """Our Triton kernels on the CPU through Triton's interpreter (tests/ops/triton_interpreted.py):
    conv_split_heads, the norms, the norm fused with the rotary embedding and SwiGLU (also reading
    column blocks of a packed projection's output in place) against their references, outputs and
    every gradient, on packed sequences of 1 to 130 tokens with and without carried and final
    states; delta_rule_rows against the recurrence on forked states (also on badly conditioned
    blocks, against float64); the scan (also as one long sequence, `one_long`) against the recurrence;
    the merge of two attention partials (`merge.fused`, in place over a view) against its reference;
    and the decoder with them (its CUDA path) against its CPU path, with prefixes forked to rows,
    short rows taking delta_rule_rows only without gradients."""
    result, _ = interpreted
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stdout + result.stderr


def test_every_kernel_variant_the_interpreter_ran_compiles_for_hopper(interpreted):
    """Each variant of our kernels the interpreter launched above (argument types and constexpr
    values) compiles for sm_90 with Triton's own compiler, on the CPU. The interpreter does not type
    a kernel's names, so a kernel it runs may not compile: after 5111a3d the routed variant of
    `_delta_scan_parts` gave `_` an int32 in one branch and a bf16 block in another, every bucket
    whose delta rule is routed failed its CUDA graph capture, and 205 of 243 ran eagerly."""
    import importlib
    import json

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    result, launches = interpreted
    if result.returncode != 0:
        pytest.skip("the interpreter's run failed (its own test says why)")
    variants = json.loads(launches.read_text())
    kernels_seen = {variant["kernel"] for variant in variants}
    assert {"_delta_scan_parts", "_delta_scan_walk", "_delta_scan_fwd", "_chunk_walk", "_scan_route",
            "_conv_heads_fwd", "_swiglu_fwd", "_merge_fwd"} <= kernels_seen, sorted(kernels_seen)
    failures = []
    for variant in variants:
        kernel = getattr(importlib.import_module(variant["module"]), variant["kernel"])
        constexprs = {(kernel.arg_names.index(name),): value for name, value in variant["constexprs"].items()}
        source = ASTSource(fn=kernel, signature=variant["signature"], constexprs=constexprs)
        try:
            triton.compile(source, target=GPUTarget("cuda", 90, 32), options=variant["options"])
        except Exception as error:  # noqa: BLE001 - every failing variant is listed
            failures.append(f"{variant['kernel']} {variant['constexprs']}: {type(error).__name__}: {error}")
    assert not failures, "\n\n".join(failures)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, carried", [(torch.bfloat16, True), (torch.float32, True), (torch.bfloat16, False)])
def test_triton_conv_split_heads_matches_reference_forward_and_gradients(dtype, carried):
    """The fused convolution and head split on packed sequences [63, 1, 17, 64, 130] of the
    Qwen3.5-0.8B widths, from carried states and keeping final states (or neither): outputs,
    final states and the gradients of the input, the weight and the carried state."""
    assert backends._triton_kernels() is not None, "no Triton: the test would compare the reference with itself"
    heads, key_dim, value_heads, value_dim, width = 16, 128, 16, 128, 4
    channels = 2 * heads * key_dim + value_heads * value_dim
    lengths = LENGTHS + [130]
    cu_cpu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    cu = cu_cpu.cuda()
    x = torch.randn(sum(lengths), channels, device="cuda", dtype=dtype, requires_grad=True)
    weight = (torch.randn(channels, width, device="cuda") * 0.5).to(dtype).requires_grad_()
    state = (torch.randn(len(lengths), channels, width, device="cuda", dtype=dtype, requires_grad=True)
             if carried else None)
    inputs = (x, weight, state) if carried else (x, weight)
    ours = kernels.conv_split_heads(x, weight, state, carried, cu, cu_cpu, None, heads, key_dim, value_heads,
                                    value_dim)
    reference = conv_split_heads_reference(x, weight, state, carried, cu.long(), heads, key_dim, value_heads,
                                           value_dim)
    assert (ours[3] is None) == (not carried)
    ours, reference = [out for out in ours if out is not None], [out for out in reference if out is not None]
    tolerance = BF16 if dtype == torch.bfloat16 else {"rtol": 1e-4, "atol": 1e-4}
    for out, expected in zip(ours, reference):
        torch.testing.assert_close(out, expected, **tolerance)
    _assert_gradients_close(ours, reference, dict(zip(["x", "weight", "state"], inputs)),
                            2e-2 if dtype == torch.bfloat16 else 1e-4)


@pytest.mark.gpu
def test_varlen_attention_matches_reference_with_prefix_keys_and_grouped_heads():
    """Flash varlen attention (bf16) against the padded reference: queries [63, 1, 17, 64] after
    [64, 0, 5, 128] prefix keys, 8 query heads on 2 key heads, forward and gradients."""
    queries, prefixes = LENGTHS, [64, 0, 5, 128]
    keys = [q + p for q, p in zip(queries, prefixes)]
    cu_q, cu_k = _cu(queries, "cuda").to(torch.int32), _cu(keys, "cuda").to(torch.int32)
    q = torch.randn(sum(queries), 8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(sum(keys), 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(sum(keys), 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = kernels.attention(q, k, v, cu_q, cu_k, max(queries), max(keys), 0.125)
    ref = attention_reference(q.float(), k.float(), v.float(), cu_q, cu_k, 0.125)
    assert _relative_error(out, ref) < 1e-2
    grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for name, grad, expected in zip(["q", "k", "v"], grads, ref_grads):
        assert _relative_error(grad, expected) < 2e-2, name


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_lone_rows_attention_over_the_whole_axis_equals_its_own_attention(device, monkeypatch):
    """A one-row bucket's attention with `attention.DENSE_LONE` (`kernels.lone_row_attention`:
    the row, then its padding, as one causal sequence; cuDNN's fused kernel on CUDA) against
    `kernels.attention` of the row, its padding and an empty row as their own sequences: over
    the row, equal on the CPU (float32, 1e-5) and within bf16's resolution on CUDA (torch's
    varlen flash kernel; relative 1e-2); grouped-query heads of 256, as Qwen3.5's."""
    from dohnuts.ops import attention

    monkeypatch.setattr(attention, "DENSE_LONE", True)
    row, total = 300, 384
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    generator = torch.Generator(device).manual_seed(3)
    q = torch.randn(total, 8, 256, device=device, generator=generator).to(dtype)
    k, v = (torch.randn(total, 2, 256, device=device, generator=generator).to(dtype) for _ in range(2))
    bounds = torch.tensor([0, row, total, total], dtype=torch.int32, device=device)
    alone = kernels.attention(q, k, v, bounds, bounds, total, total, 0.0625)[:row]
    whole = kernels.lone_row_attention(q, k, v, bounds, total, 0.0625)
    assert whole.shape == q.shape
    if device == "cpu":
        torch.testing.assert_close(whole[:row], alone, rtol=1e-5, atol=1e-5)
    else:
        assert _relative_error(whole[:row], alone) < 1e-2


def test_the_padded_reference_attention_in_slices_equals_each_sequence_alone(monkeypatch):
    """The reference pads every sequence to the longest; a bucket's hundreds of padding rows beside
    one long row ran it out of memory (144 GiB), so it goes through the sequences in slices. With
    a budget of one sequence a slice, and of all at once, each sequence's output equals plain
    causal attention of that sequence alone (bottom-right aligned after its prefix keys), float32."""
    from dohnuts.ops import attention

    queries, prefixes = [7, 1, 30, 0, 12], [3, 0, 9, 2, 0]
    keys = [q + p for q, p in zip(queries, prefixes)]
    cu_q, cu_k = _cu(queries, "cpu").to(torch.int32), _cu(keys, "cpu").to(torch.int32)
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(sum(queries), 4, 8, generator=generator)
    k, v = (torch.randn(sum(keys), 2, 8, generator=generator) for _ in range(2))
    expected = []
    for n, (lq, lk) in enumerate(zip(queries, keys)):
        qs, ks, vs = q[cu_q[n]:cu_q[n + 1]], k[cu_k[n]:cu_k[n + 1]], v[cu_k[n]:cu_k[n + 1]]
        scores = torch.einsum("qhd,khd->hqk", qs, ks.repeat_interleave(2, dim=1)) * 0.125
        visible = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)
        weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        expected.append(torch.einsum("hqk,khd->qhd", weights, vs.repeat_interleave(2, dim=1)))
    expected = torch.cat(expected)
    for budget in (1, attention.REFERENCE_SCORES):
        monkeypatch.setattr(attention, "REFERENCE_SCORES", budget)
        out = attention_reference(q, k, v, cu_q, cu_k, 0.125, max(queries), max(keys))
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)



# Prefixes (one empty in the middle, padding ones of at most 64 tokens, an empty last one) and rows
# (short and long, one empty, padding ones, an empty last one) as a bucket pads them; rows 0 and 1
# continue prefix 0, row 3 none, row 4 prefix 2, the padding none.
FORK_PREFIXES, FORK_ROWS, FORK_PARENTS = [100, 0, 70, 64, 6, 0], [20, 130, 0, 7, 64, 64, 11, 0], [0, 0, -1, -1, 2, -1,
                                                                                                     -1, -1]


def _fork_inputs(device, dtype, heads=4, key_heads=2, width=16, seed=0):
    """q, k, v of FORK_PREFIXES and FORK_ROWS' tokens, their gathering `Fork` and their
    `ChunkedFork` (chunks padded two past what they need)."""
    from dohnuts.ops.plan import plan_fork

    total = sum(FORK_PREFIXES) + sum(FORK_ROWS)
    generator = torch.Generator(device).manual_seed(seed)
    q = torch.randn(total, heads, width, device=device, generator=generator).to(dtype)
    k, v = (torch.randn(total, key_heads, width, device=device, generator=generator).to(dtype) for _ in range(2))
    gathering = plan_fork(FORK_PREFIXES, FORK_ROWS, FORK_PARENTS)
    chunked = _chunked(FORK_PREFIXES, FORK_ROWS, FORK_PARENTS, 2 + sum(-(-n // 64) for n in FORK_PREFIXES),
                       2 + sum(-(-n // 64) for n in FORK_ROWS))
    return q, k, v, gathering.map(lambda t: t.to(device)), chunked.map(lambda t: t.to(device))


def _chunked(prefixes, rows, parents, prefix_chunks, row_chunks):
    """The `ChunkedFork` of a bucket's padded layout, its chunk plans padded to these counts."""
    from dohnuts.ops.plan import padded_plan, plan_chunked_fork

    return plan_chunked_fork(prefixes, rows, parents, padded_plan(prefixes, prefix_chunks),
                             padded_plan(rows, row_chunks), 256, 192)


def test_a_chunked_fork_sees_the_keys_a_gathered_fork_sees(monkeypatch):
    """`plan_chunked_fork` and its reference (`chunked_fork_reference`: one masked softmax) against
    the gathering `Fork` through the padded reference, float64: every prefix sees its own keys,
    every row its prefix's and then its own, in static slices of one query as of all at once."""
    from dohnuts.ops import attention

    q, k, v, gathering, chunked = _fork_inputs("cpu", torch.float64)
    expected = attention_reference(q, k[gathering.key_index], v[gathering.key_index], gathering.cu_seqlens_q,
                                   gathering.cu_seqlens_k, 0.25, gathering.max_seqlen_q, gathering.max_seqlen_k)
    for budget in (1, attention.REFERENCE_SCORES):
        monkeypatch.setattr(attention, "REFERENCE_SCORES", budget)
        out = kernels.chunked_fork_attention(q, k, v, chunked, sum(FORK_PREFIXES), 0.25)
        torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    # Each chunk's queries, its keys' start and count, and each row chunk's prefix: chunk by chunk.
    assert chunked.own_q.tolist()[:5] == [0, 64, 100, 164, 170] and chunked.own_k.tolist()[:4] == [0, 0, 100, 100]
    assert chunked.own_used.tolist()[:4] == [64, 100, 64, 70]
    assert chunked.cross_k.tolist()[:5] == [0, 0, 0, 0, 0] and chunked.cross_used.tolist()[:6] == [100, 100, 100, 100,
                                                                                                   0, 70]


def test_merged_partials_equal_attention_over_both_sets_of_keys():
    """`merge_partials_reference` of attention over two disjoint sets of keys, each with its log-sum-exp,
    equals one softmax over both (float64); a query with no key in the second set (flash
    attention's log-sum-exp +inf and output 0) takes the first's alone."""
    from dohnuts.ops.merge.naive import merge_partials_reference

    generator = torch.Generator().manual_seed(1)
    q = torch.randn(5, 3, 8, generator=generator, dtype=torch.float64)
    k, v = (torch.randn(9, 3, 8, generator=generator, dtype=torch.float64) for _ in range(2))
    scores = torch.einsum("qhd,khd->hqk", q, k)

    def part(keys):
        lse = torch.logsumexp(scores[..., keys], -1)
        out = torch.einsum("hqk,khd->qhd", (scores[..., keys] - lse[..., None]).exp(), v[keys])
        return out, lse

    (first, first_lse), (second, second_lse) = part(slice(0, 4)), part(slice(4, 9))
    whole, _ = part(slice(0, 9))
    second_lse[:, 2], second[2] = float("inf"), 0.0  # query 2: no key in the second set
    merged = merge_partials_reference(first, first_lse, second, second_lse)
    torch.testing.assert_close(merged[[0, 1, 3, 4]], whole[[0, 1, 3, 4]], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(merged[2], first[2], rtol=1e-12, atol=1e-12)


@pytest.mark.gpu
def test_chunked_fork_flash_attention_matches_its_reference_and_replays_in_a_graph():
    """A bucket's attention by chunk on CUDA (`chunked_fork_partials`: two flash calls, merged by
    log-sum-exp in one Triton kernel, `merge.fused`; bf16, Qwen3.5's 8 query heads on 2 key
    heads of 256) against the gathering fork's reference in float32 (relative 1e-2); captured in
    a CUDA graph, it replays another layout of the same chunk counts (the prefixes and rows
    moved) as a call of it."""
    q, k, v, gathering, chunked = _fork_inputs("cuda", torch.bfloat16, heads=8, width=256)
    prefix_tokens = sum(FORK_PREFIXES)
    expected = attention_reference(q.float(), k.float()[gathering.key_index], v.float()[gathering.key_index],
                                   gathering.cu_seqlens_q, gathering.cu_seqlens_k, 0.0625, gathering.max_seqlen_q,
                                   gathering.max_seqlen_k)
    out = kernels.chunked_fork_attention(q, k, v, chunked, prefix_tokens, 0.0625)
    assert _relative_error(out, expected) < 1e-2
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        kernels.chunked_fork_attention(q, k, v, chunked, prefix_tokens, 0.0625)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = kernels.chunked_fork_attention(q, k, v, chunked, prefix_tokens, 0.0625)
    # Another layout of as many prefix tokens, rows and row tokens within the same chunk counts:
    # one prefix of 240, rows of 1 to 150 tokens.
    other = _chunked([240, 0], [150, 1, 30, 39, 40, 36, 0, 0], [0, 0, -1, 0, 0, -1, -1, -1],
                     len(chunked.own_used) - len(chunked.cross_used), len(chunked.cross_used))
    for mine, theirs in zip(chunked.tensors(), other.tensors()):
        mine.copy_(theirs)
    graph.replay()
    torch.testing.assert_close(captured, kernels.chunked_fork_attention(q, k, v, chunked, prefix_tokens, 0.0625))
    expected = kernels.chunked_fork_attention(q.float(), k.float(), v.float(), chunked, prefix_tokens, 0.0625)
    assert _relative_error(captured, expected) < 1e-2

def test_uncached_plans_sets_flas_switch_for_nested_users_and_restores_it(monkeypatch):
    utils = types.ModuleType("fla.utils")
    utils.FLA_DISABLE_TENSOR_CACHE = False
    monkeypatch.setitem(sys.modules, "fla.utils", utils)
    monkeypatch.setattr(backends, "_fla", lambda: {})
    with backends.uncached_plans():
        with backends.uncached_plans():
            assert utils.FLA_DISABLE_TENSOR_CACHE is True
        assert utils.FLA_DISABLE_TENSOR_CACHE is True  # the outer user still needs it
    assert utils.FLA_DISABLE_TENSOR_CACHE is False


def test_first_fused_delta_rule_call_of_a_head_shape_tunes_on_the_tuning_batch(monkeypatch):
    """FLA keeps the kernel configuration its first call of a head shape chose; that first call
    must be the tuning batch (many short rows with carried states), not the caller's batch."""
    calls = []

    def fake(q, k, v, g, beta, initial_state=None, output_final_state=False, cu_seqlens=None, **options):
        calls.append({"q": q.shape, "v": v.shape, "state": None if initial_state is None else initial_state.shape,
                      "cu": cu_seqlens.tolist(), "options": options, "grad": torch.is_grad_enabled(),
                      "rng": torch.get_rng_state()})
        if options["chunk_indices"] is not None:  # the plan FLA would make: (row, chunk) of 64 tokens
            lengths = cu_seqlens.diff().tolist()
            assert options["chunk_indices"].tolist() == [[n, c] for n, length in enumerate(lengths)
                                                         for c in range(-(-length // 64))]
            assert options["cu_seqlens_cpu"].tolist() == cu_seqlens.tolist()
        return torch.zeros_like(v), None

    monkeypatch.setattr(kernels, "fused", lambda x: {"chunk_gated_delta_rule": fake})
    monkeypatch.setattr(chunk, "_TUNED", set())
    A_log, dt_bias = torch.randn(4, requires_grad=True), torch.randn(4)

    def call(heads, key_dim, value_heads, value_dim, tokens=70):
        """The global generator's state once the inputs are made."""
        q, v = torch.randn(1, tokens, heads, key_dim), torch.randn(1, tokens, value_heads, value_dim)
        a, b = torch.randn(1, tokens, value_heads), torch.rand(1, tokens, value_heads)
        rng = torch.get_rng_state()
        kernels.chunk_gated_delta_rule(
            q, q.clone(), v, a, b, None, True, torch.tensor([0, 64, tokens], dtype=torch.int32),
            use_qk_l2norm_in_kernel=False, A_log=A_log[:value_heads], dt_bias=dt_bias[:value_heads],
            cu_seqlens_cpu=torch.tensor([0, 64, tokens], dtype=torch.int32), chunk_indices=None)
        return rng

    rng = call(2, 8, 4, 6)
    # The tuning call came first, on its own packed batch, with the caller's options.
    rows, length = chunk.TUNING_ROWS, chunk.TUNING_LENGTH
    assert len(calls) == 2
    tuning, real = calls
    assert tuning["q"] == (1, rows * length, 2, 8) and tuning["v"] == (1, rows * length, 4, 6)
    assert tuning["state"] == (rows, 4, 8, 6)
    assert tuning["cu"] == list(range(0, rows * length + 1, length))
    assert tuning["options"].keys() == real["options"].keys()
    assert tuning["options"]["use_gate_in_kernel"] is True and not tuning["grad"]
    assert real["q"] == (1, 70, 2, 8) and real["cu"] == [0, 64, 70]
    assert torch.equal(real["rng"], rng)  # tuning left the global generator untouched
    # The same head shape again: no second tuning; a new head shape tunes once more.
    call(2, 8, 4, 6, tokens=90)
    assert len(calls) == 3
    call(1, 8, 2, 6)
    assert len(calls) == 5 and calls[3]["v"] == (1, rows * length, 2, 6)


def test_slow_paths_are_recorded_once_with_their_reason(monkeypatch, caplog):
    monkeypatch.setattr(backends, "_SLOW", {})
    monkeypatch.setattr(backends, "_fla", lambda: None)
    monkeypatch.setattr(backends, "_triton_kernels", lambda: None)
    on_cuda = types.SimpleNamespace(is_cuda=True, dtype=torch.bfloat16)  # what the dispatch reads of a tensor
    with caplog.at_level(logging.WARNING, logger=backends.__name__):
        for _ in range(3):
            assert backends.fused(on_cuda) is None and backends._ours(on_cuda) is None
    assert backends.fused(torch.zeros(1)) is None  # the CPU takes the reference: not a slow path
    paths = backends.slow_paths()
    assert set(paths) == {"fla", "triton"} and "plain-PyTorch chunked reference" in paths["fla"]
    assert [record.message for record in caplog.records] == [paths["fla"], paths["triton"]]


def test_fla_backend_settings_are_set_by_the_project_not_the_environment(monkeypatch):
    monkeypatch.setattr(backends, "_SLOW", {})
    monkeypatch.setenv("FLA_FLASH_QLA", "1")
    monkeypatch.delenv("FLA_INTRACARD_CP", raising=False)
    backends._fla.cache_clear()
    try:
        backends._fla()
        assert os.environ["FLA_FLASH_QLA"] == "0" and os.environ["FLA_INTRACARD_CP"] == "0"
        assert "overridden" in backends.slow_paths()["env:FLA_FLASH_QLA"]
    finally:
        backends._fla.cache_clear()
