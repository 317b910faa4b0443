"""Triton building blocks of the delta rule walked in 16-token parts, shared by `rows`, `scan` and `backward`.

Each part is the chunk form of the recurrence (`naive.gated_delta_rule_chunked`) at chunk
size 16: a block-triangular solve for the pseudo-values, then the outputs and the state.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

PART = 16  # tokens a part
# Values a program (a block of V) and warps a program. For the 50-question request's rows on
# the H200 (Qwen3.5-0.8B widths, bf16; 46f6c73 in docs/changelog.md): 70.5
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
    g, beta = _gates(a, b, o_t, m_t, i_h, A_log, dt_bias, sa, sb, SIGMOID)
    return b_q, b_k, b_v, g, beta


@triton.jit
def _gates(a, b, o_t, m_t, i_h, A_log, dt_bias, sa, sb, SIGMOID: tl.constexpr):
    """The log decay g and beta of tokens o_t of value head i_h, float32, 0 where not m_t (as
    `_row_part` reads them)."""
    # Qwen3.5's decay from the raw gate input: -exp(A_log) softplus(a + dt_bias) (softplus as
    # PyTorch's, linear past 20).
    x = tl.load(a + o_t * sa + i_h, mask=m_t, other=0.0).to(tl.float32) + dt_bias
    g = tl.where(m_t, -tl.exp(A_log) * tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0)))), 0.0)
    return g, _beta(b, o_t, m_t, i_h, sb, SIGMOID)


@triton.jit
def _beta(b, o_t, m_t, i_h, sb, SIGMOID: tl.constexpr):
    """beta of tokens o_t of value head i_h, float32, 0 where not m_t: b itself, or with SIGMOID
    the sigmoid of b."""
    beta = tl.load(b + o_t * sb + i_h, mask=m_t, other=0.0).to(tl.float32)
    if SIGMOID:
        beta = tl.where(m_t, tl.sigmoid(beta), 0.0)
    return beta


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
def _last(g, BC: tl.constexpr):
    """The last entry of g [BC]."""
    return tl.sum(tl.where(tl.arange(0, BC) == BC - 1, g, 0.0), 0)


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


def _output(v: torch.Tensor, out: torch.Tensor | None, name: str) -> torch.Tensor:
    """A delta-rule kernel's output tensor: `out` when given (checked), else a new one like v."""
    if out is None:
        return torch.empty_like(v)
    if out.shape != v.shape or out.dtype != v.dtype or out.device != v.device or not out.is_contiguous():
        raise ValueError(f"{name}: out must be a contiguous {v.dtype} tensor of shape {tuple(v.shape)} on {v.device}, "
                         f"got {out.dtype} {tuple(out.shape)} on {out.device}")
    return out
