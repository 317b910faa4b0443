"""The delta rule of whole sequences of any length: one forward-only Triton kernel (CUDA).

`delta_rule_scan` runs packed sequences from zero or forked states, so inference needs no FLA
call; `backward` adds its gradient for training.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_common import _even_rows, _on
from .parts import (
    PART,
    ROW_WARPS,
    VALUES,
    _last,
    _output,
    _parent_state,
    _part_output,
    _part_values,
    _row_part,
    _sequence_program,
    _store_part,
)

# -- the delta rule of whole sequences, forward only -----------------------------------------------
#
# At inference the prefixes (and rows longer than ROW_TOKENS) went through FLA's chunked
# kernels, whose Python wrappers cost 0.3 to 2.3 ms of host time a call: in a request met for
# the first time, which runs eagerly, that was most of its latency (docs/changelog.md).
# `delta_rule_scan` runs a sequence in one program per value head and block of values, walking
# it in 16-token parts with the state [K, BV] in registers: each part is the chunk form of
# `naive.gated_delta_rule_chunked` at chunk size 16 (the same products as a part of
# `delta_rule_rows`), then the state moves past it. One launch a layer, whatever the number of
# sequences; the parts of a sequence run one after another, so a long sequence alone keeps
# few programs busy, and SCAN_TOKENS bounds the sequences it takes.

SCAN_TOKENS = 2048  # the longest sequence `kernels` sends to `delta_rule_scan`


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
