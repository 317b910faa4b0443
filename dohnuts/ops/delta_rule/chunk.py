"""FLA's chunked gated delta rule, first tuned on a batch of the shape that matters for each head shape."""

from __future__ import annotations

import torch

from ..plain import l2norm
from ..plan import chunk_plan, cumulative

# FLA tunes each delta-rule kernel on its first call for a head shape (the autotune key holds the
# head counts and widths, not the number of tokens or sequences) and keeps that choice, in memory
# and in Triton's disk cache, for every later call. Left to chance, the first call may be a
# 64-token prefix, whose choice then serves a batch of 50 rows poorly: on the H200 the
# 50-question request (Qwen3.5-0.8B shape) took 13.9 ms after tuning on its prefix and 11.9 ms
# after tuning on the batch below (FLA's tuning batch, 2026-11-30 in docs/changelog.md). So the
# first fused call of each head shape in a process first runs one packed batch of TUNING_ROWS
# rows of TUNING_LENGTH tokens continuing carried states, the shape of evaluation batches and
# training updates. At inference, rows of up to 64 tokens now run `delta_rule_rows` instead;
# whether another tuning batch would serve the prefixes better is not measured.
TUNING_ROWS, TUNING_LENGTH = 48, 40
_TUNED: set = set()


def chunk_gated_delta_rule_fla(function, q, k, v, g, beta, initial_state, output_final_state, cu_seqlens,
                               use_qk_l2norm_in_kernel, cu_seqlens_cpu, chunk_indices, A_log, dt_bias):
    """`function`, FLA's chunked delta rule, on `kernels.chunk_gated_delta_rule`'s arguments, with
    Qwen3.5's decay computed in the kernel when A_log is given; the first call of a head shape
    runs the tuning batch first (`_tune_delta_rule`)."""
    gate = {} if A_log is None else {"use_gate_in_kernel": True, "A_log": A_log, "dt_bias": dt_bias}
    _tune_delta_rule(function, q, v, gate, use_qk_l2norm_in_kernel)
    return function(
        q, k, v, g, beta, initial_state=initial_state, output_final_state=output_final_state,
        cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, chunk_indices=chunk_indices,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **gate)


def _tune_delta_rule(function, q: torch.Tensor, v: torch.Tensor, gate: dict, normalise: bool):
    """Run `function` (FLA's chunked delta rule) once on the tuning batch, the first time it
    meets q's and v's head shape, dtype and device; not inside a CUDA graph capture."""
    heads, key_dim = q.shape[-2:]
    value_heads, value_dim = v.shape[-2:]
    signature = (heads, key_dim, value_heads, value_dim, q.dtype, v.dtype, q.device)
    if signature in _TUNED or (q.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    _TUNED.add(signature)
    total = TUNING_ROWS * TUNING_LENGTH
    generator = torch.Generator(device=q.device).manual_seed(0)  # the global generator stays untouched

    def rand(*shape, dtype=q.dtype):
        return torch.randn(*shape, generator=generator, device=q.device, dtype=torch.float32).to(dtype)

    lengths = [TUNING_LENGTH] * TUNING_ROWS
    bounds, plan = cumulative(lengths), chunk_plan(lengths)
    with torch.no_grad():
        query, key = l2norm(rand(1, total, heads, key_dim)), l2norm(rand(1, total, heads, key_dim))
        extra = {name: torch.zeros_like(value) if torch.is_tensor(value) else value for name, value in gate.items()}
        function(query, key, rand(1, total, value_heads, value_dim, dtype=v.dtype),
                 -torch.rand(1, total, value_heads, generator=generator, device=q.device).to(q.dtype),
                 torch.rand(1, total, value_heads, generator=generator, device=q.device).to(q.dtype),
                 initial_state=rand(TUNING_ROWS, value_heads, key_dim, value_dim, dtype=torch.float32),
                 output_final_state=False, cu_seqlens=bounds.to(q.device), cu_seqlens_cpu=bounds,
                 chunk_indices=plan.to(q.device), use_qk_l2norm_in_kernel=normalise, **extra)
