"""Our own Triton kernels, for CUDA only; `dohnuts.ops.kernels` chooses them and holds their
plain-PyTorch references.

`conv_split_heads` runs the delta rule's causal convolution and writes its output straight
into the contiguous, L2-normalised q and k [T, H, K] and the contiguous v [T, HV, V] that
flash-linear-attention's chunked delta rule reads. Done apart (FLA's `causal_conv1d`, then
the split), the convolved channels are written and read again, FLA makes three strided
copies of them, and it L2-normalises q and k in two more passes. `rms_norm`,
`rms_norm_gated` and `swiglu` are single-launch kernels for the same math as FLA's.
`delta_rule_rows` runs the delta rule of short rows continuing forked prefix states in one
forward-only kernel, reading each prefix's state in place; `delta_rule_scan` runs whole
sequences of any length, forward only, so inference needs no FLA call.

All of them also run on the CPU, under Triton's interpreter (TRITON_INTERPRET=1), which the
tests use (`tests/triton_interpreted.py`).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from .plan import CHUNK, chunk_plan

EPS = 1e-6  # FLA's and Hugging Face's L2-norm epsilon, added to the sum of squares


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


# -- causal convolution fused with the head split -------------------------------------------------
#
# `conv_split_heads` runs the delta rule's depthwise causal convolution (with SiLU, per packed
# sequence, continuing an optional carried state) and writes its output straight into the
# contiguous q, k (L2-normalised) and v the delta rule reads, plus each sequence's final state.
# A program covers TOKENS tokens of one 64-token chunk of one sequence (the host's chunk plan)
# and one head's channels; the backward recomputes the convolution rather than keeping it.

# Tokens per program (a divisor of CHUNK: a planned chunk gets CHUNK // TOKENS programs) and
# warps per program. The kernel is bound by the latency of its loads, not by bandwidth. Forward
# kernel time on the H200 (Qwen3.5-0.8B widths, bf16) for 50 rows of 20 to 44 tokens with
# carried states, then for one 64-token prefix: 99 and 4.0 us at 64 tokens and 8 warps, 60 and
# 2.8 us at 32 and 4 (16 and 2: 59 and 3.1; 8 and 1: 58 and 3.1; 32 and 2: 196 us), in
# docs/results/h200-conv-split-heads-configs-2026-11-30.txt. The carried state has since been
# read by a sequence's first block only: 17.6 us a call in the 50-question forward
# (docs/results/h200-profile-distinct-text-50q-319c0ca.txt).
TOKENS = 32
WARPS = 4


def _alignment(key_dim: int, value_dim: int) -> int:
    """The largest power of two, up to 16, dividing both head widths: every head's first channel
    is a multiple of it."""
    both = key_dim | value_dim
    return min(both & -both, 16)


@triton.jit
def _chunk(cu_seqlens, chunk_indices, BT: tl.constexpr, PLAN: tl.constexpr):
    """This program's tokens: plan entry axis 0 (a sequence's PLAN-token chunk), BT of them from
    block axis 2. Returns (sequence n, bos and eos (the sequence's bounds), start (the block's
    first token), the block's token offsets [BT] and their mask)."""
    i_c = tl.program_id(0)
    n = tl.load(chunk_indices + i_c * 2).to(tl.int64)
    chunk = tl.load(chunk_indices + i_c * 2 + 1).to(tl.int64)
    bos = tl.load(cu_seqlens + n).to(tl.int64)
    eos = tl.load(cu_seqlens + n + 1).to(tl.int64)
    start = bos + chunk * PLAN + tl.program_id(2) * BT
    o_t = start + tl.arange(0, BT)
    return n, bos, eos, start, o_t, o_t < eos


@triton.jit
def _slot(i_s, H: tl.constexpr, K: tl.constexpr, HV: tl.constexpr, V: tl.constexpr, BD: tl.constexpr,
          ALIGN: tl.constexpr):
    """The channels of head slot i_s (the H q heads, then the H k heads, then the HV v heads):
    (offsets within the head [BD], channels [BD], their mask). ALIGN divides K and V, so the
    compiler may load a head's channels in vectors rather than element by element."""
    is_qk = i_s < 2 * H
    o_d = tl.arange(0, BD)
    col0 = tl.multiple_of(tl.where(is_qk, i_s * K, 2 * H * K + (i_s - 2 * H) * V), ALIGN)
    return o_d, col0 + o_d, o_d < tl.where(is_qk, K, V)


@triton.jit
def _conv_window(x, init, weight, o_t, start, bos, row, cols, m_t, m_d, m_init, stride, C, W: tl.constexpr,
                 HAS_INIT: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    """The convolution before its activation, [BT, BD] float32, of tokens o_t (from start, of
    one sequence starting at bos) and channels cols (mask m_d); inputs before bos come from
    init[row] where m_init (`_carried`), else they are zero."""
    acc = tl.zeros([BT, BD], dtype=tl.float32)
    for i in tl.static_range(W):
        s = o_t - (W - 1) + i
        m_x = (m_t & (s >= bos))[:, None] & m_d[None, :]
        xs = tl.load(x + s[:, None] * stride + cols[None, :], mask=m_x, other=0.0).to(tl.float32)
        w = tl.load(weight + cols * W + i, mask=m_d, other=0.0).to(tl.float32)
        acc += xs * w[None, :]
    if HAS_INIT:
        # Only the sequence's first W - 1 tokens reach back before it, so only a block holding
        # some of them reads the carried state, a channel vector at a time: a [BT, BD] gather
        # of it in every tap would cost every program a shuffle through shared memory.
        # init[n, c, j] is the input at position j - W before the sequence: token bos + r
        # reads it through tap i = j - 1 - r.
        if start < bos + W - 1:
            for r in tl.static_range(W - 1):
                carried = tl.zeros([BD], dtype=tl.float32)
                for i in tl.static_range(W - 1 - r):
                    h = tl.load(init + row * C * W + cols * W + (r + 1 + i), mask=m_init, other=0.0).to(tl.float32)
                    carried += h * tl.load(weight + cols * W + i, mask=m_d, other=0.0).to(tl.float32)
                acc += tl.where((o_t == bos + r)[:, None], carried[None, :], 0.0)
    return acc


@triton.jit
def _carried(parents, n, m_d, HAS_PARENTS: tl.constexpr, BD: tl.constexpr):
    """(the carried state's row for sequence n, the channel mask where it is read): row
    parents[n] with HAS_PARENTS, no channel where that is negative (a zero state), else row n.
    (The parent as a vector in the mask: Triton's interpreter wants that.)"""
    if HAS_PARENTS:
        parent = tl.load(parents + n).to(tl.int64)
        return tl.maximum(parent, 0), m_d & ((tl.zeros([BD], dtype=tl.int64) + parent) >= 0)
    return n, m_d


@triton.jit
def _conv_heads_fwd(x, weight, init, parents, q, k, v, rstd, final, cu_seqlens, chunk_indices, stride, eps,
                    H: tl.constexpr, K: tl.constexpr, HV: tl.constexpr, V: tl.constexpr, W: tl.constexpr,
                    HAS_INIT: tl.constexpr, HAS_PARENTS: tl.constexpr, HAS_FINAL: tl.constexpr, BT: tl.constexpr,
                    PLAN: tl.constexpr, BD: tl.constexpr, ALIGN: tl.constexpr):
    i_s = tl.program_id(1)
    n, bos, eos, start, o_t, m_t = _chunk(cu_seqlens, chunk_indices, BT, PLAN)
    if start >= eos:  # a block past its sequence's end (TOKENS < CHUNK) has nothing to do
        return
    C = 2 * H * K + HV * V
    is_qk = i_s < 2 * H
    o_d, cols, m_d = _slot(i_s, H, K, HV, V, BD, ALIGN)
    row, m_init = _carried(parents, n, m_d, HAS_PARENTS, BD)
    pre = _conv_window(x, init, weight, o_t, start, bos, row, cols, m_t, m_d, m_init, stride, C, W, HAS_INIT, BT, BD)
    u = pre * tl.sigmoid(pre)  # 0 in masked lanes
    m = m_t[:, None] & m_d[None, :]
    if is_qk:
        r = tl.rsqrt(tl.sum(u * u, axis=1) + eps)
        y = (u * r[:, None]).to(q.dtype.element_ty)
        if i_s < H:
            tl.store(q + o_t[:, None] * (H * K) + i_s * K + o_d[None, :], y, mask=m)
        else:
            tl.store(k + o_t[:, None] * (H * K) + (i_s - H) * K + o_d[None, :], y, mask=m)
        tl.store(rstd + o_t * (2 * H) + i_s, r, mask=m_t)
    else:
        tl.store(v + o_t[:, None] * (HV * V) + (i_s - 2 * H) * V + o_d[None, :], u.to(v.dtype.element_ty), mask=m)
    if HAS_FINAL:
        if start + BT >= eos:  # the block holding the sequence's last token (start < eos: it did not return)
            for j in tl.static_range(W):
                position = eos - W + j
                # A vector, not a scalar, in every mask (Triton's interpreter wants that).
                at = tl.zeros([BD], dtype=tl.int64) + position
                own = tl.load(x + position * stride + cols, mask=m_d & (at >= bos), other=0.0)
                if HAS_INIT:
                    own += tl.load(init + row * C * W + cols * W + (W + position - bos), mask=m_init & (at < bos),
                                   other=0.0)
                tl.store(final + n * C * W + cols * W + j, own, mask=m_d)


@triton.jit
def _conv_heads_bwd_pre(x, weight, init, q, k, rstd, dq, dk, dv, dpre, cu_seqlens, chunk_indices, stride,
                        H: tl.constexpr, K: tl.constexpr, HV: tl.constexpr, V: tl.constexpr, W: tl.constexpr,
                        HAS_INIT: tl.constexpr, BT: tl.constexpr, PLAN: tl.constexpr, BD: tl.constexpr,
                        ALIGN: tl.constexpr):
    """Gradient of the convolution before its activation, [T, C] float32."""
    i_s = tl.program_id(1)
    n, bos, eos, start, o_t, m_t = _chunk(cu_seqlens, chunk_indices, BT, PLAN)
    if start >= eos:  # a block past its sequence's end (TOKENS < CHUNK) has nothing to do
        return
    C = 2 * H * K + HV * V
    is_qk = i_s < 2 * H
    o_d, cols, m_d = _slot(i_s, H, K, HV, V, BD, ALIGN)
    m = m_t[:, None] & m_d[None, :]
    pre = _conv_window(x, init, weight, o_t, start, bos, n, cols, m_t, m_d, m_d, stride, C, W, HAS_INIT, BT, BD)
    sig = tl.sigmoid(pre)
    if is_qk:
        if i_s < H:
            offset = o_t[:, None] * (H * K) + i_s * K + o_d[None, :]
            y = tl.load(q + offset, mask=m, other=0.0).to(tl.float32)
            dy = tl.load(dq + offset, mask=m, other=0.0).to(tl.float32)
        else:
            offset = o_t[:, None] * (H * K) + (i_s - H) * K + o_d[None, :]
            y = tl.load(k + offset, mask=m, other=0.0).to(tl.float32)
            dy = tl.load(dk + offset, mask=m, other=0.0).to(tl.float32)
        r = tl.load(rstd + o_t * (2 * H) + i_s, mask=m_t, other=0.0)
        du = _norm_grad(dy, y, r, 1)  # the L2 norm
    else:
        du = tl.load(dv + o_t[:, None] * (HV * V) + (i_s - 2 * H) * V + o_d[None, :], mask=m, other=0.0).to(tl.float32)
    # d silu(p) / dp = sig (1 + p (1 - sig))
    grad = du * sig * (1.0 + pre * (1.0 - sig))
    tl.store(dpre + o_t[:, None] * C + cols[None, :], grad, mask=m)


@triton.jit
def _conv_heads_bwd_x(dpre, weight, dfinal, dx, dinit, cu_seqlens, chunk_indices, C, W: tl.constexpr,
                      HAS_INIT: tl.constexpr, HAS_DFINAL: tl.constexpr, BT: tl.constexpr, PLAN: tl.constexpr,
                      BC: tl.constexpr):
    """Gradients of the convolution's inputs (dx [T, C]) and of the carried state (dinit [N, C, W])."""
    n, bos, eos, start, o_t, m_t = _chunk(cu_seqlens, chunk_indices, BT, PLAN)
    if start >= eos:  # a block past its sequence's end (TOKENS < CHUNK) has nothing to do
        return
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    m_c = cols < C
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for i in tl.static_range(W):
        # Input s feeds output s + W - 1 - i through tap i.
        t = o_t + (W - 1) - i
        g = tl.load(dpre + t[:, None] * C + cols[None, :], mask=((t < eos) & m_t)[:, None] & m_c[None, :], other=0.0)
        w = tl.load(weight + cols * W + i, mask=m_c, other=0.0).to(tl.float32)
        acc += g * w[None, :]
    if HAS_DFINAL:
        for j in tl.static_range(W):
            # final[n, :, j] is input eos - W + j when that lies inside the sequence.
            position = eos - W + j
            df = tl.load(dfinal + n * C * W + cols * W + j, mask=m_c, other=0.0).to(tl.float32)
            acc += tl.where(((o_t == position) & (o_t >= bos))[:, None], df[None, :], 0.0)
    tl.store(dx + o_t[:, None] * C + cols[None, :], acc.to(dx.dtype.element_ty), mask=m_t[:, None] & m_c[None, :])
    if HAS_INIT:
        if start == bos:  # the sequence's first block writes the carried state's gradient
            length = eos - bos
            for jj in tl.static_range(1, W):
                # init[n, :, jj] is the input at relative position jj - W: output tt uses it through
                # tap i = jj - 1 - tt.
                total = tl.zeros([BC], dtype=tl.float32)
                for i in tl.static_range(W):
                    if jj - 1 - i >= 0:
                        tt = jj - 1 - i
                        g0 = tl.load(dpre + (bos + tt) * C + cols,
                                     mask=m_c & ((tl.zeros([BC], dtype=tl.int64) + tt) < length), other=0.0)
                        w0 = tl.load(weight + cols * W + i, mask=m_c, other=0.0).to(tl.float32)
                        total += g0 * w0
                if HAS_DFINAL:
                    for j in tl.static_range(W):
                        # final[n, :, j] is init[n, :, length + j] when length + j < W.
                        d0 = tl.load(dfinal + n * C * W + cols * W + j, mask=m_c, other=0.0).to(tl.float32)
                        total += tl.where(length + j == jj, d0, 0.0)
                tl.store(dinit + n * C * W + cols * W + jj, total.to(dinit.dtype.element_ty), mask=m_c)


class ConvSplitHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, initial_state, output_final_state, cu_seqlens, bounds, chunk_indices, heads,
                key_dim, value_heads, value_dim, empty_sequences=False, parents=None):
        total, channels = x.shape
        width = weight.shape[-1]
        ctx.bounds = bounds
        x = x if x.stride(-1) == 1 else x.contiguous()
        weight = weight.contiguous()
        init = initial_state.contiguous() if initial_state is not None else None
        q = x.new_empty(total, heads, key_dim)
        k = x.new_empty(total, heads, key_dim)
        v = x.new_empty(total, value_heads, value_dim)
        rstd = x.new_empty(total, 2 * heads, dtype=torch.float32)
        sequences = cu_seqlens.shape[0] - 1
        # No program writes the final state of an empty sequence: zero it (no carried state).
        final = ((x.new_zeros if empty_sequences else x.new_empty)(sequences, channels, width)
                 if output_final_state else None)
        block = triton.next_power_of_2(max(key_dim, value_dim))
        align = _alignment(key_dim, value_dim)
        grid = (chunk_indices.shape[0], 2 * heads + value_heads, CHUNK // TOKENS)
        # Without a carried state the kernels get x in its place, unread (HAS_INIT is False): the
        # helper they call then always receives a pointer, never None.
        with _on(x.device):
            _conv_heads_fwd[grid](x, weight, init if init is not None else x,
                                  parents if parents is not None else cu_seqlens, q, k, v, rstd, final, cu_seqlens,
                                  chunk_indices, x.stride(0), EPS,
                                  heads, key_dim, value_heads, value_dim, width, init is not None, parents is not None,
                                  final is not None, TOKENS, CHUNK, block, align, num_warps=WARPS)
        ctx.save_for_backward(x, weight, init, q, k, rstd, cu_seqlens, chunk_indices)
        ctx.shape = (heads, key_dim, value_heads, value_dim, block, align)
        return q, k, v, final

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dq, dk, dv, dfinal):
        x, weight, init, q, k, rstd, cu_seqlens, chunk_indices = ctx.saved_tensors
        heads, key_dim, value_heads, value_dim, block, align = ctx.shape
        total, channels = x.shape
        width = weight.shape[-1]
        dq = torch.zeros_like(q) if dq is None else dq.contiguous()
        dk = torch.zeros_like(k) if dk is None else dk.contiguous()
        dv = x.new_zeros(total, value_heads, value_dim) if dv is None else dv.contiguous()
        dpre = torch.empty(total, channels, dtype=torch.float32, device=x.device)
        grid = (chunk_indices.shape[0], 2 * heads + value_heads, CHUNK // TOKENS)
        dx = torch.empty(total, channels, dtype=x.dtype, device=x.device)
        dinit = torch.zeros_like(init) if init is not None else None
        columns = 128
        with _on(x.device):
            _conv_heads_bwd_pre[grid](x, weight, init if init is not None else x, q, k, rstd, dq, dk, dv, dpre,
                                      cu_seqlens, chunk_indices,
                                      x.stride(0), heads, key_dim, value_heads, value_dim, width, init is not None,
                                      TOKENS, CHUNK, block, align, num_warps=WARPS)
            _conv_heads_bwd_x[(chunk_indices.shape[0], triton.cdiv(channels, columns), CHUNK // TOKENS)](
                dpre, weight, dfinal.contiguous() if dfinal is not None else None, dx, dinit, cu_seqlens,
                chunk_indices, channels, width, init is not None, dfinal is not None, TOKENS, CHUNK, columns,
                num_warps=WARPS)
        dweight = None
        if ctx.needs_input_grad[1]:
            dweight = _conv_weight_grad(x, init, dpre, ctx.bounds, width).to(weight.dtype)
        return (dx if ctx.needs_input_grad[0] else None, dweight, dinit, None, None, None, None, None, None, None, None,
                None, None)


def _conv_weight_grad(x, init, dpre, bounds: list[int], width):
    """dweight[c, i] = sum over tokens t of dpre[t, c] * input(t - (W - 1) + i, c), in plain
    PyTorch, sequence by sequence (`bounds`: the host's cumulative lengths; the recipe's LoRA
    leaves the convolution frozen, so this rarely runs)."""
    total, channels = x.shape
    grad = torch.zeros(channels, width, dtype=torch.float32, device=x.device)
    for n, (bos, eos) in enumerate(zip(bounds[:-1], bounds[1:])):
        history = (init[n].transpose(0, 1)[1:].float() if init is not None
                   else x.new_zeros(width - 1, channels, dtype=torch.float32))
        inputs = torch.cat([history, x[bos:eos].float()])  # [W - 1 + L, C]
        for i in range(width):
            grad[:, i] += (dpre[bos:eos] * inputs[i:i + eos - bos]).sum(0)
    return grad


def conv_split_heads(x: torch.Tensor, weight: torch.Tensor, initial_state: torch.Tensor | None,
                     output_final_state: bool, cu_seqlens: torch.Tensor, cu_seqlens_cpu: torch.Tensor,
                     chunk_indices: torch.Tensor | None, heads: int, key_dim: int, value_heads: int, value_dim: int,
                     parents: torch.Tensor | None = None):
    """SiLU(causal depthwise conv) of packed sequences, split into L2-normalised q, k and v.

    Args:
        x: [T, 2*H*K + HV*V] (unit stride along channels); weight: [C, W].
        initial_state: [N, C, W] the W inputs before each sequence (last one most recent), or None;
            with `parents`, [G, C, W] states that sequence n reads at row parents[n] (a zero
            state where that is negative), forward only: no gradient reaches them.
        output_final_state: also return each sequence's last W inputs, [N, C, W].
        cu_seqlens: [N + 1] on x's device; cu_seqlens_cpu its host copy (a sequence may be empty;
            its final state is then zero);
        chunk_indices: [chunks, 2] int32 (sequence, 64-token chunk), or None to plan here.

    Returns:
        (q [T, H, K], k [T, H, K], v [T, HV, V], final state or None)
    """
    bounds = cu_seqlens_cpu.tolist()  # one conversion; the checks below are plain Python
    lengths = [end - begin for begin, end in zip(bounds[:-1], bounds[1:])]
    if min(lengths, default=1) < 0:
        raise ValueError("conv_split_heads: the cumulative lengths decrease")
    empty = min(lengths, default=1) == 0
    if parents is not None and (initial_state is None or parents.shape != (len(lengths),)):
        raise ValueError(f"conv_split_heads: parents come with carried states, one a sequence: {len(lengths)} "
                         f"sequences, parents {None if parents is None else tuple(parents.shape)}")
    if parents is not None and torch.is_grad_enabled() and any(
            t.requires_grad for t in (x, weight, initial_state)):
        raise ValueError("conv_split_heads: states read through parents are for forward passes only")
    if empty and output_final_state and initial_state is not None:
        raise ValueError("conv_split_heads: an empty sequence would keep its carried state as its final state; "
                         "give every sequence a token")
    channels = 2 * heads * key_dim + value_heads * value_dim
    if x.shape[-1] != channels or weight.shape[0] != channels:
        raise ValueError(f"conv_split_heads: {heads} x {key_dim} q and k heads and {value_heads} x {value_dim} v heads "
                         f"are {channels} channels, but x has {x.shape[-1]} and the weight {weight.shape[0]}")
    if chunk_indices is None:
        chunk_indices = chunk_plan(lengths, CHUNK).to(x.device, non_blocking=True)
    else:
        # Every token must fall in one planned chunk, or no program would write it. A plan may
        # hold more entries (a bucket's, `dohnuts.model.buckets`): those name empty sequences.
        chunks = sum(-(-length // CHUNK) for length in lengths)
        if chunk_indices.shape[0] < chunks:
            raise ValueError(f"conv_split_heads: the chunk plan has {chunk_indices.shape[0]} chunks, but the "
                             f"sequences make {chunks} of {CHUNK} tokens")
    return ConvSplitHeads.apply(x, weight, initial_state, output_final_state, cu_seqlens, bounds, chunk_indices,
                                heads, key_dim, value_heads, value_dim, empty, parents)


# -- the delta rule of short rows continuing forked states -----------------------------------------
#
# A request's question rows continue one shared prefix and are short (the 50-question request's
# rows hold 28 to 44 tokens of their own). Run through FLA's chunked kernels, each row first gets
# its own copy of its prefix's [HV, K, V] float32 state (1 MB a row on Qwen3.5-0.8B), then five
# kernels pass the row's one chunk through memory between them. `delta_rule_rows` does a whole row
# (up to 64 tokens) in one program per value head and block of values, reading the state through
# the row's parent index: the chunk form of the recurrence (see
# `kernels.gated_delta_rule_chunked`) as a block-triangular solve of four 16-token parts.

ROW_TOKENS = 64  # the longest row `delta_rule_rows` takes (four parts)
PART = 16  # tokens a part
# Values a program (a block of V) and warps a program. For the 50-question request's rows on
# the H200 (Qwen3.5-0.8B widths, bf16; docs/results/h200-delta-rule-short-rows-46f6c73.txt): 70.5
# us a layer at 64 values and 4 warps; 73.0 at 128 and 8, 89.3 at 32 and 2, 113 at 32 and 4 or
# 64 and 8 (FLA's chunked kernels with the fork: 135.5).
VALUES = 64
ROW_WARPS = 4


@triton.jit
def _row_part(q, k, v, a, b, bos, eos, part, i_hk, i_h, A_log, dt_bias, o_k, o_v, sa, sb,
              H: tl.constexpr, K: tl.constexpr, HV: tl.constexpr, V: tl.constexpr, BC: tl.constexpr,
              SIGMOID: tl.constexpr):
    """Part `part` of the row bos:eos: q, k [BC, BK], v [BC, BV], the log decay g [BC] and beta
    [BC], both float32 and 0 past the row's end (as are q, k and v). The gate input a and b are
    read with row strides `sa` and `sb` (column blocks of a wider projection output); b is beta,
    or with SIGMOID beta's input, whose sigmoid is taken here (one launch a layer fewer)."""
    o_t = bos + part * BC + tl.arange(0, BC)
    m_t = o_t < eos
    m_qk = m_t[:, None] & (o_k < K)[None, :]
    b_q = tl.load(q + (o_t[:, None] * H + i_hk) * K + o_k[None, :], mask=m_qk, other=0.0)
    b_k = tl.load(k + (o_t[:, None] * H + i_hk) * K + o_k[None, :], mask=m_qk, other=0.0)
    b_v = tl.load(v + (o_t[:, None] * HV + i_h) * V + o_v[None, :], mask=m_t[:, None] & (o_v < V)[None, :],
                  other=0.0)
    # Qwen3.5's decay from the raw gate input: -exp(A_log) softplus(a + dt_bias) (softplus as
    # PyTorch's, linear past 20).
    x = tl.load(a + o_t * sa + i_h, mask=m_t, other=0.0).to(tl.float32) + dt_bias
    g = tl.where(m_t, -tl.exp(A_log) * tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0)))), 0.0)
    beta = tl.load(b + o_t * sb + i_h, mask=m_t, other=0.0).to(tl.float32)
    if SIGMOID:
        beta = tl.where(m_t, tl.sigmoid(beta), 0.0)
    return b_q, b_k, b_v, g, beta


@triton.jit
def _decayed(scores, g_rows, g_cols, DIAGONAL: tl.constexpr, STRICT: tl.constexpr, BC: tl.constexpr):
    """scores [BC, BC] times exp(g_rows[i] - g_cols[j]) (cumulative log decays), for a block on
    the diagonal only where i > j (STRICT) or i >= j; the exponent is never positive where kept."""
    gap = g_rows[:, None] - g_cols[None, :]
    if DIAGONAL:
        o = tl.arange(0, BC)
        keep = (o[:, None] > o[None, :]) if STRICT else (o[:, None] >= o[None, :])
        return tl.where(keep, scores * tl.exp(tl.where(keep, gap, 0.0)), 0.0)
    return scores * tl.exp(gap)


@triton.jit
def _unit_lower_inverse(L, BC: tl.constexpr):
    """(I + L)^-1 of a strictly lower-triangular [BC, BC] L (BC = 16): with B = -L nilpotent,
    sum_{p < 16} B^p = (I + B)(I + B^2)(I + B^4)(I + B^8). Six small products in full float32
    precision, where forward substitution would take 15 dependent steps, each a reduction
    across the program's threads (that made the kernel slower than FLA's five). The price is
    accuracy on badly conditioned blocks (nearly parallel keys, beta near 1, little decay),
    whose large higher powers cancel: there the output is off by up to about 1e-4 of outputs
    of order 1 (tests/triton_interpreted.py), under bf16's resolution."""
    o = tl.arange(0, BC)
    eye = tl.where(o[:, None] == o[None, :], 1.0, 0.0)
    power = -L
    inverse = eye + power
    for _ in tl.static_range(3):
        power = tl.dot(power, power, input_precision="ieee")
        inverse = inverse + tl.dot(inverse, power, input_precision="ieee")
    return inverse


@triton.jit
def _sequence_program(cu_seqlens, H: tl.constexpr, HV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """A delta-rule program's sequence n, value head i_h and its key head i_hk, the sequence's
    bounds bos and eos, the key offsets [BK] and its block of value offsets [BV]."""
    n, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos = tl.load(cu_seqlens + n).to(tl.int64)
    eos = tl.load(cu_seqlens + n + 1).to(tl.int64)
    return n, i_h, i_h // (HV // H), bos, eos, tl.arange(0, BK), i_v * BV + tl.arange(0, BV)


@triton.jit
def _parent_state(states, parents, n, i_h, G, o_k, o_v, K: tl.constexpr, HV: tl.constexpr, V: tl.constexpr,
                  BK: tl.constexpr):
    """Row n's initial state [BK, BV] of value head i_h, float32: its parent's, or zero (parent
    -1). (The parent as a vector, not a scalar, in the mask: Triton's interpreter wants that.)"""
    parent = tl.zeros([BK], dtype=tl.int64) + tl.load(parents + n).to(tl.int64)
    has = (parent >= 0) & (parent < G)
    start = tl.where(has, parent, 0) * HV + i_h
    m_kv = (o_k < K)[:, None] & (o_v < V)[None, :]
    return tl.load(states + (start[:, None] * K + o_k[:, None]) * V + o_v[None, :], mask=m_kv & has[:, None],
                   other=0.0).to(tl.float32)


@triton.jit
def _delta_rows_fwd(q, k, v, a, b, A_log, dt_bias, states, parents, o, cu_seqlens, G, scale, sa, sb,
                    H: tl.constexpr, K: tl.constexpr, HV: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                    BV: tl.constexpr, BC: tl.constexpr, PARTS: tl.constexpr, SIGMOID: tl.constexpr):
    n, i_h, i_hk, bos, eos, o_k, o_v = _sequence_program(cu_seqlens, H, HV, BK, BV)
    h0 = _parent_state(states, parents, n, i_h, G, o_k, o_v, K, HV, V, BK).to(q.dtype.element_ty)
    log_a = tl.load(A_log + i_h).to(tl.float32)
    bias = tl.load(dt_bias + i_h).to(tl.float32)
    # The row's parts (PARTS of them, enough for the longest row; past a row's end they are
    # zero): q, k [BC, BK], v [BC, BV], the log decay and beta [BC]. Written out part by part:
    # Triton keeps register tiles in named variables only, not in lists a loop could index.
    q0, k0, v0, g0, b0 = _row_part(q, k, v, a, b, bos, eos, 0, i_hk, i_h, log_a, bias, o_k, o_v, sa, sb, H, K, HV, V,
                                   BC, SIGMOID)
    g0 = tl.cumsum(g0, 0)  # cumulative log decays from the row's start
    # The pseudo-values U_i of each part by block forward substitution:
    # U_i = (I + A_ii)^-1 (beta_i (v_i - exp(G_i) S0^T k_i) - sum_{j < i} A_ij U_j), with
    # A_ij = beta_i exp(G_i - G_j) (k_i . k_j) (strictly lower on the diagonal); then
    # o_i = scale (exp(G_i) S0^T q_i + sum_{j <= i} exp(G_i - G_j) (q_i . k_j) U_j).
    u0 = _part_values(k0, v0, g0, b0, h0, tl.zeros([BC, BV], dtype=tl.float32), BC)
    o0 = _part_output(q0, k0, g0, g0, u0, True, BC) + tl.exp(g0)[:, None] * tl.dot(q0, h0)
    _store_part(o, o0 * scale, bos, eos, 0, i_h, o_v, HV, V, BC)
    # A part past the row's end is skipped (nested: a part reads the ones before it). PARTS
    # covers the launch's longest row; most rows of a request or a bucket are shorter.
    if PARTS > 1:
        if eos - bos > BC:
            q1, k1, v1, g1, b1 = _row_part(q, k, v, a, b, bos, eos, 1, i_hk, i_h, log_a, bias, o_k, o_v, sa, sb, H, K,
                                           HV, V, BC, SIGMOID)
            g1 = tl.cumsum(g1, 0) + _last(g0, BC)
            u1 = _part_values(k1, v1, g1, b1, h0, _coupling(k1, g1, b1, k0, g0, u0, BC), BC)
            o1 = (_part_output(q1, k1, g1, g1, u1, True, BC) + _part_output(q1, k0, g1, g0, u0, False, BC)
                  + tl.exp(g1)[:, None] * tl.dot(q1, h0))
            _store_part(o, o1 * scale, bos, eos, 1, i_h, o_v, HV, V, BC)
            if PARTS > 2:
                if eos - bos > 2 * BC:
                    q2, k2, v2, g2, b2 = _row_part(q, k, v, a, b, bos, eos, 2, i_hk, i_h, log_a, bias, o_k, o_v, sa,
                                                   sb, H, K, HV, V, BC, SIGMOID)
                    g2 = tl.cumsum(g2, 0) + _last(g1, BC)
                    u2 = _part_values(k2, v2, g2, b2, h0, _coupling(k2, g2, b2, k0, g0, u0, BC)
                                      + _coupling(k2, g2, b2, k1, g1, u1, BC), BC)
                    o2 = (_part_output(q2, k2, g2, g2, u2, True, BC) + _part_output(q2, k0, g2, g0, u0, False, BC)
                          + _part_output(q2, k1, g2, g1, u1, False, BC) + tl.exp(g2)[:, None] * tl.dot(q2, h0))
                    _store_part(o, o2 * scale, bos, eos, 2, i_h, o_v, HV, V, BC)
                    if PARTS > 3:
                        if eos - bos > 3 * BC:
                            _row_last_part(q, k, v, a, b, o, bos, eos, i_hk, i_h, log_a, bias, o_k, o_v, sa, sb,
                                           scale, h0, k0, g0, u0, k1, g1, u1, k2, g2, u2, H, K, HV, V, BC, SIGMOID)


@triton.jit
def _row_last_part(q, k, v, a, b, o, bos, eos, i_hk, i_h, log_a, bias, o_k, o_v, sa, sb, scale, h0, k0, g0, u0, k1,
                   g1, u1, k2, g2, u2, H: tl.constexpr, K: tl.constexpr, HV: tl.constexpr, V: tl.constexpr,
                   BC: tl.constexpr, SIGMOID: tl.constexpr):
    """`_delta_rows_fwd`'s fourth part, from the three before it (a function of its own keeps
    the nesting readable)."""
    q3, k3, v3, g3, b3 = _row_part(q, k, v, a, b, bos, eos, 3, i_hk, i_h, log_a, bias, o_k, o_v, sa, sb, H, K, HV, V,
                                   BC, SIGMOID)
    g3 = tl.cumsum(g3, 0) + _last(g2, BC)
    u3 = _part_values(k3, v3, g3, b3, h0, _coupling(k3, g3, b3, k0, g0, u0, BC)
                      + _coupling(k3, g3, b3, k1, g1, u1, BC) + _coupling(k3, g3, b3, k2, g2, u2, BC), BC)
    o3 = (_part_output(q3, k3, g3, g3, u3, True, BC) + _part_output(q3, k0, g3, g0, u0, False, BC)
          + _part_output(q3, k1, g3, g1, u1, False, BC) + _part_output(q3, k2, g3, g2, u2, False, BC)
          + tl.exp(g3)[:, None] * tl.dot(q3, h0))
    _store_part(o, o3 * scale, bos, eos, 3, i_h, o_v, HV, V, BC)


@triton.jit
def _last(g, BC: tl.constexpr):
    """The last entry of g [BC]."""
    return tl.sum(tl.where(tl.arange(0, BC) == BC - 1, g, 0.0), 0)


@triton.jit
def _coupling(k_i, g_i, b_i, k_j, g_j, u_j, BC: tl.constexpr):
    """A_ij U_j for an earlier part j: [BC, BV]."""
    return tl.dot(b_i[:, None] * _decayed(tl.dot(k_i, tl.trans(k_j)), g_i, g_j, False, True, BC), u_j)


@triton.jit
def _part_values(k_i, v_i, g_i, b_i, h0, coupled, BC: tl.constexpr):
    """U_i [BC, BV] float32 from the earlier parts' coupling sum_{j < i} A_ij U_j."""
    rhs = b_i[:, None] * (v_i.to(tl.float32) - tl.exp(g_i)[:, None] * tl.dot(k_i, h0)) - coupled
    diagonal = b_i[:, None] * _decayed(tl.dot(k_i, tl.trans(k_i)), g_i, g_i, True, True, BC)
    return tl.dot(_unit_lower_inverse(diagonal, BC), rhs)


@triton.jit
def _part_output(q_i, k_j, g_i, g_j, u_j, DIAGONAL: tl.constexpr, BC: tl.constexpr):
    """sum over part j's tokens (up to each token of part i) of exp(G_i - G_j) (q_i . k_j) U_j."""
    return tl.dot(_decayed(tl.dot(q_i, tl.trans(k_j)), g_i, g_j, DIAGONAL, False, BC), u_j)


@triton.jit
def _store_part(o, value, bos, eos, part, i_h, o_v, HV: tl.constexpr, V: tl.constexpr, BC: tl.constexpr):
    o_t = bos + part * BC + tl.arange(0, BC)
    tl.store(o + (o_t[:, None] * HV + i_h) * V + o_v[None, :], value.to(o.dtype.element_ty),
             mask=(o_t < eos)[:, None] & (o_v < V)[None, :])


def delta_rule_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    states: torch.Tensor, parents: torch.Tensor, cu_seqlens: torch.Tensor, longest: int,
                    A_log: torch.Tensor, dt_bias: torch.Tensor, scale: float | None = None,
                    out: torch.Tensor | None = None, beta_logits: bool = False) -> torch.Tensor:
    """The gated delta rule's output for packed rows of at most ROW_TOKENS tokens, row n
    starting from states[parents[n]] (a zero state where parents[n] < 0); forward only.

    Args:
        q, k: [T, H, K] (L2-normalised, as Qwen3.5's delta rule wants); v: [T, HV, V].
        g: [T, HV] the raw gate input (the decay is `kernels.decay(g, A_log, dt_bias)`);
            beta: [T, HV], or with `beta_logits` the input of its sigmoid, which the kernel
            takes as it reads it. Both may be column blocks of a wider projection output.
        states: [G, HV, K, V] float32; parents: [N] integer; cu_seqlens: [N + 1] on q's device.
        longest: the longest row (host int, from the host's copy of cu_seqlens), at most
            ROW_TOKENS. The kernel covers each row's first `longest` tokens (rounded up to a
            multiple of PART), so a smaller value would leave later tokens unwritten.
        A_log, dt_bias: [HV]. scale: of q, K^-0.5 by default.
        out: as `delta_rule_scan`'s.

    Returns:
        o [T, HV, V] in v's dtype.
    """
    total, heads, key_dim = q.shape
    value_heads, value_dim = v.shape[1:]
    if longest > ROW_TOKENS:
        raise ValueError(f"delta_rule_rows: rows of at most {ROW_TOKENS} tokens, but one has {longest}")
    if value_heads % heads or k.shape != q.shape or g.shape != (total, value_heads) or beta.shape != g.shape:
        raise ValueError(f"delta_rule_rows: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"g {tuple(g.shape)} and beta {tuple(beta.shape)} do not fit together")
    if parents.shape != (cu_seqlens.shape[0] - 1,):
        raise ValueError(f"delta_rule_rows: {cu_seqlens.shape[0] - 1} rows but parents {tuple(parents.shape)}")
    if states.shape[1:] != (value_heads, key_dim, value_dim):
        raise ValueError(f"delta_rule_rows: states {tuple(states.shape)} do not fit {value_heads} heads of "
                         f"{key_dim} x {value_dim}")
    q, k, v = (x.contiguous() for x in (q, k, v))
    (g, gate_stride), (beta, beta_stride) = _even_rows(g), _even_rows(beta)
    o = _output(v, out, "delta_rule_rows")
    block_k = max(16, triton.next_power_of_2(key_dim))
    block_v = max(16, min(VALUES, triton.next_power_of_2(value_dim)))
    parts = -(-max(longest, 1) // PART)
    grid = (cu_seqlens.shape[0] - 1, value_heads, triton.cdiv(value_dim, block_v))
    with _on(q.device):
        _delta_rows_fwd[grid](q, k, v, g, beta, A_log, dt_bias, states.contiguous(), parents, o, cu_seqlens,
                              states.shape[0], key_dim**-0.5 if scale is None else scale, gate_stride, beta_stride,
                              heads, key_dim, value_heads, value_dim, block_k, block_v, PART, parts, beta_logits,
                              num_warps=ROW_WARPS)
    return o


# -- the delta rule of whole sequences, forward only -----------------------------------------------
#
# At inference the prefixes (and rows longer than ROW_TOKENS) went through FLA's chunked
# kernels, whose Python wrappers cost 0.3 to 2.3 ms of host time a call: in a request met for
# the first time, which runs eagerly, that was most of its latency (docs/runtime.md).
# `delta_rule_scan` runs a sequence in one program per value head and block of values, walking
# it in 16-token parts with the state [K, BV] in registers: each part is the chunk form of
# `kernels.gated_delta_rule_chunked` at chunk size 16 (the same products as a part of
# `delta_rule_rows`), then the state moves past it. One launch a layer, whatever the number of
# sequences; the parts of a sequence run one after another, so a long sequence alone keeps
# few programs busy, and SCAN_TOKENS bounds the sequences it takes.

SCAN_TOKENS = 1024  # the longest sequence `kernels` sends to `delta_rule_scan`


@triton.jit
def _delta_scan_fwd(q, k, v, a, b, A_log, dt_bias, states, parents, o, final, cu_seqlens, G, scale, sa, sb,
                    H: tl.constexpr, K: tl.constexpr, HV: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                    BV: tl.constexpr, BC: tl.constexpr, INITIAL: tl.constexpr, FINAL: tl.constexpr,
                    SIGMOID: tl.constexpr):
    n, i_h, i_hk, bos, eos, o_k, o_v = _sequence_program(cu_seqlens, H, HV, BK, BV)
    m_kv = (o_k < K)[:, None] & (o_v < V)[None, :]
    h = tl.zeros([BK, BV], dtype=tl.float32)
    if INITIAL:
        h = _parent_state(states, parents, n, i_h, G, o_k, o_v, K, HV, V, BK)
    log_a = tl.load(A_log + i_h).to(tl.float32)
    bias = tl.load(dt_bias + i_h).to(tl.float32)
    for part in range(0, tl.cdiv(eos - bos, BC)):
        q_i, k_i, v_i, g_i, b_i = _row_part(q, k, v, a, b, bos, eos, part, i_hk, i_h, log_a, bias, o_k, o_v, sa, sb,
                                            H, K, HV, V, BC, SIGMOID)
        g_i = tl.cumsum(g_i, 0)  # from the part's start; 0 added past the sequence's end
        h_in = h.to(q_i.dtype)
        u_i = _part_values(k_i, v_i, g_i, b_i, h_in, tl.zeros([BC, BV], dtype=tl.float32), BC)
        o_i = _part_output(q_i, k_i, g_i, g_i, u_i, True, BC) + tl.exp(g_i)[:, None] * tl.dot(q_i, h_in)
        _store_part(o, o_i * scale, bos, eos, part, i_h, o_v, HV, V, BC)
        # S <- exp(G_last) S + sum_t exp(G_last - G_t) k_t u_t^T (u is 0 past the end)
        last = _last(g_i, BC)
        h = h * tl.exp(last) + tl.dot(tl.trans(k_i), (u_i * tl.exp(last - g_i)[:, None]).to(k_i.dtype))
    if FINAL:
        tl.store(final + ((n * HV + i_h) * K + o_k[:, None]) * V + o_v[None, :], h, mask=m_kv)


def _output(v: torch.Tensor, out: torch.Tensor | None, name: str) -> torch.Tensor:
    """A delta-rule kernel's output tensor: `out` when given (checked), else a new one like v."""
    if out is None:
        return torch.empty_like(v)
    if out.shape != v.shape or out.dtype != v.dtype or out.device != v.device or not out.is_contiguous():
        raise ValueError(f"{name}: out must be a contiguous {v.dtype} tensor of shape {tuple(v.shape)} on {v.device}, "
                         f"got {out.dtype} {tuple(out.shape)} on {out.device}")
    return out


def delta_rule_scan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    states: torch.Tensor | None, parents: torch.Tensor | None, cu_seqlens: torch.Tensor,
                    output_final_state: bool, A_log: torch.Tensor, dt_bias: torch.Tensor,
                    scale: float | None = None, out: torch.Tensor | None = None, beta_logits: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule's output for packed sequences of any length, sequence n starting
    from states[parents[n]] (zero where parents[n] < 0, or everywhere without `states`);
    forward only.

    Args:
        q, k: [T, H, K] (L2-normalised); v: [T, HV, V]; g: [T, HV] the raw gate input (the
            decay is `kernels.decay(g, A_log, dt_bias)`); beta: [T, HV], or with `beta_logits`
            the input of its sigmoid (as `delta_rule_rows`).
        states: [G, HV, K, V] float32 or None; parents: [N] integer (with `states`).
        cu_seqlens: [N + 1] on q's device.
        output_final_state: also return each sequence's final state [N, HV, K, V] float32.
        A_log, dt_bias: [HV]. scale: of q, K^-0.5 by default.
        out: [T, HV, V] contiguous, v's dtype: where to write o (a part of a larger output), or
            None for a new tensor.

    Returns:
        (o [T, HV, V] in v's dtype, final states or None)
    """
    total, heads, key_dim = q.shape
    value_heads, value_dim = v.shape[1:]
    sequences = cu_seqlens.shape[0] - 1
    if value_heads % heads or k.shape != q.shape or g.shape != (total, value_heads) or beta.shape != g.shape:
        raise ValueError(f"delta_rule_scan: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"g {tuple(g.shape)} and beta {tuple(beta.shape)} do not fit together")
    if (states is None) != (parents is None):
        raise ValueError("delta_rule_scan: states and parents come together")
    if states is not None and (parents.shape != (sequences,) or states.shape[1:] != (value_heads, key_dim, value_dim)):
        raise ValueError(f"delta_rule_scan: {sequences} sequences, parents {tuple(parents.shape)}, states "
                         f"{tuple(states.shape)}, for {value_heads} heads of {key_dim} x {value_dim}")
    q, k, v = (x.contiguous() for x in (q, k, v))
    (g, gate_stride), (beta, beta_stride) = _even_rows(g), _even_rows(beta)
    o = _output(v, out, "delta_rule_scan")
    final = q.new_empty(sequences, value_heads, key_dim, value_dim, dtype=torch.float32) if output_final_state else o
    initial = states.contiguous() if states is not None else o
    block_k = max(16, triton.next_power_of_2(key_dim))
    block_v = max(16, min(VALUES, triton.next_power_of_2(value_dim)))
    grid = (sequences, value_heads, triton.cdiv(value_dim, block_v))
    with _on(q.device):
        _delta_scan_fwd[grid](q, k, v, g, beta, A_log, dt_bias, initial, parents if parents is not None else cu_seqlens,
                              o, final, cu_seqlens, 0 if states is None else states.shape[0],
                              key_dim**-0.5 if scale is None else scale, gate_stride, beta_stride, heads, key_dim,
                              value_heads, value_dim, block_k, block_v, PART, states is not None, output_final_state,
                              beta_logits, num_warps=ROW_WARPS)
    return o, final if output_final_state else None


# -- RMSNorm and SwiGLU ---------------------------------------------------------------------------
#
# The same math as FLA's fused kernels, launched with one call and no autotuning, so a training
# step (host-bound: its layers issue thousands of launches) spends microseconds, not a quarter
# of a millisecond, of host time on each.

ROWS = 16  # rows per RMSNorm program


@triton.jit
def _rms_norm_fwd(x, scale, y, rstd, R, B, s0, s1, eps, D: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr):
    # Row r of the [A, B, D] input lies at (r // B) * s0 + (r % B) * s1; the output is contiguous.
    rows, cols, m_r, m = _row_tile(R, D, BR, BD)
    start = (rows // B) * s0 + (rows % B) * s1
    xs = tl.load(x + start[:, None] + cols[None, :], mask=m, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(xs * xs, axis=1) / D + eps)
    w = tl.load(scale + cols, mask=cols < D, other=0.0).to(tl.float32)
    tl.store(y + rows[:, None] * D + cols[None, :], (xs * r[:, None] * w[None, :]).to(y.dtype.element_ty), mask=m)
    tl.store(rstd + rows, r, mask=m_r)


@triton.jit
def _rms_norm_bwd(x, scale, rstd, dy, dx, R, B, s0, s1, D: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr):
    rows, cols, m_r, m = _row_tile(R, D, BR, BD)
    start = (rows // B) * s0 + (rows % B) * s1
    xs = tl.load(x + start[:, None] + cols[None, :], mask=m, other=0.0).to(tl.float32)
    r = tl.load(rstd + rows, mask=m_r, other=0.0)
    w = tl.load(scale + cols, mask=cols < D, other=0.0).to(tl.float32)
    g = tl.load(dy + rows[:, None] * D + cols[None, :], mask=m, other=0.0).to(tl.float32) * w[None, :]
    grad = _norm_grad(g, xs * r[:, None], r, D)  # y = (x r) w, so g = dy w
    tl.store(dx + rows[:, None] * D + cols[None, :], grad.to(dx.dtype.element_ty), mask=m)


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


def _norm_launch(width: int) -> tuple[int, int, int]:
    """(block, rows per program, warps) of a norm over `width` channels: about 4,096 elements a
    program, so the float32 tiles stay in registers."""
    block = triton.next_power_of_2(max(width, 1))
    return block, max(1, min(ROWS, 4096 // block)), 4 if block <= 512 else 8


class RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale, eps):
        x, (count, inner, s0, s1) = _rows_layout(x)
        width = x.shape[-1]
        rows = count * inner
        y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
        block, per_program, warps = _norm_launch(width)
        with _on(x.device):
            _rms_norm_fwd[(triton.cdiv(rows, per_program),)](x, scale, y, rstd, rows, inner, s0, s1, eps, width,
                                                             per_program, block, num_warps=warps)
        ctx.save_for_backward(x, scale, rstd)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x, scale, rstd = ctx.saved_tensors
        return (*_rms_norm_grads(x, scale, rstd, dy, ctx.needs_input_grad[1]), None)


def _rms_norm_grads(x, scale, rstd, dy, scale_grad: bool):
    """(dx, dscale or None) of y = x / rms(x) * scale from dy, with the forward's rstd."""
    # The layout of the x handed back, which a saved-tensor hook may have repacked.
    x, (count, inner, s0, s1) = _rows_layout(x)
    width = x.shape[-1]
    rows = count * inner
    dy = dy.contiguous()
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    block, per_program, warps = _norm_launch(width)
    with _on(x.device):
        _rms_norm_bwd[(triton.cdiv(rows, per_program),)](x, scale, rstd, dy, dx, rows, inner, s0, s1, width,
                                                         per_program, block, num_warps=warps)
    dscale = None
    if scale_grad:  # the recipe's norms are frozen: rarely needed, so plain PyTorch
        normed = x.float().reshape(rows, width) * rstd[:, None]
        dscale = (dy.float().reshape(rows, width) * normed).sum(0).to(scale.dtype)
    return dx, dscale


def rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * scale over the last axis, in float32, returned in x's dtype (contiguous).
    x: [T, D] or [T, H, D] (any strides with unit stride along D); scale: [D]."""
    if scale.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm: scale {tuple(scale.shape)} does not match x {tuple(x.shape)}")
    return RMSNorm.apply(x, scale.contiguous(), eps)


@triton.jit
def _add_rms_norm_fwd(x, residual, scale, total, y, rstd, R, eps, D: tl.constexpr, BR: tl.constexpr,
                      BD: tl.constexpr):
    # The sum is rounded to x's dtype, then normed: as an addition followed by RMSNorm would.
    rows, cols, m_r, m = _row_tile(R, D, BR, BD)
    offsets = rows[:, None] * D + cols[None, :]
    added = (tl.load(x + offsets, mask=m, other=0.0).to(tl.float32)
             + tl.load(residual + offsets, mask=m, other=0.0).to(tl.float32)).to(total.dtype.element_ty)
    tl.store(total + offsets, added, mask=m)
    xs = added.to(tl.float32)
    r = tl.rsqrt(tl.sum(xs * xs, axis=1) / D + eps)
    w = tl.load(scale + cols, mask=cols < D, other=0.0).to(tl.float32)
    tl.store(y + offsets, (xs * r[:, None] * w[None, :]).to(y.dtype.element_ty), mask=m)
    tl.store(rstd + rows, r, mask=m_r)


class AddRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, scale, eps):
        x, residual = x.contiguous(), residual.contiguous()
        width = x.shape[-1]
        rows = x.numel() // max(width, 1)
        total, y = torch.empty_like(x), torch.empty_like(x)
        rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
        block, per_program, warps = _norm_launch(width)
        with _on(x.device):
            _add_rms_norm_fwd[(triton.cdiv(rows, per_program),)](x, residual, scale, total, y, rstd, rows, eps, width,
                                                                 per_program, block, num_warps=warps)
        ctx.save_for_backward(total, scale, rstd)
        return total, y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dtotal, dy):
        # Autograd materialises an output's unused gradient as zeros: both arrive as tensors.
        total, scale, rstd = ctx.saved_tensors
        grad, dscale = _rms_norm_grads(total, scale, rstd, dy, ctx.needs_input_grad[2])
        grad = grad + dtotal
        return grad, grad, dscale, None


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, scale: torch.Tensor, eps: float):
    """(x + residual, its RMSNorm times scale) in one pass: the sum in x's dtype, the norm in
    float32 from it, returned in x's dtype. x, residual: [..., D] of one shape; scale: [D]."""
    if residual.shape != x.shape or residual.dtype != x.dtype or scale.shape != x.shape[-1:]:
        raise ValueError(f"add_rms_norm: x {tuple(x.shape)} {x.dtype}, residual {tuple(residual.shape)} "
                         f"{residual.dtype} and scale {tuple(scale.shape)} do not fit together")
    return AddRMSNorm.apply(x, residual, scale.contiguous(), eps)


# -- RMSNorm of attention heads fused with the partial rotary embedding ----------------------------
#
# Attention's query and key are normed per head, then their first R channels rotated: apart,
# that is a norm and six elementwise kernels (negate, two concatenations, two products, a sum)
# per tensor, 84 launches a Qwen3.5-0.8B forward. `norm_rotate` does both in one pass.


@triton.jit
def _norm_rotate_fwd(x, scale, cos, sin, y, rstd, R, H, s0, s1, eps, D: tl.constexpr, ROT: tl.constexpr,
                     BR: tl.constexpr, BD: tl.constexpr):
    # Row r is head r % H of token r // H, at (r // H) * s0 + (r % H) * s1; y is contiguous.
    rows, cols, m_r, m = _row_tile(R, D, BR, BD)
    token = rows // H
    start = token * s0 + (rows % H) * s1
    xs = tl.load(x + start[:, None] + cols[None, :], mask=m, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(xs * xs, axis=1) / D + eps)
    w = tl.load(scale + cols, mask=cols < D, other=0.0).to(tl.float32)
    normed = xs * r[:, None] * w[None, :]
    # The first ROT channels turn: channel j < ROT/2 pairs with j + ROT/2, y_j = n_j cos - n_pair sin,
    # and y_pair = n_pair cos + n_j sin (the tables repeat each frequency in both halves).
    turning = cols < ROT
    pair = tl.where(cols < ROT // 2, cols + ROT // 2, cols - ROT // 2)
    m_turn = m_r[:, None] & turning[None, :]
    partner = tl.load(x + start[:, None] + pair[None, :], mask=m_turn, other=0.0).to(tl.float32)
    partner = partner * r[:, None] * tl.load(scale + pair, mask=turning, other=0.0).to(tl.float32)[None, :]
    at = token[:, None] * ROT + cols[None, :]
    c = tl.load(cos + at, mask=m_turn, other=1.0).to(tl.float32)
    s = tl.load(sin + at, mask=m_turn, other=0.0).to(tl.float32)
    sign = tl.where(cols < ROT // 2, -1.0, 1.0)
    out = tl.where(turning[None, :], normed * c + sign[None, :] * partner * s, normed)
    tl.store(y + rows[:, None] * D + cols[None, :], out.to(y.dtype.element_ty), mask=m)
    tl.store(rstd + rows, r, mask=m_r)


class NormRotate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale, cos, sin, eps):
        if x.stride(-1) != 1:
            x = x.contiguous()
        total, heads, width = x.shape
        rows = total * heads
        y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
        cos, sin = cos.contiguous(), sin.contiguous()
        block, per_program, warps = _norm_launch(width)
        with _on(x.device):
            _norm_rotate_fwd[(triton.cdiv(rows, per_program),)](x, scale, cos, sin, y, rstd, rows, heads, x.stride(0),
                                                                x.stride(1), eps, width, cos.shape[-1], per_program,
                                                                block, num_warps=warps)
        ctx.save_for_backward(x, scale, cos, sin, rstd)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x, scale, cos, sin, rstd = ctx.saved_tensors
        # Undo the turn (its transpose), then the norm's gradient.
        half = cos.shape[-1] // 2
        c, s = cos[:, None, :half].float(), sin[:, None, :half].float()
        first, second, rest = dy.float().split([half, half, dy.shape[-1] - 2 * half], dim=-1)
        dnormed = torch.cat([first * c + second * s, second * c - first * s, rest], dim=-1)
        dx, dscale = _rms_norm_grads(x, scale, rstd, dnormed, ctx.needs_input_grad[1])
        return dx, dscale, None, None, None


def norm_rotate(x: torch.Tensor, scale: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * scale over the last axis, then its first R channels turned by the rotary
    tables, in float32, returned in x's dtype (contiguous).

    Args:
        x: [T, H, D] (any strides with unit stride along D); scale: [D].
        cos, sin: [T, R] rotary tables, each frequency in both halves (R even, at most D), as
            `decoder.rotary_tables` makes them: the backward reads the first half only.
    """
    if x.dim() != 3 or scale.shape != x.shape[-1:]:
        raise ValueError(f"norm_rotate: x {tuple(x.shape)} must be [T, H, D] with a scale of D, got "
                         f"{tuple(scale.shape)}")
    if cos.shape != sin.shape or cos.shape[0] != x.shape[0] or cos.shape[-1] % 2 or cos.shape[-1] > x.shape[-1]:
        raise ValueError(f"norm_rotate: tables cos {tuple(cos.shape)} and sin {tuple(sin.shape)} do not fit x "
                         f"{tuple(x.shape)}")
    return NormRotate.apply(x, scale.contiguous(), cos, sin, eps)


BLOCK = 1024  # elements per SwiGLU program


@triton.jit
def _swiglu_fwd(gate, up, y, N, width, sg, su, BN: tl.constexpr):
    # Element e of the [N / width, width] output is row e // width, column e % width; gate and up
    # rows are read with their own strides (two column blocks of one projection output, in place).
    offsets = tl.program_id(0).to(tl.int64) * BN + tl.arange(0, BN)
    m = offsets < N
    row, col = offsets // width, offsets % width
    g = tl.load(gate + row * sg + col, mask=m, other=0.0).to(tl.float32)
    u = tl.load(up + row * su + col, mask=m, other=0.0).to(tl.float32)
    tl.store(y + offsets, (g * tl.sigmoid(g) * u).to(y.dtype.element_ty), mask=m)


@triton.jit
def _swiglu_bwd(gate, up, dy, dgate, dup, N, BN: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BN + tl.arange(0, BN)
    m = offsets < N
    g = tl.load(gate + offsets, mask=m, other=0.0).to(tl.float32)
    u = tl.load(up + offsets, mask=m, other=0.0).to(tl.float32)
    d = tl.load(dy + offsets, mask=m, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    tl.store(dup + offsets, (d * g * sig).to(dup.dtype.element_ty), mask=m)
    tl.store(dgate + offsets, (d * u * sig * (1.0 + g * (1.0 - sig))).to(dgate.dtype.element_ty), mask=m)


class SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        (gate, gate_stride), (up, up_stride) = _even_rows(gate), _even_rows(up)
        y = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
        count, width = gate.numel(), gate.shape[-1]
        with _on(gate.device):
            _swiglu_fwd[(triton.cdiv(count, BLOCK),)](gate, up, y, count, width, gate_stride, up_stride, BLOCK)
        ctx.save_for_backward(gate, up)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        gate, up = (x.contiguous() for x in ctx.saved_tensors)  # a copy only for column blocks
        dy = dy.contiguous()
        dgate, dup = torch.empty_like(gate), torch.empty_like(up)
        count = gate.numel()
        with _on(gate.device):
            _swiglu_bwd[(triton.cdiv(count, BLOCK),)](gate, up, dy, dgate, dup, count, BLOCK)
        return dgate, dup


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, computed in float32, returned in gate's dtype. gate, up: one shape."""
    if gate.shape != up.shape:
        raise ValueError(f"swiglu: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ (no broadcasting)")
    return SwiGLU.apply(gate, up)


@triton.jit
def _rms_norm_gated_fwd(x, gate, weight, y, rstd, R, eps, GB, gs0, gs1, D: tl.constexpr, BR: tl.constexpr,
                        BD: tl.constexpr):
    # Row r of the gate lies at (r // GB) * gs0 + (r % GB) * gs1 (a column block of a wider
    # projection output is read in place); x and y are contiguous.
    rows, cols, m_r, m = _row_tile(R, D, BR, BD)
    offsets = rows[:, None] * D + cols[None, :]
    xs = tl.load(x + offsets, mask=m, other=0.0).to(tl.float32)
    gate_start = (rows // GB) * gs0 + (rows % GB) * gs1
    zs = tl.load(gate + gate_start[:, None] + cols[None, :], mask=m, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(xs * xs, axis=1) / D + eps)
    w = tl.load(weight + cols, mask=cols < D, other=0.0).to(tl.float32)
    out = xs * r[:, None] * w[None, :] * (zs * tl.sigmoid(zs))
    tl.store(y + offsets, out.to(y.dtype.element_ty), mask=m)
    tl.store(rstd + rows, r, mask=m_r)


@triton.jit
def _rms_norm_gated_bwd(x, gate, weight, rstd, dy, dx, dgate, R, D: tl.constexpr, BR: tl.constexpr,
                        BD: tl.constexpr):
    rows, cols, m_r, m = _row_tile(R, D, BR, BD)
    offsets = rows[:, None] * D + cols[None, :]
    xs = tl.load(x + offsets, mask=m, other=0.0).to(tl.float32)
    zs = tl.load(gate + offsets, mask=m, other=0.0).to(tl.float32)
    d = tl.load(dy + offsets, mask=m, other=0.0).to(tl.float32)
    r = tl.load(rstd + rows, mask=m_r, other=0.0)
    w = tl.load(weight + cols, mask=cols < D, other=0.0).to(tl.float32)
    sig = tl.sigmoid(zs)
    normed = xs * r[:, None]
    # y = n w silu(z): the gradient of n is dy w silu(z), then through the norm as in RMSNorm.
    grad_x = _norm_grad(d * w[None, :] * (zs * sig), normed, r, D)
    grad_z = d * normed * w[None, :] * sig * (1.0 + zs * (1.0 - sig))
    tl.store(dx + offsets, grad_x.to(dx.dtype.element_ty), mask=m)
    tl.store(dgate + offsets, grad_z.to(dgate.dtype.element_ty), mask=m)


class RMSNormGated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gate, weight, eps):
        x = x.contiguous()
        gate, (_, inner, s0, s1) = _rows_layout(gate)
        width = x.shape[-1]
        rows = x.numel() // max(width, 1)
        y = torch.empty_like(x)
        rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
        block, per_program, warps = _norm_launch(width)
        with _on(x.device):
            _rms_norm_gated_fwd[(triton.cdiv(rows, per_program),)](x, gate, weight, y, rstd, rows, eps, inner, s0, s1,
                                                                   width, per_program, block, num_warps=warps)
        ctx.save_for_backward(x, gate, weight, rstd)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x, gate, weight, rstd = ctx.saved_tensors
        gate = gate.contiguous()  # the backward reads it packed (a copy only for a column block)
        width = x.shape[-1]
        rows = x.numel() // max(width, 1)
        dy = dy.contiguous()
        dx, dgate = torch.empty_like(x), torch.empty_like(gate)
        block, per_program, warps = _norm_launch(width)
        with _on(x.device):
            _rms_norm_gated_bwd[(triton.cdiv(rows, per_program),)](x, gate, weight, rstd, dy, dx, dgate, rows, width,
                                                                   per_program, block, num_warps=warps)
        dweight = None
        if ctx.needs_input_grad[2]:  # frozen in the recipe: plain PyTorch when it is not
            normed = x.float().reshape(rows, width) * rstd[:, None]
            silu = torch.nn.functional.silu(gate.float().reshape(rows, width))
            dweight = (dy.float().reshape(rows, width) * normed * silu).sum(0).to(weight.dtype)
        return dx, dgate, dweight, None


def rms_norm_gated(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * weight * silu(gate) over the last axis, in float32, returned in x's dtype.
    x, gate: [..., D] of one shape; weight: [D]."""
    if gate.shape != x.shape or weight.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm_gated: gate {tuple(gate.shape)} and weight {tuple(weight.shape)} do not match "
                         f"x {tuple(x.shape)}")
    return RMSNormGated.apply(x, gate, weight.contiguous(), eps)
