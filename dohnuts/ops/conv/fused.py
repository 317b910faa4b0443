"""The delta rule's causal convolution fused with its head split, one Triton kernel (CUDA).

`conv_split_heads` runs the delta rule's causal convolution and writes its output straight
into the contiguous, L2-normalised q and k [T, H, K] and the contiguous v [T, HV, V] that
flash-linear-attention's chunked delta rule reads. Done apart (FLA's `causal_conv1d`, then
the split), the convolved channels are written and read again, FLA makes three strided
copies of them, and it L2-normalises q and k in two more passes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..plan import CHUNK, chunk_plan
from ..triton_common import _norm_grad, _on

EPS = 1e-6  # FLA's and Hugging Face's L2-norm epsilon, added to the sum of squares

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
# (2026-11-30, docs/changelog.md). The carried state has since been
# read by a sequence's first block only: 17.6 us a call in the 50-question forward
# (319c0ca in docs/changelog.md).
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
