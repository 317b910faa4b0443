"""The delta rule of short rows continuing forked prefix states: one forward-only Triton kernel (CUDA).

`delta_rule_rows` runs rows of up to ROW_TOKENS tokens in one kernel, reading each prefix's
state in place through the row's parent index.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_common import REQUEST_STATES, _even_rows, _on
from .parts import (
    PART,
    ROW_WARPS,
    VALUES,
    _decayed,
    _last,
    _output,
    _parent_state,
    _part_output,
    _part_values,
    _row_part,
    _sequence_program,
    _store_part,
)

# -- the delta rule of short rows continuing forked states -----------------------------------------
#
# A request's question rows continue one shared prefix and are short (the 50-question request's
# rows hold 28 to 44 tokens of their own). Run through FLA's chunked kernels, each row first gets
# its own copy of its prefix's [HV, K, V] float32 state (1 MB a row on Qwen3.5-0.8B), then five
# kernels pass the row's one chunk through memory between them. `delta_rule_rows` does a whole row
# (up to 64 tokens) in one program per value head and block of values, reading the state through
# the row's parent index: the chunk form of the recurrence (see
# `naive.gated_delta_rule_chunked`) as a block-triangular solve of four 16-token parts.

ROW_TOKENS = 64  # the longest row `delta_rule_rows` takes (four parts)


@triton.jit(do_not_specialize=REQUEST_STATES)
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
def _coupling(k_i, g_i, b_i, k_j, g_j, u_j, BC: tl.constexpr):
    """A_ij U_j for an earlier part j: [BC, BV]."""
    return tl.dot(b_i[:, None] * _decayed(tl.dot(k_i, tl.trans(k_j)), g_i, g_j, False, True, BC), u_j)


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
