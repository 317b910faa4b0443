"""Dispatch: each op runs its fused kernel on CUDA and its plain-PyTorch reference elsewhere.

On CUDA: flash-linear-attention's chunked gated delta rule (`delta_rule.chunk`), our own
Triton kernels (a module a family: `conv.fused`, the delta rule's convolution with its head
split; `merge.fused`, two attention partials merged; `norm.fused`, RMSNorm and its fused
variants; `swiglu.fused`; `delta_rule.rows`,
`delta_rule.scan` and `delta_rule.backward`, the delta rule of short rows continuing forked
states, of whole sequences, and its gradient), and PyTorch's flash varlen attention
(`attention`). `backends` loads them. Each public function chooses the fused kernel for CUDA
tensors when it is importable and otherwise runs the plain-PyTorch reference of the same math
(each family's `naive`), which is also the test oracle for the fused path (FLA keeps a
naive.py beside every kernel for the same reason). Argument names follow FLA.
"""

from __future__ import annotations

import torch

from . import attention as attention_ops
from .attention import (
    _flash_grouped,
    _varlen,
    attention_reference,
    chunked_fork_partials,
    chunked_fork_reference,
    dense_causal,
)
from .backends import _ours, fused, slow_path, slow_paths, uncached_plans
from .conv.naive import conv_split_heads_reference
from .delta_rule.chunk import chunk_gated_delta_rule_fla
from .delta_rule.naive import decay, gated_delta_rule_chunked
from .derived_cache import derived, holding_derived
from .merge.naive import merge_partials_reference
from .norm.naive import (
    add_rms_norm_reference,
    norm_rotate_reference,
    rms_norm_gated_reference,
    rms_norm_reference,
    split_rotate_reference,
)
from .plain import fork_states
from .swiglu.naive import gated_reference, swiglu_reference

# What the rest of dohnuts calls: the ops, and the runtime's switches and records they share.
__all__ = [
    "add_rms_norm", "attention", "chunk_gated_delta_rule", "chunked_fork_attention", "conv_split_heads", "decay",
    "delta_rule", "derived", "fork_states", "fused", "gated", "holding_derived", "lone_row_attention", "norm_rotate",
    "rms_norm", "rms_norm_gated", "slow_path", "slow_paths", "split_rotate", "swiglu", "uncached_plans",
]


# -- normalisation and activation -------------------------------------------------------------


def _norm_scale(weight: torch.Tensor) -> torch.Tensor:
    """Qwen3.5's RMSNorm scale `1 + weight` in float32, kept per weight (`derived`)."""
    return derived(weight, "1+w", lambda w: 1.0 + w.float())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3.5 RMSNorm: x / rms(x) * (1 + weight), computed in float32.

    The `1 + weight` is the Qwen3.5 convention (weights are stored centred on zero).
    Args: x [..., D], weight [D]. Returns: [..., D] in x's dtype.
    """
    ops = _ours(x)
    if ops is not None:
        # Our Triton kernel: FLA's RMSNorm wrapper costs about 0.2 ms of host time a call, which
        # a host-bound training step pays about 160 times. The scale stays in float32, as in
        # Hugging Face's Qwen3.5 RMSNorm.
        return ops.norm.rms_norm(x, _norm_scale(weight), eps)
    return rms_norm_reference(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual, Qwen3.5's RMSNorm of that sum, `rms_norm`): the residual stream and the
    next block's input. On CUDA one Triton kernel reads both once and writes both."""
    ops = _ours(x)
    if ops is not None:
        return ops.norm.add_rms_norm(x, residual, _norm_scale(weight), eps)
    return add_rms_norm_reference(x, residual, weight, eps)


def norm_rotate(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                eps: float) -> torch.Tensor:
    """Qwen3.5's RMSNorm of each attention head (`rms_norm`), then the partial rotary embedding of
    its first R channels. x: [T, H, D]; weight: [D]; cos, sin: [T, R] (each frequency in both
    halves). Returns [T, H, D] in x's dtype. On CUDA one Triton kernel (in float32 throughout)."""
    ops = _ours(x)
    if ops is not None:
        return ops.norm.norm_rotate(x, _norm_scale(weight), cos, sin, eps)
    return norm_rotate_reference(x, weight, cos, sin, eps)


