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
    _beta,
    _decayed,
    _gates,
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
# Tokens a step of the walk: 16 (`_delta_scan_parts`, `_delta_scan_walk`) or 64 (CHUNK: the
# chunk solved whole, `_chunk_inverse` and `_chunk_wu`, then `_chunk_walk` and `_chunk_output`), and
# warps a chunk's inverse. On the H200 (as WALK_VALUES, 2026-12-04; 64-token steps with 16 walk
# values against 16-token ones) 1 x 1,408 tokens 113 against 122 us a layer, 1 x 2,816 200 against
# 236, but 2 x 1,408 192 against 167 and 2 x 2,816 374 against 322: its four launches cost more
# than the shorter walk saves once two sequences walk, so 16 stays the default.
WALK_CHUNK = 16
SOLVE_WARPS = 4
# One long sequence walks alone (a call of one sequence, or a one-row bucket's row with its shorter
# padding and an empty row: `delta_rule_scan`'s `one_long`): there its 64-token steps with
# ALONE_VALUES values a program pay, from ALONE_FROM tokens (None: never) up to ALONE_TO. In a
# one-row bucket the bound is the bucket's, so its shortest rows take them too. Their buffers hold
# about 25 kB a token (the 16-token walk's 13 kB), freed each layer; ALONE_TO keeps longer
# sequences, whose memory the long_context figures measured, on the 16-token walk. On the H200 (as
# WALK_VALUES, 2026-12-05, run 2026-12-05-8cab2b5-segments-prefixes) 1 x 1,408 tokens 113 against
# 122 us a layer, 1 x 2,816 199 against 235; in the model, one-question requests of 2,980 to
# 3,010 tokens on first sight 14.95 against 16.95 ms, of 1,480 to 1,510 9.65 against 9.85 (the
# medians of four, runs 2026-12-05-be076d3-long-alone-1024 and -0).
ALONE_FROM: int | None = 1408  # the shortest length timed
ALONE_TO = 8192  # the longest one-row bucket
ALONE_VALUES = 16
PARTS_BELOW = 4  # sequences from which the one-kernel walk runs instead of parts and walk
# Values a program of the one-kernel walk (a block of V) and its warps. Eight requests of the
# serving mix spend about 40% of their device time in the delta rule, most of it here. On an H100
# (`delta_rule_prefixes --only "one kernel"`, run 2026-12-05-c479fab-h100-fwd-sweep) 64 values and
# 4 warps beat 32 and 4, 32 and 2, 64 and 8, 128 and 8, 16 and 2 on 8 x 1,024 tokens (310 us a
# layer; the next 334) and on the rows of two groups of eight serving-mix requests (684 and 499 us;
# the next 787 and 521); in the model eight requests took 47.7 ms of device time a call against
# 54.5 (32 values) and 55.8 (8 warps; runs 2026-12-05-c479fab-h100-invocations-fwd-values-64,
# -values-32 and -warps-8).
FWD_VALUES = 64
FWD_WARPS = 4


def routes_to_parts(lengths: list[int]) -> bool:
    """Whether a routed call (a bucket's) of sequences of these lengths takes the parts then the
    walk: `_scan_route`'s rule, on the host."""
    long = [length for length in lengths if length > CHUNK]
    return len(long) < PARTS_BELOW


def walks_alone(sequences: int, longest: int, routed: bool) -> bool:
    """Whether a forward-only call of `sequences` sequences, the longest of `longest` tokens (or
    a bound on it), is one long sequence for `delta_rule_scan`'s `one_long`: one sequence, or a
    one-row bucket's row before its shorter padding (`routed`, as a bucket is, but with too few
    sequences to route), of ALONE_FROM to ALONE_TO tokens."""
    return ((sequences == 1 or (routed and sequences < PARTS_BELOW))
            and ALONE_FROM is not None and ALONE_FROM <= longest <= ALONE_TO)


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


