"""The gated delta rule with its gradient, in our own Triton kernels (CUDA; the CPU under
Triton's interpreter in the tests).

Training ran the delta rule through FLA's chunked kernels, whose Python wrappers cost about 1
ms of host time a forward and 2.3 ms a backward on the GPU machine, twice a layer (the shared
prefixes, then the rows continuing them): 36 forwards and 36 backwards a training update,
which is host-bound (docs/design.md). Here the forward is `scan.delta_rule_scan`, one
launch, and the backward one more: a program per sequence, value head and block of values
first walks the sequence forward to keep the state at the start of each 16-token part (in a
scratch buffer, freed after the call: nothing is kept between the passes but the inputs), then
walks the parts in reverse, carrying the state's gradient, and differentiates each part's
chunk form (`naive.gated_delta_rule_chunked` at chunk size 16) by hand.

Gradients reach q, k, v, the raw gate input, beta and the initial states (so a row's gradient
flows into the prefix state it continues, through `parents`); A_log and dt_bias are frozen
base weights and take none (`kernels` routes a case where they would to FLA). The products run
on float32 tiles, which Triton multiplies in TF32 on CUDA: on the H200 the gradients are within
2% of the float32 recurrence's and of FLA's (tests/ops/test_kernels.py); the interpreter
multiplies in full float32 (1e-5). No second derivative.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_common import _on
from .parts import PART, ROW_WARPS, _decayed, _last, _parent_state, _sequence_program, _unit_lower_inverse
from .scan import delta_rule_scan

GRAD_VALUES = 32  # values a backward program (a block of V): two [K, BV] float32 states in registers


@triton.jit
def _part_inputs(q, k, v, a, b, bos, eos, part, i_hk, i_h, A_log, dt_bias, o_k, o_v,
                 H: tl.constexpr, K: tl.constexpr, HV: tl.constexpr, V: tl.constexpr, BC: tl.constexpr):
    """Part `part` of the sequence bos:eos in float32: q, k [BC, BK], v [BC, BV], the log decay g
    [BC], its slope dg/da [BC] and beta [BC], all 0 past the sequence's end."""
    o_t = bos + part * BC + tl.arange(0, BC)
    m_t = o_t < eos
    m_qk = m_t[:, None] & (o_k < K)[None, :]
    b_q = tl.load(q + (o_t[:, None] * H + i_hk) * K + o_k[None, :], mask=m_qk, other=0.0).to(tl.float32)
    b_k = tl.load(k + (o_t[:, None] * H + i_hk) * K + o_k[None, :], mask=m_qk, other=0.0).to(tl.float32)
    b_v = tl.load(v + (o_t[:, None] * HV + i_h) * V + o_v[None, :], mask=m_t[:, None] & (o_v < V)[None, :],
                  other=0.0).to(tl.float32)
    # g = -exp(A_log) softplus(x), x = a + dt_bias (softplus linear past 20, as PyTorch's), so
    # dg/da = -exp(A_log) sigmoid(x).
    x = tl.load(a + o_t * HV + i_h, mask=m_t, other=0.0).to(tl.float32) + dt_bias
    rate = tl.exp(A_log)
    g = tl.where(m_t, -rate * tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0)))), 0.0)
    slope = tl.where(m_t, -rate * tl.sigmoid(x), 0.0)
    beta = tl.load(b + o_t * HV + i_h, mask=m_t, other=0.0).to(tl.float32)
    return b_q, b_k, b_v, g, slope, beta


@triton.jit
def _decays(G, BC: tl.constexpr):
    """exp(G_i - G_j) of cumulative log decays G [BC]: where j <= i (E), and where j < i (F)."""
    E = _decayed(tl.full([BC, BC], 1.0, tl.float32), G, G, True, False, BC)
    o_c = tl.arange(0, BC)
    return E, tl.where(o_c[:, None] > o_c[None, :], E, 0.0)