def split_rotate(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """(q, k, v) [T, H, D] contiguous of the vision tower's qkv output [T, 3, H, D], q and k
    turned over all channels by cos, sin [T, D]: on CUDA, with no gradient wanted (the tower
    is frozen), one Triton kernel reading qkv in place."""
    ops = _ours(qkv)
    if ops is not None and not (torch.is_grad_enabled() and qkv.requires_grad):
        return ops.norm.split_rotate(qkv, cos, sin)
    return split_rotate_reference(qkv, cos, sin)


def rms_norm_gated(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gated RMSNorm of the delta-rule output: rms-normalise x, scale by `weight` (not 1 + weight),
    multiply by silu(gate). Args: x, gate [..., V], weight [V]. Returns [..., V] in x's dtype."""
    ops = _ours(x)
    if ops is not None:
        return ops.norm.rms_norm_gated(x, gate, weight, eps)
    return rms_norm_gated_reference(x, gate, weight, eps)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up."""
    ops = _ours(gate)
    if ops is not None:
        return ops.swiglu.swiglu(gate, up)
    return swiglu_reference(gate, up)


def gated(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(gate): the full-attention layer's output gate. On CUDA one Triton kernel that
    reads the gate in place (a strided view of the query projection's output)."""
    ops = _ours(x)
    if ops is not None and gate.dtype == x.dtype:
        return ops.swiglu.gated(x, gate)
    return gated_reference(x, gate)


# -- attention --------------------------------------------------------------------------------


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
              cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, scale: float,
              causal: bool = True) -> torch.Tensor:
    """Causal attention per packed sequence, aligned bottom-right: a sequence with Lq queries and
    Lk keys (its shared prefix first) lets query i see keys 0 .. Lk - Lq + i. With `causal`
    False every query sees every key of its sequence (the vision tower's attention).

    Args:
        q: [Tq, H, D]; k, v: [Tk, HKV, D] with H a multiple of HKV (grouped-query heads).
        cu_seqlens_q, cu_seqlens_k: [N + 1] int32 cumulative lengths of queries and keys.
        max_seqlen_q, max_seqlen_k: the longest sequences (host integers: no device sync).

    Returns:
        [Tq, H, D]
    """
    if q.is_cuda and q.dtype not in (torch.bfloat16, torch.float16):
        slow_path("attention-dtype", f"{q.dtype} on CUDA: attention runs the padded reference, since flash varlen "
                                     f"attention takes bfloat16 or float16 (set model.dtype: bfloat16)")
    if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16):
        # Flash attention's variable-length kernel: no padding, bottom-right causal mask.
        varlen_attn, options = _varlen(causal)
        if "enable_gqa" not in options and k.shape[1] != q.shape[1]:
            return _flash_grouped(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal)
        return varlen_attn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale=scale,
                           **options)
    return attention_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, max_seqlen_q, max_seqlen_k, causal)


def lone_row_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                       max_seqlen: int, scale: float) -> torch.Tensor:
    """Causal attention of a one-row bucket's packed sequences (cu_seqlens: its row first, then
    its padding) -> [T, H, D]. With `attention_ops.DENSE_LONE` (on by default), the whole token axis
    as one causal sequence: the row's queries see exactly its own keys, the padding's see the
    row's too, which changes nothing a candidate reads (every other token mixer runs each
    sequence apart); on CUDA in bfloat16 or float16 through `dense_causal`, on the CPU through
    `attention` of one sequence. Otherwise `attention` of each sequence, as on CUDA in float32
    (tests only: the padded reference, which a bucket's graph already captures per sequence).
    Only where the shapes are fixed at load (a bucket's graph): cuDNN builds a plan for each new
    shape on its first call."""
    if attention_ops.DENSE_LONE and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16):
        return dense_causal(q, k, v, scale)
    if attention_ops.DENSE_LONE and not q.is_cuda:
        whole = torch.tensor([0, q.shape[0]], dtype=torch.int32)
        return attention(q, k, v, whole, whole, q.shape[0], q.shape[0], scale)
    return attention(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, scale)


def chunked_fork_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fork, prefix_tokens: int,
                           scale: float) -> torch.Tensor:
    """Causal attention of a batch padded to a bucket whose rows continue its prefixes
    (`plan.ChunkedFork`): each prefix sees its own keys, each row its prefix's and then its own.
    Every shape the work takes is the bucket's, so a bucket's CUDA graph captures it. On CUDA in
    bfloat16 or float16 two calls of flash attention merged by their log-sum-exps
    (`attention.chunked_fork_partials`, `merge`); elsewhere one masked softmax
    (`attention.chunked_fork_reference`). q [T, H, D], k, v [T, HKV, D] -> [T, H, D]."""
    if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16):
        out, lse, cross, cross_lse = chunked_fork_partials(q, k, v, fork, prefix_tokens, scale)
        rows, rows_lse = out[prefix_tokens:], lse[:, prefix_tokens:]
        ops = _ours(q)
        if ops is not None:
            ops.merge.merge_partials(rows, rows_lse, cross, cross_lse, out=rows)
        else:
            rows.copy_(merge_partials_reference(rows, rows_lse, cross, cross_lse))
        return out
    if q.is_cuda:
        slow_path("attention-dtype", f"{q.dtype} on CUDA: attention runs the padded reference, since flash varlen "
                                     f"attention takes bfloat16 or float16 (set model.dtype: bfloat16)")
    return chunked_fork_reference(q, k, v, fork, prefix_tokens, scale)


