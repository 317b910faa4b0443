"""Our Qwen3.5 language forward over packed variable-length rows.

It runs the layers of a Hugging Face `Qwen3_5TextModel` (whose parameters keep the checkpoint
names, so weights, peft LoRA and merge apply unchanged) with our own math: rows are packed
along one axis with cumulative sequence lengths instead of padded, and every kernel comes from
`dohnuts.kernels` (fused on CUDA, plain PyTorch elsewhere). Hugging Face's forward is the test
oracle.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from . import kernels


def rotary_tables(config, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, R] of interleaved M-RoPE for positions [3, T] (temporal, height, width).

    Frequency j takes the height position when j % 3 == 1 and j < 3 * section[1], the width
    position when j % 3 == 2 and j < 3 * section[2], else the temporal one.
    """
    rope = config.rope_parameters
    head_dim = config.head_dim
    rotary = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    inv_freq = 1.0 / (rope["rope_theta"] ** (torch.arange(0, rotary, 2, dtype=torch.float32,
                                                          device=position_ids.device) / rotary))
    freqs = position_ids.float()[..., None] * inv_freq  # [3, T, R/2]
    section = rope.get("mrope_section", [rotary // 2, 0, 0])
    mixed = freqs[0].clone()
    for axis in (1, 2):
        index = slice(axis, section[axis] * 3, 3)
        mixed[..., index] = freqs[axis][..., index]
    table = torch.cat([mixed, mixed], dim=-1)
    return table.cos().to(dtype), table.sin().to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Partial rotary embedding on the first R channels of x [T, H, D]."""
    width = cos.shape[-1]
    rotated, rest = x[..., :width], x[..., width:]
    first, second = rotated.chunk(2, dim=-1)
    turned = torch.cat([-second, first], dim=-1)
    rotated = rotated * cos[:, None, :] + turned * sin[:, None, :]
    return torch.cat([rotated, rest], dim=-1)


@dataclass(frozen=True)
class Fork:
    """How packed rows continue shared prefixes; planned on the host by `plan_fork`.

    parents: [N] the prefix each row continues, -1 for none.
    key_index: [Tk] each row's attention keys (its prefix's tokens, then its own) as indices
        into the prefix tokens followed by the rows' tokens.
    cu_seqlens_k: [N + 1] int32 cumulative key counts; max_seqlen_k: the largest (host int).
    """

    parents: torch.Tensor
    key_index: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_k: int

    def map(self, move) -> Fork:
        """The same fork with `move` applied to its tensors (device copies, pinning)."""
        return Fork(move(self.parents), move(self.key_index), move(self.cu_seqlens_k), self.max_seqlen_k)


def chunk_plan(lengths: list[int], chunk_size: int = 64) -> torch.Tensor:
    """[chunks, 2] int32 (sequence, chunk within it) of every chunk of packed sequences: the
    plan flash-linear-attention's varlen kernels walk, made on the host."""
    plan = [(sequence, chunk) for sequence, length in enumerate(lengths)
            for chunk in range(-(-length // chunk_size))]
    return torch.tensor(plan, dtype=torch.int32).reshape(-1, 2)


def plan_fork(prefix_lengths: list[int], row_lengths: list[int], parents: list[int]) -> Fork:
    """The `Fork` of rows (own lengths `row_lengths`) continuing prefixes of `prefix_lengths`."""
    prefix_starts = [0]
    for length in prefix_lengths:
        prefix_starts.append(prefix_starts[-1] + length)
    row_start, indices, counts = prefix_starts[-1], [], []
    for length, parent in zip(row_lengths, parents):
        if parent >= 0:
            indices.extend(range(prefix_starts[parent], prefix_starts[parent + 1]))
        indices.extend(range(row_start, row_start + length))
        counts.append(length + (prefix_lengths[parent] if parent >= 0 else 0))
        row_start += length
    cu = torch.tensor([0] + counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    key_index = torch.from_numpy(np.asarray(indices, dtype=np.int64))
    return Fork(torch.tensor(parents, dtype=torch.long), key_index, cu, max(counts, default=0))


def _attention(module, config, hidden: torch.Tensor, cos, sin, segments, context=None):
    """Gated, partially rotary, grouped-query attention of packed tokens. hidden: [T, D].

    Returns (output [T, D], this pass's (key, value) [T, HKV, D] for rows that will fork it).
    """
    cu_seqlens, max_seqlen, _, _ = segments
    head_dim = config.head_dim
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    total = hidden.shape[0]
    query, gate = module.q_proj(hidden).view(total, heads, 2 * head_dim).chunk(2, dim=-1)
    query = kernels.rms_norm(query, module.q_norm.weight, config.rms_norm_eps)
    key = kernels.rms_norm(module.k_proj(hidden).view(total, kv_heads, head_dim), module.k_norm.weight,
                           config.rms_norm_eps)
    value = module.v_proj(hidden).view(total, kv_heads, head_dim)
    query, key = _rotate(query, cos, sin), _rotate(key, cos, sin)
    keys, values, cu_seqlens_k, max_seqlen_k = key, value, cu_seqlens, max_seqlen
    if context is not None:
        prefix_key, prefix_value, fork = context
        keys, values = torch.cat([prefix_key, key])[fork.key_index], torch.cat([prefix_value, value])[fork.key_index]
        cu_seqlens_k, max_seqlen_k = fork.cu_seqlens_k, fork.max_seqlen_k
    out = kernels.attention(query, keys, values, cu_seqlens, cu_seqlens_k, max_seqlen, max_seqlen_k, head_dim**-0.5)
    out = out.reshape(total, heads * head_dim) * torch.sigmoid(gate.reshape(total, -1))
    return module.o_proj(out), (key, value)


def _delta_rule(module, config, hidden: torch.Tensor, segments, context=None, keep_states=False):
    """Gated delta-rule token mixer of packed tokens. hidden: [T, D]. With `keep_states`, also
    the (conv, recurrent) final states of each sequence."""
    total = hidden.shape[0]
    key_heads, value_heads = config.linear_num_key_heads, config.linear_num_value_heads
    key_dim, value_dim = config.linear_key_head_dim, config.linear_value_head_dim
    mixed = module.in_proj_qkv(hidden)[None]  # [1, T, 2 * Hk * K + Hv * V]
    conv_state, recurrent_state = context if context is not None else (None, None)
    cu_seqlens, _, cu_seqlens_cpu, chunk_indices = segments
    mixed, conv_final = kernels.causal_conv1d(mixed, module.conv1d.weight.squeeze(1), conv_state, keep_states,
                                              cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                                              chunk_indices=chunk_indices)
    query, key, value = mixed[0].split([key_heads * key_dim, key_heads * key_dim, value_heads * value_dim], -1)
    beta = torch.sigmoid(module.in_proj_b(hidden))
    # Qwen3.5's decay: g = -exp(A_log) * softplus(a + dt_bias), in float32 (A may overflow in bf16).
    rate = kernels.derived(module.A_log, "-exp", lambda a: -a.float().exp())
    bias = kernels.derived(module.dt_bias, "float", torch.Tensor.float)
    g = rate * F.softplus(module.in_proj_a(hidden).float() + bias)
    out, recurrent_final = kernels.chunk_gated_delta_rule(
        query.reshape(1, total, key_heads, key_dim), key.reshape(1, total, key_heads, key_dim),
        value.reshape(1, total, value_heads, value_dim), g[None], beta[None], recurrent_state, keep_states,
        cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=True, cu_seqlens_cpu=cu_seqlens_cpu,
        chunk_indices=chunk_indices)
    gate = module.in_proj_z(hidden).view(total, value_heads, value_dim)
    out = kernels.rms_norm_gated(out[0], gate, module.norm.weight, config.rms_norm_eps)
    return module.out_proj(out.reshape(total, value_heads * value_dim)), (conv_final, recurrent_final)


def _layer(layer, kind: str, config, hidden, cos, sin, segments, context=None, keep_states=False):
    """One decoder layer. Returns (hidden [T, D], state): the delta rule's (conv, recurrent)
    final states per sequence, or attention's packed (key, value)."""
    normed = kernels.rms_norm(hidden, layer.input_layernorm.weight, config.rms_norm_eps)
    if kind == "linear_attention":
        mixed, state = _delta_rule(layer.linear_attn, config, normed, segments, context, keep_states)
    else:
        mixed, state = _attention(layer.self_attn, config, normed, cos, sin, segments, context)
    hidden = hidden + mixed
    normed = kernels.rms_norm(hidden, layer.post_attention_layernorm.weight, config.rms_norm_eps)
    mlp = layer.mlp
    return hidden + mlp.down_proj(kernels.swiglu(mlp.gate_proj(normed), mlp.up_proj(normed))), state


def _run_layers(language_model, inputs_embeds, position_ids, segments, activation_checkpointing, contexts,
                keep_states=False):
    """All layers over packed sequences. Returns (last hidden [T, D] before the final norm,
    per-layer states, or Nones without `keep_states`)."""
    config = language_model.config
    cos, sin = rotary_tables(config, position_ids, inputs_embeds.dtype)
    hidden, states = inputs_embeds, []
    for index, (layer, kind) in enumerate(zip(language_model.layers, config.layer_types)):
        context = contexts[index] if contexts is not None else None
        if activation_checkpointing and torch.is_grad_enabled():
            hidden, state = checkpoint(_layer, layer, kind, config, hidden, cos, sin, segments, context,
                                       keep_states, use_reentrant=False)
        else:
            hidden, state = _layer(layer, kind, config, hidden, cos, sin, segments, context, keep_states)
        states.append(state if keep_states else None)  # else each attention layer's K/V is freed at once
    return hidden, states


def _segments(cu_seqlens: torch.Tensor, cu_seqlens_cpu: torch.Tensor | None, chunk_indices: torch.Tensor | None):
    """(cu_seqlens, longest sequence, host copy of cu_seqlens, 64-token chunk indices or None):
    one of each serves every layer of a pass."""
    if cu_seqlens_cpu is None:
        cu_seqlens_cpu = cu_seqlens.cpu()  # one synchronisation for the whole pass
    max_seqlen = int((cu_seqlens_cpu[1:] - cu_seqlens_cpu[:-1]).max()) if len(cu_seqlens_cpu) > 1 else 0
    return cu_seqlens, max_seqlen, cu_seqlens_cpu, chunk_indices


def packed_forward(language_model, inputs_embeds: torch.Tensor, position_ids: torch.Tensor,
                   cu_seqlens: torch.Tensor, activation_checkpointing: bool = False, prefix: list | None = None,
                   cu_seqlens_cpu: torch.Tensor | None = None, chunk_indices: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """Final (normed) hidden states of packed rows.

    Args:
        language_model: a Hugging Face Qwen3_5TextModel (LoRA may be injected).
        inputs_embeds: [T, D] the rows' embeddings, concatenated.
        position_ids: [3, T] M-RoPE positions (a row continuing a prefix continues its count).
        cu_seqlens: [N + 1] cumulative row lengths, cu_seqlens[-1] = T.
        activation_checkpointing: recompute each layer in the backward pass.
        prefix: the per-layer contexts of the shared prefixes the rows continue
            (`SharedPrefix.fork`), or None.
        cu_seqlens_cpu: a host copy of cu_seqlens, when the caller has one (saves a device sync).
        chunk_indices: [chunks, 2] (sequence, chunk) of every 64-token chunk (`chunk_plan`), so
            the fused kernels need not plan; a CUDA graph then owns the plan it replays.

    Returns:
        [T, D] hidden states.
    """
    hidden, _ = _run_layers(language_model, inputs_embeds, position_ids, _segments(cu_seqlens, cu_seqlens_cpu, chunk_indices),
                            activation_checkpointing, prefix)
    return kernels.rms_norm(hidden, language_model.norm.weight, language_model.config.rms_norm_eps)


class SharedPrefix:
    """Per-layer states at the end of each of several prefixes, computed in one packed pass.

    Delta-rule layers keep (conv [P, D, W], recurrent [P, H, K, V]) final states; attention
    layers keep the prefixes' packed keys and values [T, HKV, D]. The states are ordinary
    tensors of the autograd graph: the gradients of every row that forks them flow back into
    the prefix pass, and nothing outlives the forward that made them.
    """

    def __init__(self, kinds, states):
        self.kinds = kinds
        self.states = states

    @classmethod
    def compute(cls, language_model, inputs_embeds, position_ids, cu_seqlens, activation_checkpointing=False,
                cu_seqlens_cpu: torch.Tensor | None = None, chunk_indices: torch.Tensor | None = None
                ) -> SharedPrefix:
        """Args as `packed_forward`, for the prefixes: inputs_embeds [P, D], cu_seqlens [G + 1]."""
        _, states = _run_layers(language_model, inputs_embeds, position_ids, _segments(cu_seqlens, cu_seqlens_cpu, chunk_indices),
                                activation_checkpointing, None, keep_states=True)
        return cls(language_model.config.layer_types, states)

    def fork(self, fork: Fork) -> list:
        """The per-layer contexts the rows continue: delta-rule (conv, recurrent) initial states
        per row, attention (prefix keys, prefix values, fork). Row i continues prefix
        fork.parents[i] (-1: none, which is a zero state and no prefix keys)."""
        contexts = []
        for kind, state in zip(self.kinds, self.states):
            if kind == "linear_attention":
                # An appended zero state serves the rows without a prefix (index -1).
                contexts.append(tuple(torch.cat([part, part.new_zeros(1, *part.shape[1:])])[fork.parents]
                                      for part in state))
            else:
                contexts.append((*state, fork))
        return contexts