@triton.jit
def _part_solve(k_i, v_i, G, F, beta, h0, BC: tl.constexpr):
    """A part's chunk form from its start state h0 [BK, BV], cumulative log decays G [BC] and
    their strictly lower decays F (`_decays`): A (beta_i exp(G_i - G_j) k_i . k_j, strictly
    lower), T = (I + A)^-1, the right-hand side R = beta (v - exp(G) k h0) and the
    pseudo-values U = T R."""
    kk = tl.dot(k_i, tl.trans(k_i))
    A = beta[:, None] * kk * F
    T = _unit_lower_inverse(A, BC)
    P = tl.dot(k_i, h0)
    R = beta[:, None] * (v_i - tl.exp(G)[:, None] * P)
    return kk, A, T, P, R, tl.dot(T, R)


@triton.jit
def _delta_scan_bwd(q, k, v, a, b, A_log, dt_bias, states, parents, do, dfinal, scratch, dq, dk, dv, da, db, dinit,
                    cu_seqlens, G, T_total, scale, H: tl.constexpr, K: tl.constexpr, HV: tl.constexpr,
                    V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BC: tl.constexpr, INITIAL: tl.constexpr,
                    INITIAL_GRAD: tl.constexpr, FINAL: tl.constexpr):
    n, i_h, i_hk, bos, eos, o_k, o_v = _sequence_program(cu_seqlens, H, HV, BK, BV)
    i_v = tl.program_id(2)
    m_kv = (o_k < K)[:, None] & (o_v < V)[None, :]
    log_a = tl.load(A_log + i_h).to(tl.float32)
    bias = tl.load(dt_bias + i_h).to(tl.float32)
    parts = tl.cdiv(eos - bos, BC)
    # Scratch slots of this sequence's parts: bos // BC + n onwards never meet the next
    # sequence's (it starts at (bos + length) // BC + n + 1 or later).
    first = bos // BC + n
    o_c = tl.arange(0, BC)

    # Forward: keep the state at the start of each part.
    h = tl.zeros([BK, BV], dtype=tl.float32)
    if INITIAL:
        h = _parent_state(states, parents, n, i_h, G, o_k, o_v, K, HV, V, BK)
    for part in range(0, parts):
        tl.store(scratch + (((first + part) * HV + i_h) * K + o_k[:, None]) * V + o_v[None, :], h, mask=m_kv)
        q_i, k_i, v_i, g_i, _, b_i = _part_inputs(q, k, v, a, b, bos, eos, part, i_hk, i_h, log_a, bias, o_k, o_v,
                                                  H, K, HV, V, BC)
        g_i = tl.cumsum(g_i, 0)
        _, f = _decays(g_i, BC)
        _, _, _, _, _, u_i = _part_solve(k_i, v_i, g_i, f, b_i, h, BC)
        last = _last(g_i, BC)
        h = h * tl.exp(last) + tl.dot(tl.trans(k_i), u_i * tl.exp(last - g_i)[:, None])
    tl.debug_barrier()  # the scratch states are read back by other threads of this program

    # Backward, part by part from the last, carrying dh (the gradient at the part's end state).
    dh = tl.zeros([BK, BV], dtype=tl.float32)
    if FINAL:
        dh = tl.load(dfinal + ((n * HV + i_h) * K + o_k[:, None]) * V + o_v[None, :], mask=m_kv, other=0.0)
    for step in range(0, parts):
        part = parts - 1 - step
        h0 = tl.load(scratch + (((first + part) * HV + i_h) * K + o_k[:, None]) * V + o_v[None, :], mask=m_kv,
                     other=0.0)
        q_i, k_i, v_i, g_i, slope, b_i = _part_inputs(q, k, v, a, b, bos, eos, part, i_hk, i_h, log_a, bias, o_k,
                                                      o_v, H, K, HV, V, BC)
        o_t = bos + part * BC + o_c
        m_t = o_t < eos
        G_i = tl.cumsum(g_i, 0)
        w = tl.exp(G_i)
        last = _last(G_i, BC)
        tail = tl.exp(last - G_i)
        e, f = _decays(G_i, BC)
        kk, A, T, P, R, U = _part_solve(k_i, v_i, G_i, f, b_i, h0, BC)
        D = tl.dot(q_i, tl.trans(k_i)) * e  # (q_i . k_j) exp(G_i - G_j), j <= i
        # o = scale (exp(G) q h0 + D U); end state = exp(last) h0 + k^T (tail U).
        d_o = scale * tl.load(do + (o_t[:, None] * HV + i_h) * V + o_v[None, :], mask=m_t[:, None] & (o_v < V)[None, :],
                              other=0.0).to(tl.float32)
        k_dh = tl.dot(k_i, dh)
        d_u = tl.dot(tl.trans(D), d_o) + tail[:, None] * k_dh
        d_r = tl.dot(tl.trans(T), d_u)
        d_a = tl.where(o_c[:, None] > o_c[None, :], -tl.dot(d_r, tl.trans(U)), 0.0)
        d_d = tl.where(o_c[:, None] >= o_c[None, :], tl.dot(d_o, tl.trans(U)), 0.0)
        d_p = -(b_i * w)[:, None] * d_r
        w_do = w[:, None] * d_o
        # Through D = (q k^T) * E and A = beta (k k^T) * F, with E and F the decays.
        d_qk = d_d * e
        d_kk = b_i[:, None] * d_a * f
        d_q = tl.dot(w_do, tl.trans(h0)) + tl.dot(d_qk, k_i)
        d_k = (tl.dot(tail[:, None] * U, tl.trans(dh)) + tl.dot(d_p, tl.trans(h0)) + tl.dot(tl.trans(d_qk), q_i)
               + tl.dot(d_kk + tl.trans(d_kk), k_i))
        d_v = b_i[:, None] * d_r
        z = d_a * f * kk  # dA * A / beta, row by row
        d_beta = tl.sum(d_r * (v_i - w[:, None] * P), 1) + tl.sum(z, 1)
        # The cumulative log decays: through exp(G) (in o and R), tail, exp(last), E and F.
        d_w = tl.sum(d_o * tl.dot(q_i, h0), 1) - b_i * tl.sum(d_r * P, 1)
        d_tail = tl.sum(U * k_dh, 1)
        x = d_d * D
        y = b_i[:, None] * z
        d_G = d_w * w - d_tail * tail + tl.sum(x, 1) - tl.sum(x, 0) + tl.sum(y, 1) - tl.sum(y, 0)
        d_last = tl.sum(d_tail * tail, 0) + tl.exp(last) * tl.sum(tl.sum(dh * h0, 1), 0)
        d_G = d_G + tl.where(o_c == BC - 1, d_last, 0.0)
        d_g = tl.cumsum(d_G, 0, reverse=True)  # G is the running sum of g
        dh = tl.exp(last) * dh + tl.dot(tl.trans(q_i), w_do) + tl.dot(tl.trans(k_i), d_p)
        # Partial sums over this block of values, added up over the blocks after the kernel.
        m_qk = m_t[:, None] & (o_k < K)[None, :]
        at = (i_v * T_total + o_t) * HV + i_h
        tl.store(dq + at[:, None] * K + o_k[None, :], d_q, mask=m_qk)
        tl.store(dk + at[:, None] * K + o_k[None, :], d_k, mask=m_qk)
        tl.store(da + at, d_g * slope, mask=m_t)
        tl.store(db + at, d_beta, mask=m_t)
        tl.store(dv + (o_t[:, None] * HV + i_h) * V + o_v[None, :], d_v.to(dv.dtype.element_ty),
                 mask=m_t[:, None] & (o_v < V)[None, :])
    if INITIAL_GRAD:
        tl.store(dinit + ((n * HV + i_h) * K + o_k[:, None]) * V + o_v[None, :], dh, mask=m_kv)


