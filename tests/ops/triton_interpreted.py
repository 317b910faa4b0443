"""Our Triton kernels (the `fused` module of each family in dohnuts.ops, and the delta rule's
`rows`, `scan` and `backward`) against their references, run on the CPU by Triton's
interpreter.
`test_kernels.py` runs this file in a subprocess with TRITON_INTERPRET=1, which Triton reads
when the kernels are defined. Exits non-zero on the first mismatch. With DOHNUTS_LAUNCHES set, it
writes there (JSON) each variant of our kernels it launched: its argument types and constexpr
values, which `test_kernels.py` then compiles for a GPU (`record_launches`)."""

import contextlib
import copy
import inspect
import json
import os
import sys

import torch
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

from dohnuts.ops import backends, kernels
from dohnuts.ops.conv import fused as conv_fused
from dohnuts.ops.conv.naive import conv_split_heads_reference
from dohnuts.ops.delta_rule import backward as delta_backward
from dohnuts.ops.delta_rule import rows as delta_rows
from dohnuts.ops.delta_rule import scan as delta_scan
from dohnuts.ops.delta_rule.naive import decay, gated_delta_rule_reference
from dohnuts.ops.merge import fused as merge_fused
from dohnuts.ops.merge.naive import merge_partials_reference
from dohnuts.ops.norm import fused as norm_fused
from dohnuts.ops.norm.naive import (
    norm_rotate_reference,
    rms_norm_gated_reference,
    rms_norm_reference,
    split_rotate_reference,
)
from dohnuts.ops.plain import l2norm
from dohnuts.ops.plan import chunk_plan, padded_plan
from dohnuts.ops.swiglu import fused as swiglu_fused
from dohnuts.ops.swiglu.naive import gated_reference, swiglu_reference

TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}
POINTER_TYPES = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.int32: "*i32",
                 torch.int64: "*i64", torch.bool: "*i1", torch.uint8: "*u8", torch.int8: "*i8"}


def record_launches(path: str) -> None:
    """Record every launch of our kernels (modules of dohnuts) under the interpreter, and write the
    distinct variants to `path` at exit: {"module", "kernel", "signature" (argument -> Triton type,
    "constexpr" for a constexpr or None), "constexprs" (argument -> value), "num_warps"}. The
    interpreter runs a kernel without typing its names, so a kernel it passes may still fail to
    compile (a name given an int32 in one branch and a block in another did, 5111a3d)."""
    import atexit

    variants = {}
    run = InterpretedFunction.run

    def recording(self, *args, grid, warmup, **kwargs):
        function = self.fn
        if function.__module__.startswith("dohnuts."):
            parameters = inspect.signature(function).parameters
            bound = dict(zip(self.arg_names, args))
            bound.update({name: value for name, value in kwargs.items() if name in parameters})
            signature, constexprs = {}, {}
            for name, parameter in parameters.items():
                value = bound.get(name, parameter.default)
                # Annotations are strings in modules that postpone them (`from __future__ import annotations`).
                if parameter.annotation in (tl.constexpr, "tl.constexpr") or value is None:
                    signature[name] = "constexpr"
                    constexprs[name] = value
                elif isinstance(value, torch.Tensor):
                    signature[name] = POINTER_TYPES[value.dtype]
                elif isinstance(value, bool):
                    signature[name] = "i1"
                elif isinstance(value, int):
                    signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
                else:
                    signature[name] = "fp32"
            options = {name: kwargs[name] for name in ("num_warps", "num_stages") if kwargs.get(name) is not None}
            variant = {"module": function.__module__, "kernel": function.__name__, "signature": signature,
                       "constexprs": constexprs, "options": options}
            variants.setdefault(json.dumps(variant, sort_keys=True, default=repr), variant)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    def write():
        with open(path, "w") as file:
            json.dump(list(variants.values()), file, default=repr)

    InterpretedFunction.run = recording
    atexit.register(write)


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


def check_conv_split_heads():
    default = conv_fused.TOKENS
    try:
        for tokens in sorted({default, 16, 64}):  # whole planned chunks a program, and blocks of them
            conv_fused.TOKENS = tokens
            check_conv_split_heads_blocks()
    finally:
        conv_fused.TOKENS = default


def check_conv_split_heads_blocks():
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
                ours = conv_fused.conv_split_heads(x, weight, state, keep, cu, cu, None, heads, key_dim, value_heads,
                                                   value_dim)
                reference = conv_split_heads_reference(x, weight, state, keep, cu.long(), heads, key_dim,
                                                       value_heads, value_dim)
                case = f"conv_split_heads tokens={conv_fused.TOKENS} lengths={lengths} state={with_state} final={keep}"
                for name, a, b in zip(["q", "k", "v", "final"], ours, reference):
                    if b is None:
                        assert a is None, f"{case}: {name}"
                    else:
                        close(f"{case} {name}", a, b)
                outputs = [out for out in ours if out is not None]
                expected = [out for out in reference if out is not None]
                for name, a, b in zip(["x", "weight", "state"], grads(outputs, inputs, 1), grads(expected, inputs, 1)):
                    close(f"{case} grad {name}", a, b)
                if with_state:
                    # Two carried states read through parents (-1: a zero state), forward only.
                    shared = torch.randn(2, channels, width)
                    parents = torch.tensor([n % 3 - 1 for n in range(len(lengths))])  # -1, 0, 1, -1, ...
                    with torch.no_grad():
                        ours = conv_fused.conv_split_heads(x, weight, shared, keep, cu, cu, None, heads, key_dim,
                                                           value_heads, value_dim, parents)
                        reference = conv_split_heads_reference(
                            x, weight, kernels.fork_states(shared, parents, True), keep, cu.long(), heads, key_dim,
                            value_heads, value_dim)
                    for name, a, b in zip(["q", "k", "v", "final"], ours, reference):
                        if b is None:
                            assert a is None, f"{case} through parents: {name}"
                        else:
                            close(f"{case} through parents {name}", a, b)