# -- gated delta rule -------------------------------------------------------------------------


def conv_split_heads(x: torch.Tensor, weight: torch.Tensor, initial_state: torch.Tensor | None,
                     output_final_state: bool, cu_seqlens: torch.Tensor, cu_seqlens_cpu: torch.Tensor,
                     chunk_indices: torch.Tensor | None, heads: int, key_dim: int, value_heads: int, value_dim: int,
                     parents: torch.Tensor | None = None, orphans: bool = True):
    """The delta rule's causal convolution (SiLU, `causal_conv1d_reference`) of packed sequences
    x [T, 2*H*K + HV*V], split into q, k [T, H, K], L2-normalised per head in float32 (Qwen3.5's
    delta rule), and v [T, HV, V]: returns (q, k, v, final state or None). On CUDA, one Triton
    kernel (`conv.fused.conv_split_heads`) reads x once and writes q, k and v contiguous, as
    the delta-rule kernel reads them.

    With `parents` [N], initial_state is [G, C, W] and sequence n continues row parents[n] (a
    zero state for -1, which `orphans` announces), as `fork_states` would give it. Without
    autograd the Triton kernel reads each state there; otherwise the states are forked first,
    so their gradient flows back to the G rows."""
    ops = _ours(x)
    if parents is not None and (ops is None or _differentiable(x, weight, initial_state)):
        initial_state, parents = fork_states(initial_state, parents, orphans), None
    if ops is not None:
        return ops.conv.conv_split_heads(x, weight, initial_state, output_final_state, cu_seqlens, cu_seqlens_cpu,
                                         chunk_indices, heads, key_dim, value_heads, value_dim, parents)
    return conv_split_heads_reference(x, weight, initial_state, output_final_state, cu_seqlens, heads, key_dim,
                                      value_heads, value_dim)


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, initial_state: torch.Tensor | None = None,
                           output_final_state: bool = False, cu_seqlens: torch.Tensor | None = None,
                           use_qk_l2norm_in_kernel: bool = True, cu_seqlens_cpu: torch.Tensor | None = None,
                           chunk_indices: torch.Tensor | None = None, A_log: torch.Tensor | None = None,
                           dt_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated delta rule: S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - exp(g_t) S_{t-1}^T k_t))^T,
    o_t = S_t^T q_t / sqrt(K).

    Args:
        q, k: [B, T, H, K]; v: [B, T, HV, V] (HV a multiple of H); g (log decay), beta: [B, T, HV].
            With `cu_seqlens` [N + 1], B is 1 and the sequences are packed along T.
        initial_state: [N, HV, K, V] float32 states before each sequence.
        output_final_state: also return the [N, HV, K, V] float32 states after each sequence.
        use_qk_l2norm_in_kernel: L2-normalise q and k first (Qwen3.5 does).
        cu_seqlens_cpu: a host copy of cu_seqlens (no device synchronisation to plan chunks).
        chunk_indices: the plan itself, [chunks, 2] (sequence, 64-token chunk), when known.
        A_log, dt_bias: [HV]; when given, g is the raw gate input and the log decay is
            `decay(g, A_log, dt_bias)`, which the fused kernel computes as it reads g.

    On CUDA, FLA's chunked kernels; elsewhere the plain-PyTorch chunked reference. (The decoder
    calls `delta_rule`, which takes our own kernels where they serve and this otherwise.)

    Returns:
        ([B, T, HV, V] output in v's dtype, final states or None)
    """
    kernels = fused(q)
    if kernels is not None:
        return chunk_gated_delta_rule_fla(kernels["chunk_gated_delta_rule"], q, k, v, g, beta, initial_state,
                                          output_final_state, cu_seqlens, use_qk_l2norm_in_kernel, cu_seqlens_cpu,
                                          chunk_indices, A_log, dt_bias)
    if A_log is not None:
        g = decay(g, A_log, dt_bias)
    return gated_delta_rule_chunked(q, k, v, g, beta, initial_state, output_final_state, cu_seqlens,
                                    use_qk_l2norm_in_kernel)


def delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               cu_seqlens: torch.Tensor, cu_seqlens_cpu: torch.Tensor, longest: int, chunk_indices: torch.Tensor | None,
               A_log: torch.Tensor, dt_bias: torch.Tensor, states: torch.Tensor | None = None,
               parents: torch.Tensor | None = None, orphans: bool = False,
               output_final_state: bool = False, out: torch.Tensor | None = None, beta_logits: bool = False,
               routed: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule of packed sequences, the decoder's entry point: tensors [T, ...]
    with no batch axis, so autograd records no select or unsqueeze around the kernels.

    Args:
        q, k: [T, H, K] L2-normalised; v: [T, HV, V]; g: [T, HV] the raw gate input (the decay
            is `decay(g, A_log, dt_bias)`); beta: [T, HV], or with `beta_logits` the input of
            its sigmoid (Qwen3.5's b), which the Triton forward kernels take as they read it,
            a launch a layer fewer; the other paths take the sigmoid first.
        cu_seqlens: [N + 1] on q's device, cu_seqlens_cpu its host copy; longest: the longest
            sequence, or a bound on it; chunk_indices: the 64-token chunk plan, or None.
        states: [G, HV, K, V] float32 states sequence n continues through parents[n] (a zero
            state for parent -1, which `orphans` announces), or None for zero states.
        output_final_state: also return the [N, HV, K, V] float32 final states.
        out: [T, HV, V] contiguous in v's dtype, to hold o (a part of a larger output, which then
            needs no concatenation), or None. Forward only: autograd does not see the write. The
            Triton forward kernels write there; the other paths copy their output in.
        routed: the scan chooses its path on the device (`delta_rule_scan`'s `routed`): a
            bucket's graph, whose sequence count is its padding's.

    On CUDA, with A_log and dt_bias frozen: without autograd, rows that continue states, need no
    final states and hold at most 64 tokens run `delta_rule.rows.delta_rule_rows`; the rest
    `delta_rule.scan.delta_rule_scan` (reading each state in place), at any length
    (`scan.FORWARD_TOKENS`), so inference never tunes a kernel on a request (one long sequence
    alone, or a one-row bucket's row, in 64-token steps: `scan.walks_alone`);
    with autograd, the scan with `delta_rule.backward`'s gradient for sequences of at most
    `scan.SCAN_TOKENS`.
    Otherwise FLA's chunked kernels, or the plain-PyTorch chunked reference off CUDA.

    Returns:
        (o [T, HV, V] in v's dtype, final states or None)
    """
    if out is not None and _differentiable(q, k, v, g, beta, states, A_log, dt_bias):
        raise ValueError("delta_rule: out is for forward passes only; autograd would not see the write")
    ours = _ours(q)
    frozen = ours is not None and not _differentiable(A_log, dt_bias)
    forward_tokens = None if ours is None else ours.scan.FORWARD_TOKENS
    if (frozen and not _differentiable(q, k, v, g, beta, states)
            and (forward_tokens is None or longest <= forward_tokens)):
        if states is not None and not output_final_state and longest <= ours.rows.ROW_TOKENS:
            return ours.rows.delta_rule_rows(q, k, v, g, beta, states, parents, cu_seqlens, longest, A_log, dt_bias,
                                             out=out, beta_logits=beta_logits), None
        scan = ours.scan
        return scan.delta_rule_scan(q, k, v, g, beta, states, parents, cu_seqlens, output_final_state, A_log,
                                    dt_bias, out=out, beta_logits=beta_logits, chunks=chunk_indices, routed=routed,
                                    one_long=scan.walks_alone(cu_seqlens.shape[0] - 1, longest, routed))
    if beta_logits:
        beta = torch.sigmoid(beta)
    if frozen and longest <= ours.scan.SCAN_TOKENS:
        from .delta_rule import backward  # the same walk with its gradient

        return backward.delta_rule(q, k, v, g, beta, states, parents, cu_seqlens, output_final_state, A_log,
                                   dt_bias)
    initial = fork_states(states, parents, orphans) if states is not None else None
    o, final = chunk_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None], initial, output_final_state,
                                      cu_seqlens, False, cu_seqlens_cpu, chunk_indices, A_log, dt_bias)
    if out is not None:
        return out.copy_(o[0]), final
    return o[0], final


def _differentiable(*tensors) -> bool:
    """Whether autograd would record an operation on these tensors."""
    return torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in tensors)
