"""The delta rule of whole sequences of any length: forward-only Triton kernels (CUDA).

`delta_rule_scan` runs packed sequences from zero or forked states, so inference needs no FLA
call; `backward` adds its gradient for training.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..plan import CHUNK, chunk_plan
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
    _unit_lower_inverse,
)

# -- the delta rule of whole sequences, forward only -----------------------------------------------
#
# At inference the prefixes (and rows longer than ROW_TOKENS) went through FLA's chunked
# kernels, whose Python wrappers cost 0.3 to 2.3 ms of host time a call: in a request met for
# the first time, which runs eagerly, that was most of its latency (docs/changelog.md).
# `delta_rule_scan` runs a sequence in 16-token parts, each the chunk form of
# `naive.gated_delta_rule_chunked` at chunk size 16 (the same products as a part of
# `delta_rule_rows`), in two launches a layer whatever the number of sequences:
# - `_delta_scan_parts`, one program per part (PARTS_A_PROGRAM) of each 64-token chunk of the
#   chunk plan and value head, all at once: what of a part does not depend on the state entering
#   it. With A = (I + beta exp(G_i - G_j) k_i . k_j)^-1 over a part (strictly lower), its pseudo-values
#   are U = U0 - W S for the entering state S, U0 = A beta v and W = A beta exp(G) k; and
#   P = exp(G_i - G_j) q_i . k_j (lower) gives its outputs o = scale (P U + exp(G) q S).
# - `_delta_scan_walk`, one program per sequence, value head and block of values, walking the
#   parts one after another with the state [K, BV] in registers: two products a part stand
#   between one state and the next (U from S, then S from U), where solving the part in the walk
#   put a dozen in series (a long sequence alone keeps few programs busy, so the walk's step is
#   the latency of a long prefix). SCAN_TOKENS bounds the sequences it takes.
# Solving the parts apart pays for one or two long prefixes (1 x 2,048 tokens: 332 -> 200 us a
# layer on the H200; 2 x 1,024: 180 -> 143) but not for more, whose walks already fill the
# device (4 x 1,024: 213 against 205; 8 x 1,024: 385 against 291; `bench.short_rows.
# delta_rule_prefixes`). From PARTS_BELOW sequences on, one kernel, `_delta_scan_fwd`, walks
# them solving each part in the walk. A bucket's graph counts its padding sequences (64 tokens
# at most, `runtime.buckets`; a one-row bucket's three sequences never route) too, so there the
# count cannot choose: routed, `_scan_route` counts the sequences over 64 tokens on the device
# and both paths are launched, the one not chosen doing nothing (`_turn`; a one-question request
# of 1,287 tokens in a bucket of 2,048 row tokens: 213 -> 141 us a layer for its walk).

SCAN_TOKENS = 2048  # the longest sequence whose gradient `kernels` computes with the walk
# The longest sequence a forward-only call (inference) walks; None: any. Beyond it FLA's chunked
# kernels ran, which tune themselves on their first long sequence: on the H200 a first request of
# 1,557 tokens stalled 12.5 s, and 50 s on a cold cache (issue 37). Forward only, the walk's
# buffers grow with the tokens (about 13 kB a token at the Qwen3.5-0.8B shape, freed each layer).
FORWARD_TOKENS: int | None = None
# Values a walking program (a block of V). On the H200 (Qwen3.5-0.8B widths, bf16, parts and walk
# from zero states, `bench.short_rows.delta_rule_prefixes`, 2026-12-04) 32 against 64: 1 x 1,024
# tokens 97 against 102 us a layer, 1 x 2,816 255 against 274, 2 x 2,816 350 against 370.
WALK_VALUES = 32
# The walk's software pipeline (stages of its loop's loads in flight; None: Triton's default) and
# warps a program.
WALK_STAGES: int | None = None
WALK_WARPS = ROW_WARPS
# Parts of a 64-token chunk one `_delta_scan_parts` program solves, one after another (1, 2 or 4).
# One: four times the programs, each solving one part, where a long sequence alone left most of
# the device waiting on programs solving four in turn. On the H200 (as WALK_VALUES, 2026-12-04),
# parts and walk of 1 x 1,408 tokens 123 us a layer against 145 at four a program, 1 x 2,816 239
# against 258, 2 x 2,816 325 against 355.
PARTS_A_PROGRAM = 1
PARTS_BELOW = 4  # sequences from which the one-kernel walk runs instead of parts and walk


@triton.jit
def _turn(route, PARTS: tl.constexpr, bos, eos):
    """(eos, go) for a routed kernel (`_scan_route` wrote `route` [1]) of the parts path (PARTS)
    or the one-kernel walk: its sequence's end, the start when the other path was chosen (so no
    part is walked or stored), and go, 1 when this path was chosen, else 0 (masks its final
    states)."""
    taken = tl.load(route)
    go = taken if PARTS else 1 - taken
    return tl.where(go != 0, eos, bos), go


@triton.jit
def _delta_scan_parts(q, k, v, a, b, A_log, dt_bias, cu_seqlens, chunks, W, U, P, Gc, sa, sb, route,
                      H: tl.constexpr, K: tl.constexpr, HV: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                      BVA: tl.constexpr, BC: tl.constexpr, SPLIT: tl.constexpr, SIGMOID: tl.constexpr,
                      ROUTED: tl.constexpr):
    """SPLIT parts of the 64-token chunk named by entry program 0 of the chunk plan `chunks` [C,
    2] (sequence, chunk), the program 2-th SPLIT of them, of value head program 1: W [T, HV, K] (q's dtype), U0
    [T, HV, V], P [T, HV, BC] and the part's cumulative log decay Gc [T, HV] (float32). Parts
    past the sequence's end (a padded plan's entries name an empty sequence) are skipped, and
    every part when ROUTED and `route` [1] says the one-kernel walk runs (`_scan_route`)."""
    i_c, i_h, i_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_hk = i_h // (HV // H)
    o_k, o_v, o_c = tl.arange(0, BK), tl.arange(0, BVA), tl.arange(0, BC)
    n = tl.load(chunks + 2 * i_c).to(tl.int64)
    chunk = tl.load(chunks + 2 * i_c + 1).to(tl.int64)
    bos = tl.load(cu_seqlens + n).to(tl.int64)
    eos = tl.load(cu_seqlens + n + 1).to(tl.int64)
    if ROUTED:
        eos, _ = _turn(route, True, bos, eos)
    log_a = tl.load(A_log + i_h).to(tl.float32)
    bias = tl.load(dt_bias + i_h).to(tl.float32)
    for split in tl.static_range(SPLIT):
        part = (chunk * tl.num_programs(2) + i_s) * SPLIT + split
        if bos + part * BC < eos:
            q_i, k_i, v_i, g_i, b_i = _row_part(q, k, v, a, b, bos, eos, part, i_hk, i_h, log_a, bias, o_k, o_v,
                                                sa, sb, H, K, HV, V, BC, SIGMOID)
            g_i = tl.cumsum(g_i, 0)  # from the part's start
            solve = _unit_lower_inverse(b_i[:, None] * _decayed(tl.dot(k_i, tl.trans(k_i)), g_i, g_i, True, True, BC),
                                        BC)
            u0 = tl.dot(solve, b_i[:, None] * v_i.to(tl.float32))
            w = tl.dot(solve, (b_i * tl.exp(g_i))[:, None] * k_i.to(tl.float32))
            p = _decayed(tl.dot(q_i, tl.trans(k_i)), g_i, g_i, True, False, BC)
            o_t = bos + part * BC + o_c
            m_t = o_t < eos
            row = o_t[:, None] * HV + i_h
            tl.store(W + row * K + o_k[None, :], w.to(W.dtype.element_ty), mask=m_t[:, None] & (o_k < K)[None, :])
            tl.store(U + row * V + o_v[None, :], u0, mask=m_t[:, None] & (o_v < V)[None, :])
            tl.store(P + row * BC + o_c[None, :], p, mask=m_t[:, None])
            tl.store(Gc + o_t * HV + i_h, g_i, mask=m_t)


@triton.jit(do_not_specialize=REQUEST_STATES)
def _delta_scan_walk(q, k, W, U, P, Gc, states, parents, o, final, cu_seqlens, G, scale, route, H: tl.constexpr,
                     K: tl.constexpr, HV: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                     BC: tl.constexpr, INITIAL: tl.constexpr, FINAL: tl.constexpr, ROUTED: tl.constexpr,
                     STAGES: tl.constexpr):
    n, i_h, i_hk, bos, eos, o_k, o_v = _sequence_program(cu_seqlens, H, HV, BK, BV)
    m_kv = (o_k < K)[:, None] & (o_v < V)[None, :]
    if ROUTED:
        eos, go = _turn(route, True, bos, eos)
        m_kv = m_kv & (tl.zeros([BK, BV], dtype=tl.int32) + go != 0)
    o_c = tl.arange(0, BC)
    h = tl.zeros([BK, BV], dtype=tl.float32)
    if INITIAL:
        h = _parent_state(states, parents, n, i_h, G, o_k, o_v, K, HV, V, BK)
    for part in tl.range(0, tl.cdiv(eos - bos, BC), num_stages=STAGES):
        o_t = bos + part * BC + o_c
        m_t = o_t < eos
        row = o_t[:, None] * HV + i_h
        m_tk = m_t[:, None] & (o_k < K)[None, :]
        q_i = tl.load(q + (o_t[:, None] * H + i_hk) * K + o_k[None, :], mask=m_tk, other=0.0)
        k_i = tl.load(k + (o_t[:, None] * H + i_hk) * K + o_k[None, :], mask=m_tk, other=0.0)
        w_i = tl.load(W + row * K + o_k[None, :], mask=m_tk, other=0.0)
        u0 = tl.load(U + row * V + o_v[None, :], mask=m_t[:, None] & (o_v < V)[None, :], other=0.0)
        p_i = tl.load(P + row * BC + o_c[None, :], mask=m_t[:, None], other=0.0)
        g_i = tl.load(Gc + o_t * HV + i_h, mask=m_t, other=0.0)
        last = tl.load(Gc + (tl.minimum(bos + part * BC + BC, eos) - 1) * HV + i_h)  # the part's whole decay
        h_in = h.to(q_i.dtype)
        u_i = u0 - tl.dot(w_i, h_in)  # 0 past the end
        o_i = tl.dot(p_i, u_i) + tl.exp(g_i)[:, None] * tl.dot(q_i, h_in)
        _store_part(o, o_i * scale, bos, eos, part, i_h, o_v, HV, V, BC)
        # S <- exp(G_last) S + sum_t exp(G_last - G_t) k_t u_t^T
        h = h * tl.exp(last) + tl.dot(tl.trans(k_i), (u_i * tl.exp(last - g_i)[:, None]).to(k_i.dtype))
    if FINAL:
        tl.store(final + ((n * HV + i_h) * K + o_k[:, None]) * V + o_v[None, :], h, mask=m_kv)


@triton.jit(do_not_specialize=REQUEST_STATES)
def _delta_scan_fwd(q, k, v, a, b, A_log, dt_bias, states, parents, o, final, cu_seqlens, G, scale, sa, sb, route,
                    H: tl.constexpr, K: tl.constexpr, HV: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                    BV: tl.constexpr, BC: tl.constexpr, INITIAL: tl.constexpr, FINAL: tl.constexpr,
                    SIGMOID: tl.constexpr, ROUTED: tl.constexpr):
    n, i_h, i_hk, bos, eos, o_k, o_v = _sequence_program(cu_seqlens, H, HV, BK, BV)
    m_kv = (o_k < K)[:, None] & (o_v < V)[None, :]
    if ROUTED:
        eos, go = _turn(route, False, bos, eos)
        m_kv = m_kv & (tl.zeros([BK, BV], dtype=tl.int32) + go != 0)
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


@triton.jit(do_not_specialize=["N"])
def _scan_route(cu_seqlens, route, N, LONG: tl.constexpr, FEW: tl.constexpr, BN: tl.constexpr):
    """route [1] int32: 1 (solve the parts apart, then walk) when fewer than FEW of the N
    sequences are longer than LONG tokens, else 0 (the one-kernel walk); one program."""
    count = tl.zeros([BN], dtype=tl.int32)
    for first in range(0, N, BN):
        o_n = first + tl.arange(0, BN)
        m_n = o_n < N
        length = tl.load(cu_seqlens + o_n + 1, mask=m_n, other=0) - tl.load(cu_seqlens + o_n, mask=m_n, other=0)
        count += (length > LONG).to(tl.int32)
    tl.store(route, (tl.sum(count, 0) < FEW).to(tl.int32))


def delta_rule_scan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    states: torch.Tensor | None, parents: torch.Tensor | None, cu_seqlens: torch.Tensor,
                    output_final_state: bool, A_log: torch.Tensor, dt_bias: torch.Tensor,
                    scale: float | None = None, out: torch.Tensor | None = None, beta_logits: bool = False,
                    chunks: torch.Tensor | None = None, routed: bool = False
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
        chunks: the sequences' 64-token chunk plan on q's device (`plan.chunk_plan`, or a
            bucket's `plan.padded_plan`), or None to make it here (reading cu_seqlens back).
        routed: choose the path on the device (`_scan_route`: the parts then the walk for fewer
            than PARTS_BELOW sequences over 64 tokens, else the one-kernel walk), launching both
            with the other skipping its work: for a bucket's graph, whose count of sequences
            is the padding's, not the request's. Otherwise the count of sequences chooses.

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
    route = cu_seqlens  # any pointer: unread unless routed
    routed = routed and sequences >= PARTS_BELOW  # else no count could pick the one-kernel walk
    if routed:
        route = torch.empty(1, dtype=torch.int32, device=q.device)
        with _on(q.device):
            _scan_route[(1,)](cu_seqlens, route, sequences, CHUNK, PARTS_BELOW, 256)
    G = 0 if states is None else states.shape[0]
    scale = key_dim**-0.5 if scale is None else scale
    parents = parents if parents is not None else cu_seqlens
    if routed or sequences >= PARTS_BELOW:  # static in a graph: fixed by the bucket's sequence count
        block_v = max(16, min(VALUES, triton.next_power_of_2(value_dim)))
        with _on(q.device):
            _delta_scan_fwd[(sequences, value_heads, triton.cdiv(value_dim, block_v))](
                q, k, v, g, beta, A_log, dt_bias, initial, parents, o, final, cu_seqlens, G, scale, gate_stride,
                beta_stride, route, heads, key_dim, value_heads, value_dim, block_k, block_v, PART, states is not None,
                output_final_state, beta_logits, routed, num_warps=ROW_WARPS)
        if not routed:
            return o, final if output_final_state else None
    block_v = max(16, min(WALK_VALUES, triton.next_power_of_2(value_dim)))
    # What the walk reads of each part (`_delta_scan_parts`); a bucket's graph keeps them in its pool.
    w = q.new_empty(total, value_heads, key_dim)
    u = q.new_empty(total, value_heads, value_dim, dtype=torch.float32)
    p = q.new_empty(total, value_heads, PART, dtype=torch.float32)
    decays = q.new_empty(total, value_heads, dtype=torch.float32)
    if chunks is None:
        bounds = cu_seqlens.tolist()
        chunks = chunk_plan([end - begin for begin, end in zip(bounds[:-1], bounds[1:])]).to(q.device)
    with _on(q.device):
        if chunks.shape[0]:
            _delta_scan_parts[(chunks.shape[0], value_heads, CHUNK // PART // PARTS_A_PROGRAM)](
                q, k, v, g, beta, A_log, dt_bias, cu_seqlens, chunks, w, u, p, decays, gate_stride, beta_stride, route,
                heads, key_dim, value_heads, value_dim, block_k, max(16, triton.next_power_of_2(value_dim)), PART,
                PARTS_A_PROGRAM, beta_logits, routed, num_warps=ROW_WARPS)
        _delta_scan_walk[(sequences, value_heads, triton.cdiv(value_dim, block_v))](
            q, k, w, u, p, decays, initial, parents, o, final, cu_seqlens, G, scale, route, heads, key_dim,
            value_heads, value_dim, block_k, block_v, PART, states is not None, output_final_state, routed,
            WALK_STAGES, num_warps=WALK_WARPS)
    return o, final if output_final_state else None