@triton.jit
def _lower_block(k_i, k_j, b_i, g_i, g_j):
    """beta_i exp(G_i - G_j) (k_i . k_j) [16, 16], part i after part j (every entry kept)."""
    return b_i[:, None] * _decayed(tl.dot(k_i, tl.trans(k_j)), g_i, g_j, False, False, 16)


@triton.jit
def _ieee(x, y):
    return tl.dot(x, y, input_precision="ieee")


@triton.jit
def _plan_entry(chunks, cu_seqlens, route, i_c, ROUTED: tl.constexpr):
    """(start, eos) of the 64-token chunk at entry i_c of the chunk plan: its first token and its
    sequence's end (the start itself when ROUTED to the one-kernel walk: nothing to do)."""
    n = tl.load(chunks + 2 * i_c).to(tl.int64)
    start = tl.load(cu_seqlens + n).to(tl.int64)
    eos = tl.load(cu_seqlens + n + 1).to(tl.int64)
    if ROUTED:
        eos, _ = _turn(route, True, start, eos)
    return start + tl.load(chunks + 2 * i_c + 1).to(tl.int64) * 64, eos


@triton.jit
def _chunk_rows(start, eos, i_h, i_v, HV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """Offsets of a 64-token chunk from `start` for value head i_h and value block i_v: keys [BK],
    values [BV], the chunk's positions [64], its tokens o_t and which are the sequence's (m_t),
    and their rows [64, 1] of a [T, HV, ...] tensor."""
    o_c = tl.arange(0, 64)
    o_t = start + o_c
    return tl.arange(0, BK), i_v * BV + tl.arange(0, BV), o_c, o_t, o_t < eos, o_t[:, None] * HV + i_h


@triton.jit
def _chunk_inverse(k, a, b, A_log, dt_bias, cu_seqlens, chunks, X, Gc, sa, sb, route, H: tl.constexpr, K: tl.constexpr,
                   HV: tl.constexpr, BK: tl.constexpr, SIGMOID: tl.constexpr, ROUTED: tl.constexpr):
    """(I + A)^-1 of the 64-token chunk named by entry program 0 of the chunk plan, value head
    program 1, with A_ij = beta_i exp(G_i - G_j) k_i . k_j (i > j): X [T, HV, 64] float32 (a
    token's row), and the cumulative log decay from the chunk's start Gc [T, HV]. The chunk's
    four 16-token parts are blocks: each diagonal one inverted apart (`_unit_lower_inverse`),
    those below by block forward substitution, X_ij = -X_ii sum_{j <= m < i} A_im X_mj."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    i_hk = i_h // (HV // H)
    o_k, o_c = tl.arange(0, BK), tl.arange(0, 16)
    start, eos = _plan_entry(chunks, cu_seqlens, route, i_c, ROUTED)
    if start < eos:
        log_a = tl.load(A_log + i_h).to(tl.float32)
        bias = tl.load(dt_bias + i_h).to(tl.float32)
        k0, g0, b0 = _key_part(k, a, b, start, eos, 0, i_hk, i_h, log_a, bias, o_k, sa, sb, H, K, HV, SIGMOID)
        k1, g1, b1 = _key_part(k, a, b, start, eos, 1, i_hk, i_h, log_a, bias, o_k, sa, sb, H, K, HV, SIGMOID)
        k2, g2, b2 = _key_part(k, a, b, start, eos, 2, i_hk, i_h, log_a, bias, o_k, sa, sb, H, K, HV, SIGMOID)
        k3, g3, b3 = _key_part(k, a, b, start, eos, 3, i_hk, i_h, log_a, bias, o_k, sa, sb, H, K, HV, SIGMOID)
        # Cumulative log decays from the chunk's start (0 added past the sequence's end).
        g0 = tl.cumsum(g0, 0)
        g1 = tl.cumsum(g1, 0) + _last(g0, 16)
        g2 = tl.cumsum(g2, 0) + _last(g1, 16)
        g3 = tl.cumsum(g3, 0) + _last(g2, 16)
        x00 = _unit_lower_inverse(b0[:, None] * _decayed(tl.dot(k0, tl.trans(k0)), g0, g0, True, True, 16), 16)
        x11 = _unit_lower_inverse(b1[:, None] * _decayed(tl.dot(k1, tl.trans(k1)), g1, g1, True, True, 16), 16)
        x22 = _unit_lower_inverse(b2[:, None] * _decayed(tl.dot(k2, tl.trans(k2)), g2, g2, True, True, 16), 16)
        x33 = _unit_lower_inverse(b3[:, None] * _decayed(tl.dot(k3, tl.trans(k3)), g3, g3, True, True, 16), 16)
        a10 = _lower_block(k1, k0, b1, g1, g0)
        a20, a21 = _lower_block(k2, k0, b2, g2, g0), _lower_block(k2, k1, b2, g2, g1)
        a30, a31 = _lower_block(k3, k0, b3, g3, g0), _lower_block(k3, k1, b3, g3, g1)
        a32 = _lower_block(k3, k2, b3, g3, g2)
        x10 = -_ieee(x11, _ieee(a10, x00))
        x21 = -_ieee(x22, _ieee(a21, x11))
        x20 = -_ieee(x22, _ieee(a20, x00) + _ieee(a21, x10))
        x32 = -_ieee(x33, _ieee(a32, x22))
        x31 = -_ieee(x33, _ieee(a31, x11) + _ieee(a32, x21))
        x30 = -_ieee(x33, _ieee(a30, x00) + _ieee(a31, x10) + _ieee(a32, x20))
        zero = tl.zeros([16, 16], dtype=tl.float32)
        _store_inverse_rows(X, Gc, start, eos, 0, i_h, o_c, HV, x00, zero, zero, zero, g0)
        _store_inverse_rows(X, Gc, start, eos, 1, i_h, o_c, HV, x10, x11, zero, zero, g1)
        _store_inverse_rows(X, Gc, start, eos, 2, i_h, o_c, HV, x20, x21, x22, zero, g2)
        _store_inverse_rows(X, Gc, start, eos, 3, i_h, o_c, HV, x30, x31, x32, x33, g3)


@triton.jit
def _key_part(k, a, b, start, eos, part: tl.constexpr, i_hk, i_h, log_a, bias, o_k, sa, sb, H: tl.constexpr,
              K: tl.constexpr, HV: tl.constexpr, SIGMOID: tl.constexpr):
    """Part `part` of the chunk from `start`: k [16, BK], the log decay g [16] and beta [16],
    float32 and 0 past the sequence's end (as `parts._row_part`, without q and v)."""
    o_t = start + part * 16 + tl.arange(0, 16)
    m_t = o_t < eos
    b_k = tl.load(k + (o_t[:, None] * H + i_hk) * K + o_k[None, :], mask=m_t[:, None] & (o_k < K)[None, :], other=0.0)
    g, beta = _gates(a, b, o_t, m_t, i_h, log_a, bias, sa, sb, SIGMOID)
    return b_k, g, beta


@triton.jit
def _store_inverse_rows(X, Gc, start, eos, part: tl.constexpr, i_h, o_c, HV: tl.constexpr, x0, x1, x2, x3, g):
    """Part `part`'s rows of the chunk's inverse (x_j: its block against part j) and of Gc."""
    o_t = start + part * 16 + o_c
    m_t = o_t < eos
    row = (o_t[:, None] * HV + i_h) * 64
    tl.store(X + row + o_c[None, :], x0, mask=m_t[:, None])
    tl.store(X + row + 16 + o_c[None, :], x1, mask=m_t[:, None])
    tl.store(X + row + 32 + o_c[None, :], x2, mask=m_t[:, None])
    tl.store(X + row + 48 + o_c[None, :], x3, mask=m_t[:, None])
    tl.store(Gc + o_t * HV + i_h, g, mask=m_t)


@triton.jit
def _chunk_wu(k, v, b, X, Gc, cu_seqlens, chunks, W, U, sb, route, H: tl.constexpr, K: tl.constexpr,
              HV: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, SIGMOID: tl.constexpr,
              ROUTED: tl.constexpr):
    """The chunk's W = X beta exp(G) k [T, HV, K] (k's dtype) and U0 = X beta v [T, HV, V]
    float32 (value block program 2), from `_chunk_inverse`'s X and Gc."""
    i_c, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_hk = i_h // (HV // H)
    start, eos = _plan_entry(chunks, cu_seqlens, route, i_c, ROUTED)
    if start < eos:
        o_k, o_v, o_c, o_t, m_t, row = _chunk_rows(start, eos, i_h, i_v, HV, BK, BV)
        x = tl.load(X + row * 64 + o_c[None, :], mask=m_t[:, None], other=0.0)
        g = tl.load(Gc + o_t * HV + i_h, mask=m_t, other=0.0)
        beta = _beta(b, o_t, m_t, i_h, sb, SIGMOID)
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        v_i = tl.load(v + row * V + o_v[None, :], mask=m_tv, other=0.0)
        tl.store(U + row * V + o_v[None, :], tl.dot(x, beta[:, None] * v_i.to(tl.float32)), mask=m_tv)
        if i_v == 0:
            m_tk = m_t[:, None] & (o_k < K)[None, :]
            k_i = tl.load(k + (o_t[:, None] * H + i_hk) * K + o_k[None, :], mask=m_tk, other=0.0)
            w = tl.dot(x, (beta * tl.exp(g))[:, None] * k_i.to(tl.float32))
            tl.store(W + row * K + o_k[None, :], w.to(W.dtype.element_ty), mask=m_tk)


@triton.jit
def _first_chunk(cu_seqlens, n, BN: tl.constexpr):
    """The chunk plan's first entry of sequence n: the 64-token chunks of the sequences before it."""
    count = tl.zeros([BN], dtype=tl.int64)
    for first in range(0, n, BN):
        o_n = first + tl.arange(0, BN)
        m_n = o_n < n
        length = (tl.load(cu_seqlens + o_n + 1, mask=m_n, other=0) - tl.load(cu_seqlens + o_n, mask=m_n, other=0))
        count += ((length + 63) // 64).to(tl.int64)
    return tl.sum(count, 0)


@triton.jit(do_not_specialize=REQUEST_STATES)
def _chunk_walk(k, W, U, Gc, Hs, states, parents, final, cu_seqlens, G, route, H: tl.constexpr, K: tl.constexpr,
                HV: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, INITIAL: tl.constexpr,
                FINAL: tl.constexpr, ROUTED: tl.constexpr, STAGES: tl.constexpr):
    """The walk at 64-token steps: for each chunk of the sequence, the state entering it to Hs
    [chunks, HV, K, V] (q's dtype, at its plan entry) and its pseudo-values U = U0 - W S in place
    of U0; the final state to `final`. One product a step stands between one state and the next
    (U from S), and one more (S from U): the outputs are `_chunk_output`'s, in parallel."""
    n, i_h, i_hk, bos, eos, o_k, o_v = _sequence_program(cu_seqlens, H, HV, BK, BV)
    m_kv = (o_k < K)[:, None] & (o_v < V)[None, :]
    if ROUTED:
        eos, go = _turn(route, True, bos, eos)
        m_kv = m_kv & (tl.zeros([BK, BV], dtype=tl.int32) + go != 0)
    entry = _first_chunk(cu_seqlens, n, 256)
    o_c = tl.arange(0, 64)
    h = tl.zeros([BK, BV], dtype=tl.float32)
    if INITIAL:
        h = _parent_state(states, parents, n, i_h, G, o_k, o_v, K, HV, V, BK)
    for chunk in tl.range(0, tl.cdiv(eos - bos, 64), num_stages=STAGES):
        o_t = bos + chunk * 64 + o_c
        m_t = o_t < eos
        row = o_t[:, None] * HV + i_h
        m_tk = m_t[:, None] & (o_k < K)[None, :]
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        k_i = tl.load(k + (o_t[:, None] * H + i_hk) * K + o_k[None, :], mask=m_tk, other=0.0)
        w_i = tl.load(W + row * K + o_k[None, :], mask=m_tk, other=0.0)
        u0 = tl.load(U + row * V + o_v[None, :], mask=m_tv, other=0.0)
        g_i = tl.load(Gc + o_t * HV + i_h, mask=m_t, other=0.0)
        last = tl.load(Gc + (tl.minimum(bos + chunk * 64 + 64, eos) - 1) * HV + i_h)  # the chunk's whole decay
        h_in = h.to(k_i.dtype)
        tl.store(Hs + (((entry + chunk) * HV + i_h) * K + o_k[:, None]) * V + o_v[None, :], h_in, mask=m_kv)
        u_i = u0 - tl.dot(w_i, h_in)  # 0 past the end
        tl.store(U + row * V + o_v[None, :], u_i, mask=m_tv)
        # S <- exp(G_last) S + sum_t exp(G_last - G_t) k_t u_t^T
        h = h * tl.exp(last) + tl.dot(tl.trans(k_i), (u_i * tl.exp(last - g_i)[:, None]).to(k_i.dtype))
    if FINAL:
        tl.store(final + ((n * HV + i_h) * K + o_k[:, None]) * V + o_v[None, :], h, mask=m_kv)


@triton.jit
def _chunk_output(q, k, U, Gc, Hs, o, cu_seqlens, chunks, scale, route, H: tl.constexpr, K: tl.constexpr,
                  HV: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, ROUTED: tl.constexpr):
    """The outputs of the 64-token chunk of plan entry program 0, value head program 1 and value
    block program 2: o = scale (P U + exp(G) q S) for the state S entering it (`_chunk_walk`)
    and P = exp(G_i - G_j) q_i . k_j (i >= j)."""
    i_c, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_hk = i_h // (HV // H)
    start, eos = _plan_entry(chunks, cu_seqlens, route, i_c, ROUTED)
    if start < eos:
        o_k, o_v, o_c, o_t, m_t, row = _chunk_rows(start, eos, i_h, i_v, HV, BK, BV)
        m_tk = m_t[:, None] & (o_k < K)[None, :]
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        q_i = tl.load(q + (o_t[:, None] * H + i_hk) * K + o_k[None, :], mask=m_tk, other=0.0)
        k_i = tl.load(k + (o_t[:, None] * H + i_hk) * K + o_k[None, :], mask=m_tk, other=0.0)
        u_i = tl.load(U + row * V + o_v[None, :], mask=m_tv, other=0.0)
        g_i = tl.load(Gc + o_t * HV + i_h, mask=m_t, other=0.0)
        h_in = tl.load(Hs + ((i_c * HV + i_h) * K + o_k[:, None]) * V + o_v[None, :],
                       mask=(o_k < K)[:, None] & (o_v < V)[None, :], other=0.0)
        p_i = _decayed(tl.dot(q_i, tl.trans(k_i)), g_i, g_i, True, False, 64)
        o_i = tl.dot(p_i, u_i) + tl.exp(g_i)[:, None] * tl.dot(q_i, h_in)
        tl.store(o + row * V + o_v[None, :], (o_i * scale).to(o.dtype.element_ty), mask=m_tv)


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
                    chunks: torch.Tensor | None = None, routed: bool = False, one_long: bool = False
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
        one_long: the first sequence is the longest and the others (fewer than PARTS_BELOW)
            are shorter padding, as in a one-row bucket, or there is one sequence: the parts
            then the walk, in 64-token steps of ALONE_VALUES values a program (`walks_alone`
            says when a call is).

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
        block_v = max(16, min(FWD_VALUES, triton.next_power_of_2(value_dim)))
        with _on(q.device):
            _delta_scan_fwd[(sequences, value_heads, triton.cdiv(value_dim, block_v))](
                q, k, v, g, beta, A_log, dt_bias, initial, parents, o, final, cu_seqlens, G, scale, gate_stride,
                beta_stride, route, heads, key_dim, value_heads, value_dim, block_k, block_v, PART, states is not None,
                output_final_state, beta_logits, routed, num_warps=FWD_WARPS)
        if not routed:
            return o, final if output_final_state else None
    block_v = max(16, min(WALK_VALUES, triton.next_power_of_2(value_dim)))
    if chunks is None:
        bounds = cu_seqlens.tolist()
        chunks = chunk_plan([end - begin for begin, end in zip(bounds[:-1], bounds[1:])]).to(q.device)
    if one_long and not routed:
        block_v = max(16, min(ALONE_VALUES, triton.next_power_of_2(value_dim)))
    if WALK_CHUNK == CHUNK or (one_long and not routed):
        return _chunk_path(q, k, v, g, beta, A_log, dt_bias, initial, parents, o, final, cu_seqlens, chunks, G, scale,
                           gate_stride, beta_stride, route, routed, block_k, block_v, beta_logits, states is not None,
                           output_final_state)
    # What the walk reads of each part (`_delta_scan_parts`); a bucket's graph keeps them in its pool.
    w = q.new_empty(total, value_heads, key_dim)
    u = q.new_empty(total, value_heads, value_dim, dtype=torch.float32)
    p = q.new_empty(total, value_heads, PART, dtype=torch.float32)
    decays = q.new_empty(total, value_heads, dtype=torch.float32)
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


def _chunk_path(q, k, v, g, beta, A_log, dt_bias, initial, parents, o, final, cu_seqlens, chunks, G, scale,
                gate_stride, beta_stride, route, routed, block_k, block_v, beta_logits, forked, output_final_state):
    """`delta_rule_scan`'s parts-then-walk path at 64-token steps (WALK_CHUNK): each chunk
    solved apart (`_chunk_inverse`, then `_chunk_wu`), the walk from chunk to chunk keeping each
    one's entering state (`_chunk_walk`), then every chunk's outputs at once (`_chunk_output`)."""
    total, heads, key_dim = q.shape
    value_heads, value_dim = v.shape[1:]
    sequences, entries = cu_seqlens.shape[0] - 1, chunks.shape[0]
    w = q.new_empty(total, value_heads, key_dim)
    u = q.new_empty(total, value_heads, value_dim, dtype=torch.float32)
    inverse = q.new_empty(total, value_heads, CHUNK, dtype=torch.float32)
    decays = q.new_empty(total, value_heads, dtype=torch.float32)
    entering = q.new_empty(max(entries, 1), value_heads, key_dim, value_dim)
    out_v = max(16, min(VALUES, triton.next_power_of_2(value_dim)))
    with _on(q.device):
        if entries:
            _chunk_inverse[(entries, value_heads)](
                k, g, beta, A_log, dt_bias, cu_seqlens, chunks, inverse, decays, gate_stride, beta_stride, route, heads,
                key_dim, value_heads, block_k, beta_logits, routed, num_warps=SOLVE_WARPS)
            _chunk_wu[(entries, value_heads, triton.cdiv(value_dim, out_v))](
                k, v, beta, inverse, decays, cu_seqlens, chunks, w, u, beta_stride, route, heads, key_dim, value_heads,
                value_dim, block_k, out_v, beta_logits, routed, num_warps=ROW_WARPS)
        _chunk_walk[(sequences, value_heads, triton.cdiv(value_dim, block_v))](
            k, w, u, decays, entering, initial, parents, final, cu_seqlens, G, route, heads, key_dim, value_heads,
            value_dim, block_k, block_v, forked, output_final_state, routed, WALK_STAGES, num_warps=WALK_WARPS)
        if entries:
            _chunk_output[(entries, value_heads, triton.cdiv(value_dim, out_v))](
                q, k, u, decays, entering, o, cu_seqlens, chunks, scale, route, heads, key_dim, value_heads, value_dim,
                block_k, out_v, routed, num_warps=ROW_WARPS)
    return o, final if output_final_state else None