def check_norms_and_swiglu():
    generator = torch.Generator().manual_seed(3)
    wide = torch.randn(21, 3, 80, generator=generator)
    cases = [torch.randn(37, 96, generator=generator),  # rows of a 2-D tensor
             wide.view(21, 3, 2, 40)[:, :, 0],  # [T, H, D] read with strides, as the q norm reads
             torch.randn(2, 3, 5, 16, generator=generator)]  # any contiguous shape
    for x in cases:
        x = x.clone().requires_grad_() if x.is_contiguous() else x.detach().requires_grad_()
        weight = (torch.randn(x.shape[-1], generator=generator) * 0.2).requires_grad_()
        ours = norm_fused.rms_norm(x, 1.0 + weight, 1e-6)
        reference = rms_norm_reference(x, weight, 1e-6)
        close(f"rms_norm {tuple(x.shape)}", ours, reference)
        for name, a, b in zip(["x", "weight"], grads([ours], [x, weight], 4), grads([reference], [x, weight], 4)):
            close(f"rms_norm {tuple(x.shape)} grad {name}", a, b)
    # A saved-tensor hook may hand the backward a repacked x: its gradient must not change.
    x = wide.view(21, 3, 2, 40)[:, :, 1].detach().requires_grad_()
    weight = torch.randn(40, generator=generator) * 0.2
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t.contiguous().clone(), lambda t: t):
        repacked = norm_fused.rms_norm(x, 1.0 + weight, 1e-6)
    plain = rms_norm_reference(x, weight, 1e-6)
    close("rms_norm grad through a repacking hook", grads([repacked], [x], 7)[0], grads([plain], [x], 7)[0])
    for shape, block in [((19, 4, 24), False), ((7, 130), False), ((19, 4, 24), True), ((7, 130), True)]:
        # With `block`, the gate is a column block of a wider projection output, read in place.
        x = torch.randn(*shape, generator=generator, requires_grad=True)
        outputs = torch.randn(shape[0], 7 + shape[1] * (shape[2] if len(shape) == 3 else 1) + 5,
                              generator=generator, requires_grad=True)
        z = outputs[:, 7:-5].view(shape) if block else torch.randn(*shape, generator=generator, requires_grad=True)
        leaf = outputs if block else z
        weight = (1.0 + 0.2 * torch.randn(shape[-1], generator=generator)).requires_grad_()
        ours = norm_fused.rms_norm_gated(x, z, weight, 1e-6)
        reference = rms_norm_gated_reference(x, z, weight, 1e-6)
        close(f"rms_norm_gated {shape} block={block}", ours, reference)
        for name, a, b in zip(["x", "gate", "weight"], grads([ours], [x, leaf, weight], 6),
                              grads([reference], [x, leaf, weight], 6)):
            close(f"rms_norm_gated {shape} block={block} grad {name}", a, b)
    default = swiglu_fused.BY_ROWS, swiglu_fused.BLOCK
    try:
        # Programs over runs of the flattened output, and over rows' column blocks (BY_ROWS; with
        # a partial last block, and with one block a row).
        for by_rows, elements, block in ((False, default[1], False), (False, default[1], True),
                                         (True, 32, False), (True, 32, True), (True, 128, True)):
            swiglu_fused.BY_ROWS, swiglu_fused.BLOCK = by_rows, elements
            # With `block`, gate and up are two column blocks of one projection output.
            outputs = torch.randn(33, 3 + 70 + 70, generator=generator, requires_grad=True)
            gate, up = ((outputs[:, 3:73], outputs[:, 73:]) if block else
                        (torch.randn(33, 70, generator=generator, requires_grad=True),
                         torch.randn(33, 70, generator=generator, requires_grad=True)))
            leaves = [outputs] if block else [gate, up]
            ours, reference = swiglu_fused.swiglu(gate, up), swiglu_reference(gate, up)
            case = f"swiglu block={block} by rows {by_rows} of {elements}"
            close(case, ours, reference)
            for name, a, b in zip(["gate", "up"], grads([ours], leaves, 5), grads([reference], leaves, 5)):
                close(f"{case} grad {name}", a, b)
    finally:
        swiglu_fused.BY_ROWS, swiglu_fused.BLOCK = default
    # The attention's output gate: x and gate contiguous; as the decoder reads them (the gate
    # interleaved with the query heads in one projection output, x contiguous or a transposed
    # view); with rows a program that leave the last one partial; gradients read in place.
    default = swiglu_fused.GATE_ELEMENTS
    try:
        for elements in (default, 2 * 16):
            swiglu_fused.GATE_ELEMENTS = elements
            projected = torch.randn(13, 3 * 2 * 16, generator=generator, requires_grad=True)
            attended = torch.randn(3, 13, 16, generator=generator, requires_grad=True)
            strided = (attended.transpose(0, 1), projected.view(13, 3, 32)[..., 16:])
            plain = tuple(torch.randn(13, 3, 16, generator=generator, requires_grad=True) for _ in range(2))
            mixed = (plain[0], strided[1])
            for case, (x, gate), leaves in (("contiguous", plain, plain), ("strided", strided, (attended, projected)),
                                            ("strided gate", mixed, (plain[0], projected))):
                ours, reference = swiglu_fused.gated(x, gate), gated_reference(x, gate)
                assert ours.is_contiguous()
                case = f"gated {case}, {elements} elements a program"
                close(case, ours, reference)
                for name, a, b in zip(["x", "gate"], grads([ours], leaves, 8), grads([reference], leaves, 8)):
                    close(f"{case} grad {name}", a, b)
    finally:
        swiglu_fused.GATE_ELEMENTS = default


