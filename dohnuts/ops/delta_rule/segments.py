"""The delta rule of a few long sequences, each walked in segments at once (an experiment of
issue 37).

A long sequence alone keeps few of the device's programs busy: `delta_rule_scan` walks its 64-token
chunks one after another (one program per value head and block of values), so its latency is
the walk's. The state a chunk leaves is affine in the state entering it, S' = M S + H, with M
[K, K] (decay and the chunk's projections) and H [K, V] (its values), and so is every pseudo-value
U = U0 - W S. So each sequence is cut into `segments` runs of whole chunks, walked at once, each
from [S0 | I] (its columns of values from S0, the sequence's own state for the first segment and
zero for the others, and K more columns from the identity, whose values are zero): the walk of a
segment then leaves [H | M] for its whole and for every chunk in it, and U_H | U_M for its tokens.
The true state entering segment j is E_j = H_{j-1} + M_{j-1} E_{j-1} (E_0 folded into the walk),
a few products a sequence; every chunk's entering state and every token's pseudo-values are then
fixed at once (H + M E_j, U_H + U_M E_j), and the outputs are `_chunk_output`'s as in
`delta_rule_scan`. The walk's serial steps fall from a sequence's chunks to a segment's, for twice
the columns a step and the fixes.

The runs are planned by tensor ops on the device (`runs_of`, from cu_seqlens and the chunk plan;
`segment_plan` from lengths on the host), so a CUDA graph can hold a call, a bucket's too, whose
lengths vary under one graph. `bench.short_rows.delta_rule_prefixes --segments` times it beside
the scan's paths; the model takes it only where SEGMENTS asks (off until a GPU has timed it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from ..plan import CHUNK, chunk_plan
from ..triton_common import _even_rows, _on
from . import scan
from .parts import ROW_WARPS, VALUES, _output

# Runs a sequence of `kernels.delta_rule`'s forward-only scan is walked in, for fewer than
# `scan.PARTS_BELOW` sequences (which the scan never routes) the longest of which holds
# SEGMENT_FROM tokens or more (a one-row bucket's long row, a long prefix alone); 0 or 1: never
# (the default, until timed).
SEGMENTS = 0
SEGMENT_FROM = 1024


def segment_lengths(lengths: list[int], segments: int) -> list[int]:
    """Each sequence's `segments` runs of whole 64-token chunks (its last the rest; empty runs
    where it has fewer chunks), in order: [sequence 0's runs, sequence 1's, ...]. The reference
    of `runs_of`."""
    runs = []
    for length in lengths:
        step = CHUNK * max(1, -(-length // (CHUNK * segments)))
        runs.extend(max(0, min(step, length - index * step)) for index in range(segments))
    return runs


@dataclass(frozen=True)
class SegmentPlan:
    """The runs of packed sequences walked in segments (`runs_of`), on the device.

    sequences: the sequences; segments: runs a sequence.
    run_cu: [sequences * segments + 1] int32 the runs' cumulative tokens (the walk's sequences).
    chunks: the sequences' own chunk plan (a bucket's padded one too): the runs' chunks are its
        entries, in order.
    tokens: [R, L] each later run's tokens (every run but a sequence's first, sequence by
        sequence), padded with the tokens' count (a spare row); entries: [R, C] their chunk plan
        entries, padded with the plan's count of entries (a spare entry).
    """

    sequences: int
    segments: int
    run_cu: torch.Tensor
    chunks: torch.Tensor
    tokens: torch.Tensor
    entries: torch.Tensor


def runs_of(cu_seqlens: torch.Tensor, chunks: torch.Tensor, segments: int, longest: int, total: int) -> SegmentPlan:
    """The plan of `delta_rule_segmented` made on cu_seqlens' device, reading nothing back, so a
    CUDA graph can hold it: a bucket's sequences vary in length under one graph, and its
    `longest` (a bound on any sequence's tokens) and `total` tokens (the buffers' rows) fix the
    plan's shapes.

    Raises:
        ValueError: fewer than one segment.
    """
    if segments < 1:
        raise ValueError(f"runs_of: segments must be at least 1, not {segments}")
    bounds = cu_seqlens.to(torch.int64)
    lengths = (bounds[1:] - bounds[:-1])[:, None]
    steps = CHUNK * torch.clamp((lengths + CHUNK * segments - 1) // (CHUNK * segments), min=1)
    index = torch.arange(segments + 1, device=bounds.device)[None]
    edges = torch.minimum(index * steps, lengths)  # [N, segments + 1] each run's start in its sequence
    sizes = edges[:, 1:] - edges[:, :-1]
    starts = bounds[:-1, None] + edges[:, :-1]
    run_cu = torch.cat([starts.reshape(-1), bounds[-1:]]).to(torch.int32)
    counts = (sizes + CHUNK - 1) // CHUNK
    firsts = (torch.cumsum(counts.reshape(-1), 0) - counts.reshape(-1)).view_as(counts)
    width = CHUNK * max(1, -(-longest // (CHUNK * segments)))
    later = (slice(None), slice(1, None))
    offsets = torch.arange(width, device=bounds.device)
    tokens = torch.where(offsets < sizes[later].reshape(-1, 1), starts[later].reshape(-1, 1) + offsets, total)
    offsets = torch.arange(width // CHUNK, device=bounds.device)
    entries = torch.where(offsets < counts[later].reshape(-1, 1), firsts[later].reshape(-1, 1) + offsets,
                          chunks.shape[0])
    return SegmentPlan(lengths.shape[0], segments, run_cu, chunks, tokens, entries)


def segment_plan(lengths: list[int], segments: int, device: torch.device | str) -> SegmentPlan:
    """`runs_of` for sequences of `lengths` tokens in `segments` runs, from their chunk plan."""
    bounds = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0).to(torch.int32)
    return runs_of(bounds.to(device), chunk_plan(list(lengths)).to(device), segments, max(lengths, default=0),
                   sum(lengths))


def delta_rule_segmented(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         states: torch.Tensor | None, parents: torch.Tensor | None, cu_seqlens: torch.Tensor,
                         output_final_state: bool, A_log: torch.Tensor, dt_bias: torch.Tensor, plan: SegmentPlan,
                         scale: float | None = None, out: torch.Tensor | None = None, beta_logits: bool = False
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`scan.delta_rule_scan`'s result (its arguments, forward only) with each sequence walked
    in runs at once (the module's docstring), as `plan` (`segment_plan` of the lengths that
    cu_seqlens holds, or `runs_of` them) cuts them; `out` as there. Nothing is read back from the
    device."""
    total, heads, key_dim = q.shape
    value_heads, value_dim = v.shape[1:]
    if value_heads % heads or k.shape != q.shape or g.shape != (total, value_heads) or beta.shape != g.shape:
        raise ValueError(f"delta_rule_segmented: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"g {tuple(g.shape)} and beta {tuple(beta.shape)} do not fit together")
    if (states is None) != (parents is None):
        raise ValueError("delta_rule_segmented: states and parents come together")
    sequences, segments, device = plan.sequences, plan.segments, q.device
    if cu_seqlens.shape != (sequences + 1,):
        raise ValueError(f"delta_rule_segmented: cu_seqlens {tuple(cu_seqlens.shape)} for a plan of {sequences} "
                         "sequences")
    if states is not None and (parents.shape != (sequences,) or states.shape[1:] != (value_heads, key_dim, value_dim)):
        raise ValueError(f"delta_rule_segmented: {sequences} sequences, parents {tuple(parents.shape)}, states "
                         f"{tuple(states.shape)}, for {value_heads} heads of {key_dim} x {value_dim}")
    run_cu, chunks = plan.run_cu, plan.chunks
    q, k, v = (x.contiguous() for x in (q, k, v))
    (g, gate_stride), (beta, beta_stride) = _even_rows(g), _even_rows(beta)
    o = _output(v, out, "delta_rule_segmented")
    scale = key_dim**-0.5 if scale is None else scale
    block_k = max(16, triton.next_power_of_2(key_dim))
    wide = value_dim + key_dim  # the values' columns, then the transition's
    # Every run starts from [S0 | I]: S0 the sequence's own state for its first run (zero without
    # one), zero for the others (the last state below).
    identity = torch.eye(key_dim, device=device, dtype=torch.float32).expand(value_heads, key_dim, key_dim)
    count = 0 if states is None else states.shape[0]
    starts = torch.zeros(count + 1, value_heads, key_dim, wide, device=device, dtype=torch.float32)
    starts[..., value_dim:] = identity
    if states is not None:
        starts[:count, ..., :value_dim] = states
    run_parents = torch.full((sequences, segments), count, dtype=torch.int32, device=device)
    if parents is not None:
        run_parents[:, 0] = torch.where(parents >= 0, parents, count).to(torch.int32)
    run_parents = run_parents.reshape(-1)
    entries = chunks.shape[0]
    w = q.new_empty(total, value_heads, key_dim)
    u = q.new_empty(total, value_heads, value_dim, dtype=torch.float32)
    inverse = q.new_empty(total, value_heads, CHUNK, dtype=torch.float32)
    decays = q.new_empty(total, value_heads, dtype=torch.float32)
    entering = q.new_empty(entries + 1, value_heads, key_dim, wide)  # and a spare entry, the fixes' padding
    entering[entries].zero_()
    final = q.new_empty(sequences * segments, value_heads, key_dim, wide, dtype=torch.float32)
    out_v = max(16, min(VALUES, triton.next_power_of_2(value_dim)))
    walk_v = max(16, min(scan.WALK_VALUES, triton.next_power_of_2(wide)))
    route = cu_seqlens  # unread: nothing routes
    with _on(device):
        if entries:
            scan._chunk_inverse[(entries, value_heads)](
                k, g, beta, A_log, dt_bias, cu_seqlens, chunks, inverse, decays, gate_stride, beta_stride, route, heads,
                key_dim, value_heads, block_k, beta_logits, False, num_warps=scan.SOLVE_WARPS)
            scan._chunk_wu[(entries, value_heads, triton.cdiv(value_dim, out_v))](
                k, v, beta, inverse, decays, cu_seqlens, chunks, w, u, beta_stride, route, heads, key_dim, value_heads,
                value_dim, block_k, out_v, beta_logits, False, num_warps=ROW_WARPS)
        # The transition's columns have no values: their U0 is zero. And a spare row.
        u_wide = u.new_zeros(total + 1, value_heads, wide)
        u_wide[:total, :, :value_dim] = u
        scan._chunk_walk[(sequences * segments, value_heads, triton.cdiv(wide, walk_v))](
            k, w, u_wide, decays, entering, starts, run_parents, final, run_cu, count + 1, route, heads, key_dim,
            value_heads, wide, block_k, walk_v, True, True, False, scan.WALK_STAGES, num_warps=scan.WALK_WARPS)
    # The state entering each later run, E_j = H_{j-1} + M_{j-1} E_{j-1} (the first run's walk began
    # from its own), then the fixes of its chunks' entering states and its tokens' pseudo-values.
    final = final.view(sequences, segments, value_heads, key_dim, wide)
    flat = (sequences * value_heads, key_dim)
    entered = [final[:, 0, ..., :value_dim].reshape(*flat, value_dim)]
    for index in range(1, segments):
        entered.append(torch.baddbmm(final[:, index, ..., :value_dim].reshape(*flat, value_dim),
                                     final[:, index, ..., value_dim:].reshape(*flat, key_dim), entered[-1]))
    entered = [state.view(sequences, value_heads, key_dim, value_dim) for state in entered]
    if segments > 1 and sequences:
        states_in = torch.stack(entered[:-1], 1).view(sequences * (segments - 1), value_heads, key_dim, value_dim)
        states_in = states_in.to(q.dtype)  # the fixes' products in q's dtype
        values, transitions = u_wide[..., :value_dim], u_wide[..., value_dim:]
        fix = torch.einsum("rlhk,rhkv->rlhv", transitions[plan.tokens].to(q.dtype), states_in)
        values.index_put_((plan.tokens,), values[plan.tokens] + fix.float())
        values, transitions = entering[..., :value_dim], entering[..., value_dim:]
        fix = torch.einsum("rchkm,rhmv->rchkv", transitions[plan.entries], states_in)
        values.index_put_((plan.entries,), values[plan.entries] + fix)
    carried = entered[-1]
    u = u_wide[:total, :, :value_dim].contiguous()
    entering = entering[:entries, ..., :value_dim].contiguous()
    with _on(device):
        if entries:
            scan._chunk_output[(entries, value_heads, triton.cdiv(value_dim, out_v))](
                q, k, u, decays, entering, o, cu_seqlens, chunks, scale, route, heads, key_dim, value_heads, value_dim,
                block_k, out_v, False, num_warps=ROW_WARPS)
    return o, carried.contiguous() if output_final_state else None
