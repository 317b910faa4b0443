"""The gated delta rule in plain PyTorch: Qwen3.5's decay, the chunked CPU path and the token-by-token oracle."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..plain import l2norm, pack, unpack, wide


def decay(a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None) -> torch.Tensor:
    """Qwen3.5's log decay from the raw gate input: -exp(A_log) * softplus(a + dt_bias), in
    float32 (exp(A_log) may overflow in bf16). a: [..., HV]; A_log, dt_bias: [HV]."""
    shifted = wide(a) + wide(dt_bias) if dt_bias is not None else wide(a)
    return -wide(A_log).exp() * F.softplus(shifted)


def _prepare(q, k, v, g, beta, cu_seqlens, normalise):
    """Float32, grouped heads expanded, q scaled, everything unpacked to [N, L, ...]."""
    repeat = v.shape[2] // q.shape[2]
    q, k = wide(q.repeat_interleave(repeat, dim=2)), wide(k.repeat_interleave(repeat, dim=2))
    if normalise:
        q, k = l2norm(q), l2norm(k)
    q = q * q.shape[-1] ** -0.5
    (q, valid), (k, _), (v, _) = unpack(q, cu_seqlens), unpack(k, cu_seqlens), unpack(wide(v), cu_seqlens)
    (g, _), (beta, _) = unpack(wide(g), cu_seqlens), unpack(wide(beta), cu_seqlens)
    return q, k, v, g, beta, valid


def gated_delta_rule_reference(q, k, v, g, beta, initial_state=None, output_final_state=False, cu_seqlens=None,
                               normalise=True):
    """The token-by-token recurrence in float32, all sequences side by side: the oracle."""
    dtype = v.dtype
    q, k, v, g, beta, valid = _prepare(q, k, v, g, beta, cu_seqlens, normalise)
    count, length, heads, key_dim = k.shape
    state = (wide(initial_state) if initial_state is not None
             else k.new_zeros(count, heads, key_dim, v.shape[-1]))
    outputs = []
    for t in range(length):
        # Padding steps (past a sequence's end) must leave its state unchanged.
        live = valid[:, t, None, None, None] if valid is not None else None
        decayed = state * g[:, t, :, None, None].exp()
        memory = (decayed * k[:, t, :, :, None]).sum(-2)  # [N, HV, V]
        delta = (v[:, t] - memory) * beta[:, t, :, None]
        updated = decayed + k[:, t, :, :, None] * delta[:, :, None, :]
        state = updated if live is None else torch.where(live, updated, state)
        outputs.append((state * q[:, t, :, :, None]).sum(-2))
    out = torch.stack(outputs, dim=1) if outputs else v.new_zeros(count, 0, heads, v.shape[-1])
    return pack(out, valid).to(dtype), (state if output_final_state else None)


def gated_delta_rule_chunked(q, k, v, g, beta, initial_state=None, output_final_state=False, cu_seqlens=None,
                             normalise=True, chunk_size=64):
    """The same recurrence as `gated_delta_rule_reference`, a chunk of tokens at a time (the CPU
    path: a few large ops instead of a Python step per token).

    Within a chunk with cumulative log decay G and S0 the state before it, the pseudo-values
    U solve the unit lower-triangular system
        U_i + beta_i sum_{j<i} exp(G_i - G_j) (k_i . k_j) U_j = beta_i (v_i - exp(G_i) S0^T k_i),
    then o_i = exp(G_i) S0^T q_i + sum_{j<=i} exp(G_i - G_j) (q_i . k_j) U_j and
    S = exp(G_C) S0 + sum_j exp(G_C - G_j) k_j U_j^T. Padding has k = v = beta = g = 0, which
    leaves the state unchanged.
    """
    dtype = v.dtype
    q, k, v, g, beta, valid = _prepare(q, k, v, g, beta, cu_seqlens, normalise)
    if valid is not None:
        live = valid[..., None].to(k.dtype)
        k, v, beta, g = k * live[..., None], v * live[..., None], beta * live, g * live
    count, length, heads, key_dim = k.shape
    state = (wide(initial_state) if initial_state is not None
             else k.new_zeros(count, heads, key_dim, v.shape[-1]))
    # [N, H, L, ...] so each chunk is a batch of matrices per sequence and head.
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    g, beta = g.transpose(1, 2), beta.transpose(1, 2)
    outputs = []
    for start in range(0, length, chunk_size):
        end = min(start + chunk_size, length)
        qc, kc, vc, bc = q[:, :, start:end], k[:, :, start:end], v[:, :, start:end], beta[:, :, start:end]
        cumulative = g[:, :, start:end].cumsum(-1)  # [N, H, C]
        size = end - start
        lower = torch.ones(size, size, dtype=torch.bool, device=k.device).tril()
        gap = cumulative[..., :, None] - cumulative[..., None, :]
        # exp only where j <= i: the masked entries would overflow.
        decay = torch.where(lower, gap, torch.full_like(gap, -torch.inf)).exp()  # [N, H, C, C]
        strict = decay.masked_fill(torch.eye(size, dtype=torch.bool, device=k.device), 0.0)
        system = bc[..., None] * strict * (kc @ kc.transpose(-1, -2))
        eye = torch.eye(size, device=k.device, dtype=k.dtype)
        grow = cumulative.exp()[..., None]
        rhs = bc[..., None] * (vc - grow * (kc @ state))
        pseudo = torch.linalg.solve_triangular(eye + system, rhs, upper=False, unitriangular=True)
        outputs.append(grow * (qc @ state) + (decay * (qc @ kc.transpose(-1, -2))) @ pseudo)
        tail = (cumulative[..., -1:] - cumulative).exp()[..., None]  # [N, H, C, 1]
        state = cumulative[..., -1, None, None].exp() * state + (kc * tail).transpose(-1, -2) @ pseudo
    out = torch.cat(outputs, dim=2).transpose(1, 2) if outputs else v.transpose(1, 2)
    return pack(out, valid).to(dtype), (state if output_final_state else None)