def check_add_rms_norm():
    """add_rms_norm against an addition then the RMSNorm reference: both outputs and every
    gradient, with gradients reaching it through the sum, the norm or both."""
    generator = torch.Generator().manual_seed(12)
    for shape in ((19, 96), (4, 3, 40)):
        x = torch.randn(*shape, generator=generator, requires_grad=True)
        residual = torch.randn(*shape, generator=generator, requires_grad=True)
        weight = (torch.randn(shape[-1], generator=generator) * 0.2).requires_grad_()
        for used in ([0], [1], [0, 1]):
            total, normed = norm_fused.add_rms_norm(x, residual, 1.0 + weight, 1e-6)
            expected_total = x + residual
            expected = rms_norm_reference(expected_total, weight, 1e-6)
            close(f"add_rms_norm {shape} sum", total, expected_total)
            close(f"add_rms_norm {shape} normed", normed, expected)
            ours = [[total, normed][i] for i in used]
            theirs = [[expected_total, expected][i] for i in used]
            for name, a, b in zip(["x", "residual", "weight"], grads(ours, [x, residual, weight], 13),
                                  grads(theirs, [x, residual, weight], 13)):
                if b is None:
                    assert a is None or not a.any(), f"add_rms_norm {shape} {used} grad {name}"
                else:
                    close(f"add_rms_norm {shape} outputs {used} grad {name}", a, b)