def delta_rule_scan_grad(q, k, v, g, beta, states, parents, cu_seqlens, d_out, d_final, A_log, dt_bias,
                         scale: float | None = None, state_grad: bool = True):
    """Gradients of `delta_rule_scan`'s outputs (o and, with `d_final`, the final states).

    Args:
        q, k, v, g, beta, states, parents, cu_seqlens, A_log, dt_bias, scale: as the forward's.
        d_out: [T, HV, V] the gradient at o; d_final: [N, HV, K, V] at the final states, or None.
            The sequences must cover all T tokens (cu_seqlens[-1] = T), as the forward's do: a
            token outside them gets no gradient written.
        state_grad: compute d_states (with states).

    Returns:
        (dq, dk [T, H, K], dv [T, HV, V], dg, dbeta [T, HV], each in its input's dtype, and
        d_states [G, HV, K, V] float32, the sum over each state's rows, or None without states
        or `state_grad`)
    """
    total, heads, key_dim = q.shape
    value_heads, value_dim = v.shape[1:]
    sequences = cu_seqlens.shape[0] - 1
    q, k, v, g, beta, d_out = (x.contiguous() for x in (q, k, v, g, beta, d_out))
    block_k = max(16, triton.next_power_of_2(key_dim))
    block_v = max(16, min(GRAD_VALUES, triton.next_power_of_2(value_dim)))
    blocks = triton.cdiv(value_dim, block_v)
    wide = torch.float32
    scratch = q.new_empty(total // PART + sequences + 1, value_heads, key_dim, value_dim, dtype=wide)
    d_q = q.new_empty(blocks, total, value_heads, key_dim, dtype=wide)
    d_k = torch.empty_like(d_q)
    d_g = q.new_empty(blocks, total, value_heads, dtype=wide)
    d_beta = torch.empty_like(d_g)
    d_v = torch.empty_like(v)
    state_grad = state_grad and states is not None
    d_init = q.new_empty(sequences, value_heads, key_dim, value_dim, dtype=wide) if state_grad else d_g
    grid = (sequences, value_heads, blocks)
    with _on(q.device):
        _delta_scan_bwd[grid](q, k, v, g, beta, A_log, dt_bias, states.contiguous() if states is not None else d_g,
                              parents if parents is not None else cu_seqlens, d_out,
                              d_final.contiguous() if d_final is not None else d_g, scratch, d_q, d_k, d_v, d_g,
                              d_beta, d_init, cu_seqlens, 0 if states is None else states.shape[0], total,
                              key_dim**-0.5 if scale is None else scale, heads, key_dim, value_heads, value_dim,
                              block_k, block_v, PART, states is not None, state_grad, d_final is not None,
                              num_warps=ROW_WARPS)
    group = value_heads // heads
    d_q = d_q.sum(0).view(total, heads, group, key_dim).sum(2).to(q.dtype)
    d_k = d_k.sum(0).view(total, heads, group, key_dim).sum(2).to(k.dtype)
    d_states = None
    if state_grad:
        # A row without a parent (-1) started from zeros: its gradient goes nowhere.
        has = (parents >= 0).to(wide).view(-1, 1, 1, 1)
        d_states = torch.zeros_like(states, dtype=wide).index_add_(0, parents.clamp_min(0).long(), d_init * has)
    return d_q, d_k, d_v, d_g.sum(0).to(g.dtype), d_beta.sum(0).to(beta.dtype), d_states


class DeltaRuleScan(torch.autograd.Function):
    """`delta_rule_scan` with its gradient (`delta_rule_scan_grad`); A_log and dt_bias frozen."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, states, parents, cu_seqlens, output_final_state, A_log, dt_bias):
        o, final = delta_rule_scan(q, k, v, g, beta, states, parents, cu_seqlens, output_final_state, A_log, dt_bias)
        ctx.save_for_backward(q, k, v, g, beta, states, parents, cu_seqlens, A_log, dt_bias)
        return o, final

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_out, d_final):
        q, k, v, g, beta, states, parents, cu_seqlens, A_log, dt_bias = ctx.saved_tensors
        if d_out is None:
            d_out = torch.zeros_like(v)
        d_q, d_k, d_v, d_g, d_beta, d_states = delta_rule_scan_grad(q, k, v, g, beta, states, parents, cu_seqlens,
                                                                    d_out, d_final, A_log, dt_bias,
                                                                    state_grad=ctx.needs_input_grad[5])
        return d_q, d_k, d_v, d_g, d_beta, d_states, None, None, None, None, None


def delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               states: torch.Tensor | None, parents: torch.Tensor | None, cu_seqlens: torch.Tensor,
               output_final_state: bool, A_log: torch.Tensor, dt_bias: torch.Tensor):
    """`delta_rule_scan` (same arguments and returns) with gradients for q, k, v, g, beta and
    states.

    Raises:
        ValueError: A_log or dt_bias would take a gradient.
    """
    if A_log.requires_grad or dt_bias.requires_grad:
        raise ValueError("delta_rule: A_log and dt_bias must be frozen (they take no gradient here)")
    return DeltaRuleScan.apply(q, k, v, g, beta, states, parents, cu_seqlens, output_final_state, A_log, dt_bias)