def check_norm_rotate():
    """norm_rotate against the RMSNorm then rotary reference, outputs and the gradients of x and
    the scale: x contiguous, and x read in place as query heads interleaved with their gates
    (a column block of a packed projection), rotating part of each head or all of it."""
    generator = torch.Generator().manual_seed(11)
    for heads, width, turned, interleaved in ((3, 40, 16, False), (3, 40, 16, True), (2, 16, 16, True)):
        total = 23
        source = torch.randn(total, heads * 2 * width + 5, generator=generator, requires_grad=True)
        x = (source[:, 5:].view(total, heads, 2 * width)[..., :width] if interleaved
             else torch.randn(total, heads, width, generator=generator, requires_grad=True))
        leaf = source if interleaved else x
        weight = (torch.randn(width, generator=generator) * 0.2).requires_grad_()
        angles = torch.randn(total, turned // 2, generator=generator)
        cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
        ours = norm_fused.norm_rotate(x, 1.0 + weight, cos, sin, 1e-6)
        reference = norm_rotate_reference(x, weight, cos, sin, 1e-6)
        case = f"norm_rotate heads={heads} D={width} R={turned} interleaved={interleaved}"
        close(case, ours, reference)
        for name, a, b in zip(["x", "weight"], grads([ours], [leaf, weight], 12),
                              grads([reference], [leaf, weight], 12)):
            close(f"{case} grad {name}", a, b)
    # The vision tower's split: q, k and v out of one qkv product's output [T, 3, H, D], q and k
    # turned over every channel; with heads that leave a program's last rows partial.
    for total, heads, width in ((23, 3, 16), (5, 2, 64)):
        qkv = torch.randn(total, 3 * heads * width, generator=generator).view(total, 3, heads, width)
        angles = torch.randn(total, width // 2, generator=generator)
        cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
        ours, reference = norm_fused.split_rotate(qkv, cos, sin), split_rotate_reference(qkv, cos, sin)
        for name, a, b in zip("qkv", ours, reference):
            assert a.is_contiguous() and a.shape == (total, heads, width)
            close(f"split_rotate T={total} H={heads} D={width} {name}", a, b)
    try:
        norm_fused.split_rotate(torch.randn(4, 2, 3, 8).transpose(1, 2), cos[:4, :8], sin[:4, :8])  # heads apart
    except ValueError as error:
        assert "not [T, 3, H, D]" in str(error), error
    else:
        sys.exit("split_rotate took a qkv whose heads are not contiguous")


def check_delta_rule_rows():
    """delta_rule_rows against the token-by-token reference on forked states: rows of 1 to 64
    tokens (each part boundary), grouped heads, rows without a parent, value blocks of 16 with a
    partial last one."""
    default = delta_rows.VALUES
    generator = torch.Generator().manual_seed(8)
    heads, key_dim, value_heads = 2, 8, 4
    try:
        for value_dim, values in ((6, default), (40, 16), (40, default)):
            delta_rows.VALUES = values
            for lengths in ([1, 15, 16, 17, 33, 49, 63, 64], [5], [17, 30], [33, 2, 40], [64, 2, 48]):
                total, states = sum(lengths), torch.randn(2, value_heads, key_dim, value_dim, generator=generator)
                cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
                q, k = (l2norm(torch.randn(total, heads, key_dim, generator=generator)) for _ in range(2))
                v = torch.randn(total, value_heads, value_dim, generator=generator)
                # The raw gate input as the kernels get it from a packed projection: a column block.
                gate = torch.randn(total, value_heads + 3, generator=generator)[:, 1:-2]
                beta = torch.rand(total, value_heads)
                A_log, dt_bias = (torch.randn(value_heads, generator=generator) * 0.5 for _ in range(2))
                parents = torch.tensor([n % 3 - 1 for n in range(len(lengths))])  # -1, 0, 1, -1, ...
                ours = delta_rows.delta_rule_rows(q, k, v, gate, beta, states, parents, cu, max(lengths), A_log,
                                                  dt_bias)
                reference, _ = gated_delta_rule_reference(
                    q[None], k[None], v[None], decay(gate, A_log, dt_bias)[None], beta[None],
                    kernels.fork_states(states, parents, True), False, cu.long(), normalise=False)
                close(f"delta_rule_rows lengths={lengths} V={value_dim} block={values}", ours, reference[0])
                larger = torch.full((total + 5, value_heads, value_dim), 5.0)
                into = delta_rows.delta_rule_rows(q, k, v, gate, beta, states, parents, cu, max(lengths), A_log,
                                                  dt_bias, out=larger[2:2 + total])
                assert into.data_ptr() == larger[2].data_ptr()
                close(f"delta_rule_rows into out lengths={lengths}", larger[2:2 + total], reference[0])
                assert larger[:2].eq(5).all() and larger[2 + total:].eq(5).all()
                # Beta's input, a column block of a packed projection's output, its sigmoid taken
                # in the kernel: as beta itself.
                raw = torch.randn(total, value_heads + 3, generator=generator)[:, 2:-1]
                from_raw = delta_rows.delta_rule_rows(q, k, v, gate, raw, states, parents, cu, max(lengths), A_log,
                                                      dt_bias, beta_logits=True)
                close(f"delta_rule_rows from beta's input lengths={lengths}", from_raw,
                      delta_rows.delta_rule_rows(q, k, v, gate, torch.sigmoid(raw), states, parents, cu, max(lengths),
                                                 A_log, dt_bias))
    finally:
        delta_rows.VALUES = default
    # Badly conditioned blocks: nearly parallel keys, beta near 1 and almost no decay make the
    # higher powers of each block large, so every factor of the kernel's inverse matters. The
    # kernel's float32 products then lose more than forward substitution would: against the
    # float64 recurrence it stays within 1e-3 of outputs of order 1, under bf16's resolution.
    lengths, key_dim = [64, 64], 16
    total = sum(lengths)
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    base = torch.randn(1, heads, key_dim, generator=generator)
    k = l2norm(base + 0.05 * torch.randn(total, heads, key_dim, generator=generator))
    q = l2norm(torch.randn(total, heads, key_dim, generator=generator))
    v = torch.randn(total, value_heads, 6, generator=generator)
    gate, beta = torch.full((total, value_heads), -8.0), 0.9 + 0.1 * torch.rand(total, value_heads)
    A_log, dt_bias = torch.zeros(value_heads), torch.zeros(value_heads)
    states, parents = torch.randn(1, value_heads, key_dim, 6, generator=generator), torch.tensor([0, -1])
    ours = delta_rows.delta_rule_rows(q, k, v, gate, beta, states, parents, cu, 64, A_log, dt_bias)
    reference, _ = gated_delta_rule_reference(
        *(x[None].double() for x in (q, k, v, decay(gate, A_log, dt_bias), beta)),
        kernels.fork_states(states, parents, True).double(), False, cu.long(), normalise=False)
    error = (ours.double() - reference[0]).abs().max().item()
    if not error < 1e-3:
        sys.exit(f"delta_rule_rows on badly conditioned blocks: max error {error:.2e} (outputs up to "
                 f"{reference.abs().max().item():.2f})")


def check_delta_rule_scan():
    """delta_rule_scan against the token-by-token reference: sequences of 1 to 130 tokens
    (every 16-token part boundary, several parts, empty ones among them, many sequences starting
    within one part's tokens), from zero states keeping the final states (prefixes) and from
    forked states (long rows, some without a parent), grouped heads and value blocks of 16 with
    a partial last one; each path chosen on the host and routed on the device."""
    default = delta_scan.WALK_VALUES, delta_scan.PARTS_BELOW, delta_scan.WALK_CHUNK, delta_scan.FWD_VALUES
    generator = torch.Generator().manual_seed(9)
    heads, key_dim, value_heads = 2, 8, 4
    try:
        # Each path whatever the count: the parts solved apart and walked (with value blocks of
        # 16 and the default), at 16- and 64-token steps, and the one-kernel walk (its blocks,
        # `FWD_VALUES`, the same: 16 and 64 where it runs).
        for value_dim, values, parts_below, step in (
                (6, default[0], 2**31, 16), (40, 16, 2**31, 16), (6, default[0], 2**31, 64), (40, 16, 2**31, 64),
                (40, 16, 0, 16), (6, 64, 0, 16)):
            delta_scan.WALK_VALUES, delta_scan.PARTS_BELOW, delta_scan.WALK_CHUNK = values, parts_below, step
            delta_scan.FWD_VALUES = values
            for lengths in ([1, 15, 16, 17, 33, 64, 65, 130], [5], [97, 2], [3, 0, 2, 1, 0, 4, 40, 0]):
                total = sum(lengths)
                cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
                q, k = (l2norm(torch.randn(total, heads, key_dim, generator=generator)) for _ in range(2))
                v = torch.randn(total, value_heads, value_dim, generator=generator)
                # The raw gate input as a column block of a packed projection's output (read in place).
                gate = torch.randn(total, value_heads + 3, generator=generator)[:, 1:-2]
                beta = torch.rand(total, value_heads)
                A_log, dt_bias = (torch.randn(value_heads, generator=generator) * 0.5 for _ in range(2))
                log_decay = decay(gate, A_log, dt_bias)
                case = (f"delta_rule_scan lengths={lengths} V={value_dim} block={values} parts below {parts_below} "
                        f"steps of {step}")
                ours, final = delta_scan.delta_rule_scan(q, k, v, gate, beta, None, None, cu, True, A_log, dt_bias)
                reference, reference_final = gated_delta_rule_reference(
                    q[None], k[None], v[None], log_decay[None], beta[None], None, True, cu.long(), normalise=False)
                close(f"{case} from zero", ours, reference[0])
                close(f"{case} final states", final, reference_final)
                # A bucket's padded chunk plan (entries naming a last, empty sequence) walks the same.
                padded_cu = torch.cat([cu, cu[-1:]])
                planned, planned_final = delta_scan.delta_rule_scan(
                    q, k, v, gate, beta, None, None, padded_cu, True, A_log, dt_bias,
                    chunks=padded_plan(lengths + [0], len(chunk_plan(lengths)) + 3))
                close(f"{case} on a padded plan", planned, ours)
                close(f"{case} final states on a padded plan", planned_final[:-1], final)
                # Routed on the device (a bucket's graph): both paths launched, the one the count of
                # sequences over 64 tokens picks does the work (with PARTS_BELOW 0 the one-kernel
                # walk; with 2**31 nothing routes, as fewer sequences than PARTS_BELOW never do:
                # `check_routes_on_the_device` routes to each path).
                routed, routed_final = delta_scan.delta_rule_scan(
                    q, k, v, gate, beta, None, None, padded_cu, True, A_log, dt_bias,
                    chunks=padded_plan(lengths + [0], len(chunk_plan(lengths)) + 3), routed=True)
                close(f"{case} routed on the device", routed, ours)
                close(f"{case} final states routed on the device", routed_final[:-1], final)
                states = torch.randn(2, value_heads, key_dim, value_dim, generator=generator)
                parents = torch.tensor([n % 3 - 1 for n in range(len(lengths))])  # -1, 0, 1, -1, ...
                ours, none = delta_scan.delta_rule_scan(q, k, v, gate, beta, states, parents, cu, False, A_log,
                                                        dt_bias)
                reference, _ = gated_delta_rule_reference(
                    q[None], k[None], v[None], log_decay[None], beta[None], kernels.fork_states(states, parents, True),
                    False, cu.long(), normalise=False)
                assert none is None, case
                close(f"{case} forked", ours, reference[0])
                routed, none = delta_scan.delta_rule_scan(q, k, v, gate, beta, states, parents, cu, False, A_log,
                                                          dt_bias, routed=True)
                assert none is None, case
                close(f"{case} forked, routed on the device", routed, reference[0])
                # Written into a part of a larger output: there, and nowhere else in it.
                larger = torch.full((total + 7, value_heads, value_dim), 5.0)
                into, _ = delta_scan.delta_rule_scan(q, k, v, gate, beta, states, parents, cu, False, A_log, dt_bias,
                                                     out=larger[3:3 + total])
                assert into.data_ptr() == larger[3].data_ptr(), case
                close(f"{case} into out", larger[3:3 + total], reference[0])
                assert larger[:3].eq(5).all() and larger[3 + total:].eq(5).all(), case
                raw = torch.randn(total, value_heads + 3, generator=generator)[:, 2:-1]  # beta's input, in place
                from_raw, raw_final = delta_scan.delta_rule_scan(q, k, v, gate, raw, None, None, cu, True, A_log,
                                                                 dt_bias, beta_logits=True)
                expected, expected_final = delta_scan.delta_rule_scan(q, k, v, gate, torch.sigmoid(raw), None, None,
                                                                      cu, True, A_log, dt_bias)
                close(f"{case} from beta's input", from_raw, expected)
                close(f"{case} final states from beta's input", raw_final, expected_final)
    finally:
        delta_scan.WALK_VALUES, delta_scan.PARTS_BELOW, delta_scan.WALK_CHUNK, delta_scan.FWD_VALUES = default
    for step, last in ((16, "_delta_scan_walk"), (64, "_chunk_output")):
        delta_scan.WALK_CHUNK = step
        try:
            check_routes_on_the_device(last)
        finally:
            delta_scan.WALK_CHUNK = default[2]


class _Idle:
    """A Triton kernel launcher that launches nothing."""

    def __getitem__(self, grid):
        return lambda *args, **options: None


@contextlib.contextmanager
def _swapped(name: str | None, launcher):
    """`delta_scan`'s kernel `name` replaced by `launcher` meanwhile (nothing replaced for None)."""
    if name is None:
        yield
        return
    kernel = getattr(delta_scan, name)
    setattr(delta_scan, name, launcher)
    try:
        yield
    finally:
        setattr(delta_scan, name, kernel)


def check_one_long_sequence():
    """delta_rule_scan's `one_long` path (64-token steps, ALONE_VALUES values a program: one long
    sequence alone or with shorter padding after it, as a one-row bucket holds) against the
    token-by-token reference: from zero states keeping the final states and from forked states
    (the long one without a parent where padding follows), on the sequences' own chunk plan and on a bucket's padded
    one, grouped heads, values narrower and wider than a program's block; with decays of about
    -0.8 a token, and of about -0.01, under which each step's entering state weighs on every
    token after it."""
    generator = torch.Generator().manual_seed(11)
    heads, key_dim, value_heads = 2, 8, 4
    cases = [(value_dim, weak, lengths) for value_dim in (6, 20) for weak in (False, True)
             for lengths in ([300, 37, 0], [200])]
    for value_dim, weak, lengths in cases:
        total = sum(lengths)
        cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
        q, k = (l2norm(torch.randn(total, heads, key_dim, generator=generator)) for _ in range(2))
        v = torch.randn(total, value_heads, value_dim, generator=generator)
        gate = torch.randn(total, value_heads + 3, generator=generator)[:, 1:-2]
        beta = torch.rand(total, value_heads, generator=generator)
        A_log, dt_bias = (torch.randn(value_heads, generator=generator) * 0.5 for _ in range(2))
        if weak:
            A_log = torch.full_like(A_log, -4.0)  # exp(-4) softplus(...): about -0.01 a token
        log_decay = decay(gate, A_log, dt_bias)
        states = torch.randn(2, value_heads, key_dim, value_dim, generator=generator)
        parents = torch.tensor([n % 3 - (len(lengths) > 1) for n in range(len(lengths))])  # -1, 0, 1 or 0
        reference, reference_final = gated_delta_rule_reference(
            q[None], k[None], v[None], log_decay[None], beta[None], None, True, cu.long(), normalise=False)
        forked, forked_final = gated_delta_rule_reference(
            q[None], k[None], v[None], log_decay[None], beta[None], kernels.fork_states(states, parents, True),
            True, cu.long(), normalise=False)
        case = f"delta_rule_scan one_long lengths={lengths} V={value_dim} weak decay {weak}"
        ours, final = delta_scan.delta_rule_scan(q, k, v, gate, beta, None, None, cu, True, A_log, dt_bias,
                                                 one_long=True)
        close(f"{case} from zero", ours, reference[0])
        close(f"{case} final states", final, reference_final)
        ours, final = delta_scan.delta_rule_scan(q, k, v, gate, beta, states, parents, cu, True, A_log, dt_bias,
                                                 one_long=True)
        close(f"{case} forked", ours, forked[0])
        close(f"{case} forked final states", final, forked_final)
        if lengths[-1]:
            continue
        plan = padded_plan(lengths, len(chunk_plan(lengths)) + 3)  # a bucket's: entries of an empty sequence
        ours, _ = delta_scan.delta_rule_scan(q, k, v, gate, beta, states, parents, cu, False, A_log, dt_bias,
                                             chunks=plan, one_long=True)
        close(f"{case} forked on a padded plan", ours, forked[0])


def check_routes_on_the_device(last: str):
    """Routed, the path the device picks does all the work and the other none: with one path's
    last kernel idle, the output (and the final states) are the reference where the other path
    was picked (fewer than PARTS_BELOW sequences over 64 tokens: the parts and the walk; more:
    the one-kernel walk), and the output untouched where the idle one was;
    from zero states without final states (a bucket's rows) and from forked states keeping them."""
    generator = torch.Generator().manual_seed(11)
    heads, key_dim, value_heads, value_dim = 1, 8, 2, 16
    assert delta_scan.PARTS_BELOW == 4
    for lengths, parts in (([130, 2, 64, 0], True), ([65, 70, 66, 100, 65], False), ([65, 70, 66, 300, 65], False),
                           ([70, 70, 70, 70], False)):
        _check_route(generator, lengths, parts, last, heads, key_dim, value_heads, value_dim)


def _check_route(generator, lengths, parts, last, heads, key_dim, value_heads, value_dim):
    """`check_routes_on_the_device` for one set of lengths, `parts` saying which path it takes."""
    total = sum(lengths)
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    q, k = (l2norm(torch.randn(total, heads, key_dim, generator=generator)) for _ in range(2))
    v = torch.randn(total, value_heads, value_dim, generator=generator)
    gate, beta = torch.randn(total, value_heads, generator=generator), torch.rand(total, value_heads)
    A_log, dt_bias = (torch.randn(value_heads, generator=generator) * 0.5 for _ in range(2))
    states = torch.randn(2, value_heads, key_dim, value_dim, generator=generator)
    parents = torch.tensor([n % 3 - 1 for n in range(len(lengths))])  # -1, 0, 1, -1, ...
    for forked in (False, True):
        initial = kernels.fork_states(states, parents, True) if forked else None
        reference, reference_final = gated_delta_rule_reference(
            q[None], k[None], v[None], decay(gate, A_log, dt_bias)[None], beta[None], initial, forked, cu.long(),
            normalise=False)
        walk = "_delta_scan_fwd"  # the one-kernel walk
        for idle in (None, last, walk):  # None: both run, as routed; `last`: the parts path's
            out = torch.full((total, value_heads, value_dim), 5.0)
            with _swapped(idle, _Idle()):
                _, final = delta_scan.delta_rule_scan(
                    q, k, v, gate, beta, states if forked else None, parents if forked else None, cu, forked,
                    A_log, dt_bias, out=out, routed=True)
            case = f"routed lengths={lengths} forked={forked} with {idle} idle"
            if idle is None or parts == (idle == walk):
                close(case, out, reference[0])
                if forked:
                    close(f"{case}: final states", final, reference_final)
            else:
                assert out.eq(5.0).all(), case


def check_delta_rule_grad():
    """delta_backward.delta_rule's gradients against autograd through the token-by-token
    reference: q, k, v, the raw gate, beta and the forked prefix states (summed over each
    state's rows; rows without a parent, -1, take none), with and without the final states'
    gradient; sequences of 1 to 130 tokens, grouped heads, value blocks of 16 with a partial
    last one."""
    default = delta_backward.GRAD_VALUES
    generator = torch.Generator().manual_seed(11)
    heads, key_dim, value_heads = 2, 8, 4
    try:
        for value_dim, values in ((6, default), (40, 16), (40, default)):
            delta_backward.GRAD_VALUES = values
            for lengths in ([1, 15, 16, 17, 33, 130], [5], [64, 2]):
                total = sum(lengths)
                cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
                q, k = (l2norm(torch.randn(total, heads, key_dim, generator=generator)).requires_grad_()
                        for _ in range(2))
                v = torch.randn(total, value_heads, value_dim, generator=generator).requires_grad_()
                gate = torch.randn(total, value_heads, generator=generator).requires_grad_()
                beta = torch.rand(total, value_heads, generator=generator).requires_grad_()
                A_log, dt_bias = (torch.randn(value_heads, generator=generator) * 0.5 for _ in range(2))
                states = torch.randn(2, value_heads, key_dim, value_dim, generator=generator).requires_grad_()
                parents = torch.tensor([n % 3 - 1 for n in range(len(lengths))])  # -1, 0, 1, -1, ...
                for forked, final_grad in ((False, True), (True, False), (True, True)):
                    log_decay = decay(gate, A_log, dt_bias)
                    case = f"delta_rule grad lengths={lengths} V={value_dim} block={values} forked={forked}"
                    inputs = [q, k, v, gate, beta] + ([states] if forked else [])
                    ours = delta_backward.delta_rule(q, k, v, gate, beta, states if forked else None,
                                                   parents if forked else None, cu, final_grad, A_log, dt_bias)
                    reference = gated_delta_rule_reference(
                        q[None], k[None], v[None], log_decay[None], beta[None],
                        kernels.fork_states(states, parents, True) if forked else None, final_grad, cu.long(),
                        normalise=False)
                    outputs = [ours[0], ours[1]] if final_grad else [ours[0]]
                    expected = [reference[0][0], reference[1]] if final_grad else [reference[0][0]]
                    for name, a, b in zip(["o", "final"], outputs, expected):
                        close(f"{case}: {name}", a, b)
                    names = ["q", "k", "v", "gate", "beta", "states"]
                    for name, a, b in zip(names, grads(outputs, inputs, 5), grads(expected, inputs, 5)):
                        close(f"{case}: d{name}", a, b)
            # Frozen states: they still start the rows, but take no gradient.
            frozen = states.detach()
            log_decay = decay(gate, A_log, dt_bias)
            ours = delta_backward.delta_rule(q, k, v, gate, beta, frozen, parents, cu, False, A_log, dt_bias)[0]
            reference = gated_delta_rule_reference(
                q[None], k[None], v[None], log_decay[None], beta[None], kernels.fork_states(frozen, parents, True),
                False, cu.long(), normalise=False)[0][0]
            for name, a, b in zip(["q", "k", "v"], grads([ours], [q, k, v], 6), grads([reference], [q, k, v], 6)):
                close(f"delta_rule grad, frozen states: d{name}", a, b)
    finally:
        delta_backward.GRAD_VALUES = default


def check_decoder_with_triton_kernels():
    """The decoder as it runs on CUDA (our Triton kernels for the convolution and head split,
    RMSNorm, the head norm with the rotary embedding, the residual addition with its norm, gated
    RMSNorm and SwiGLU), against its CPU path: a random tiny Qwen3.5, shared prefixes forked to
    rows with and without one, outputs and input gradients; also with its projections packed
    (`pack_projections`), so the kernels read column blocks of one product's output."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextConfig, Qwen3_5TextModel

    from dohnuts.model.decoder import Prefixes, Segments, pack_projections, packed_forward
    from dohnuts.ops.plan import chunk_plan, cumulative, plan_fork

    torch.manual_seed(0)
    config = Qwen3_5TextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"], num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=6, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                         "mrope_interleaved": True, "mrope_section": [2, 1, 1]})
    model = Qwen3_5TextModel(config).eval()
    with torch.no_grad():  # norm weights away from their zero init, so every path matters
        for name, parameter in model.named_parameters():
            if "norm" in name or "dt_bias" in name:
                parameter.normal_(0.0, 0.3)
    prefix_lengths, row_lengths, parents = [70, 5], [3, 40, 1, 66], [0, 1, -1, 0]
    prefix_cu = cumulative(prefix_lengths)
    prefix_segments = Segments.of(prefix_cu, prefix_cu, chunk_plan(prefix_lengths))

    def layout(lengths):
        """(embeddings, M-RoPE positions, cu_seqlens, Prefixes) of rows of own `lengths` continuing
        the prefixes above."""
        total = sum(prefix_lengths) + sum(lengths)
        embeds = torch.randn(total, config.hidden_size, requires_grad=True)
        positions = torch.cat([torch.arange(n) for n in prefix_lengths]
                              + [torch.arange(n) + (prefix_lengths[p] if p >= 0 else 0)
                                 for n, p in zip(lengths, parents)]).expand(3, -1)
        fork = plan_fork(prefix_lengths, lengths, parents)
        return embeds, positions, cumulative(lengths), Prefixes(sum(prefix_lengths), prefix_segments, fork)

    embeds, positions, cu, prefixes = layout(row_lengths)

    def run(language_model=model):
        out = packed_forward(language_model, embeds, positions, cu, False, prefixes, cu, chunk_plan(row_lengths))
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
        return out.detach(), torch.autograd.grad((out * weights).sum(), embeds)[0]

    reference = run()
    def conv_on_cuda(x, weight, state, keep, cu_seqlens, cu_seqlens_cpu, chunk_indices, heads, key_dim, value_heads,
                     value_dim, parents=None, orphans=True):
        """kernels.conv_split_heads' CUDA choice: states through parents, forked first under autograd."""
        if parents is not None and kernels._differentiable(x, weight, state):
            state, parents = kernels.fork_states(state, parents, orphans), None
        return conv_fused.conv_split_heads(x, weight, state, keep, cu_seqlens, cu_seqlens_cpu, chunk_indices, heads,
                                           key_dim, value_heads, value_dim, parents)

    # What kernels.py chooses on CUDA, routed to our Triton kernels for these CPU tensors.
    cuda_path = {
        "conv_split_heads": conv_on_cuda,
        "rms_norm": lambda x, weight, eps: norm_fused.rms_norm(x, 1.0 + weight.float(), eps),
        "norm_rotate": lambda x, weight, cos, sin, eps: norm_fused.norm_rotate(x, 1.0 + weight.float(), cos, sin,
                                                                              eps),
        "add_rms_norm": lambda x, residual, weight, eps: norm_fused.add_rms_norm(x, residual, 1.0 + weight.float(),
                                                                                 eps),
        "swiglu": swiglu_fused.swiglu,
        "gated": swiglu_fused.gated,
        "rms_norm_gated": norm_fused.rms_norm_gated,
    }
    cpu_path = {name: getattr(kernels, name) for name in cuda_path}
    calls = dict.fromkeys(cuda_path, 0)

    def counted(name):
        def call(*args):
            calls[name] += 1
            return cuda_path[name](*args)
        return call

    packed = copy.deepcopy(model).requires_grad_(False)  # frozen, as at inference: one product a group
    assert pack_projections(packed) == 2 * config.num_hidden_layers
    for name in cuda_path:
        setattr(kernels, name, counted(name))
    try:
        fused = run()
        assert all(calls.values()), calls
        products = []
        linear = torch.nn.functional.linear
        torch.nn.functional.linear = lambda x, weight, *rest: products.append(weight.shape) or linear(x, weight, *rest)
        try:
            fused_packed = run(packed)
        finally:
            torch.nn.functional.linear = linear
        assert len(products) == 4 * config.num_hidden_layers, products  # input side, output, MLP in and out
    finally:
        for name, function in cpu_path.items():
            setattr(kernels, name, function)
    close("decoder output with Triton kernels", fused[0], reference[0])
    close("decoder input gradient with Triton kernels", fused[1], reference[1])
    close("decoder output with Triton kernels, projections packed", fused_packed[0], reference[0])
    close("decoder input gradient with Triton kernels, projections packed", fused_packed[1], reference[1])

    # Rows of at most 64 tokens take delta_rule_rows where CUDA would, but only when no gradient
    # is needed: with one, they keep the differentiable path (the kernel has no backward).
    short = [3, 40, 1, 64]
    embeds, positions, cu, prefixes = layout(short)

    def run_short(differentiable):
        with torch.set_grad_enabled(differentiable):
            out = packed_forward(model, embeds, positions, cu, False, prefixes, cu, chunk_plan(short))
        if not differentiable:
            return out, None
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
        return out.detach(), torch.autograd.grad((out * weights).sum(), embeds)[0]

    reference, (_, reference_grad) = run_short(False), run_short(True)
    rows_calls = []
    kernel, ours = delta_rows.delta_rule_rows, kernels._ours
    delta_rows.delta_rule_rows = lambda *args, **options: rows_calls.append(1) or kernel(*args, **options)
    kernels._ours = lambda x: backends._triton_kernels() if x.dtype != torch.float64 else None
    try:
        inference = run_short(False)
        assert len(rows_calls) == 3, rows_calls  # one call a delta-rule layer
        training = run_short(True)
        assert len(rows_calls) == 3, rows_calls  # none with gradients
    finally:
        delta_rows.delta_rule_rows, kernels._ours = kernel, ours
    close("decoder output with delta_rule_rows", inference[0], reference[0])
    close("decoder output with gradients, short rows", training[0], reference[0])
    close("decoder input gradient, short rows", training[1], reference_grad)

    # Without gradients, the prefixes and rows over 64 tokens take delta_rule_scan (and no FLA
    # call is left); with them, the differentiable path.
    embeds, positions, cu, prefixes = layout(row_lengths)
    own, own_positions = embeds[prefixes.tokens:].detach(), positions[:, prefixes.tokens:]  # the rows alone
    with torch.no_grad():
        expected = packed_forward(model, embeds, positions, cu, False, prefixes, cu, chunk_plan(row_lengths))
    scan_calls = []
    scan = delta_scan.delta_rule_scan
    delta_scan.delta_rule_scan = lambda *args, **options: scan_calls.append(args[5] is None) or scan(*args, **options)
    kernels._ours = lambda x: backends._triton_kernels() if x.dtype != torch.float64 else None
    try:
        with torch.no_grad():
            scanned = packed_forward(model, embeds, positions, cu, False, prefixes, cu, chunk_plan(row_lengths))
        assert scan_calls == [True, False] * 3, scan_calls  # a layer: the prefixes from zero, then the rows
        with torch.no_grad():
            alone = packed_forward(model, own, own_positions, cu, False, None, cu, chunk_plan(row_lengths))
        assert scan_calls[6:] == [True] * 3, scan_calls  # rows without prefixes: one call a layer
    finally:
        delta_scan.delta_rule_scan, kernels._ours = scan, ours
    close("decoder output with delta_rule_scan", scanned, expected)
    with torch.no_grad():
        plain_alone = packed_forward(model, own, own_positions, cu, False, None, cu, chunk_plan(row_lengths))
    close("decoder output with delta_rule_scan, no prefixes", alone, plain_alone)

    # With A_log and dt_bias frozen (as in training: they are base weights), the differentiable
    # delta rule of prefixes and rows takes delta_rule.backward's gradient, which must equal the CPU
    # path's: the input's and every weight's that trains.
    for name, parameter in model.named_parameters():
        if name.endswith(("A_log", "dt_bias")):
            parameter.requires_grad_(False)
    trained = [parameter for parameter in model.parameters() if parameter.requires_grad]

    def train_step():
        out = packed_forward(model, embeds, positions, cu, False, prefixes, cu, chunk_plan(row_lengths))
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(4))
        return out.detach(), torch.autograd.grad((out * weights).sum(), [embeds] + trained, allow_unused=True)

    expected_out, expected_grads = train_step()
    grad_calls = []
    delta_rule = delta_backward.delta_rule
    delta_backward.delta_rule = lambda *args: grad_calls.append(args[5] is None) or delta_rule(*args)
    kernels._ours = lambda x: backends._triton_kernels() if x.dtype != torch.float64 else None
    try:
        out, got = train_step()
    finally:
        delta_backward.delta_rule, kernels._ours = delta_rule, ours
    assert grad_calls == [True, False] * 3, grad_calls  # a layer: the prefixes, then the rows
    close("decoder output through delta_rule.backward", out, expected_out)
    assert [a is None for a in got] == [b is None for b in expected_grads]  # the embedding table takes none
    for index, (a, b) in enumerate(zip(got, expected_grads)):
        if b is not None:
            close(f"decoder gradient {index} through delta_rule.backward", a, b)



def check_merge():
    """The merge of two attention partials against its reference: bf16 outputs [T, 8, 256] and
    float32 log-sum-exps [8, T], the first read as a view past a prefix (as a bucket's rows are),
    one query without keys in the second set (+inf), written in place over the first."""
    generator = torch.Generator().manual_seed(5)
    prefix, rows, heads, width = 7, 9, 8, 256
    own = torch.randn(prefix + rows, heads, width, generator=generator).to(torch.bfloat16)
    own_lse = torch.randn(heads, prefix + rows, generator=generator) * 3
    cross = torch.randn(rows, heads, width, generator=generator).to(torch.bfloat16)
    cross_lse = torch.randn(heads, rows, generator=generator) * 3
    cross_lse[:, 4], cross[4] = float("inf"), 0.0
    expected = merge_partials_reference(own[prefix:], own_lse[:, prefix:], cross, cross_lse)
    before = own.clone()
    ours = merge_fused.merge_partials(own[prefix:], own_lse[:, prefix:], cross, cross_lse, out=own[prefix:])
    assert ours.data_ptr() == own[prefix:].data_ptr()
    torch.testing.assert_close(ours.float(), expected.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(ours[4], before[prefix + 4], rtol=0, atol=0)  # the first's alone
    assert torch.equal(own[:prefix], before[:prefix])  # nothing before the view written

if __name__ == "__main__":
    if os.environ.get("DOHNUTS_LAUNCHES"):
        record_launches(os.environ["DOHNUTS_LAUNCHES"])
    check_conv_split_heads()
    check_delta_rule_rows()
    check_delta_rule_scan()
    check_one_long_sequence()
    check_delta_rule_grad()
    check_norms_and_swiglu()
    check_norm_rotate()
    check_add_rms_norm()
    check_merge()
    check_decoder_with_triton_kernels()
    print("ok")
