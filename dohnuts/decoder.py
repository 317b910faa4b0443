"""Our Qwen3.5 language forward over packed variable-length rows.

It runs the layers of a Hugging Face `Qwen3_5TextModel` (whose parameters keep the checkpoint
names, so weights, peft LoRA and merge apply unchanged) with our own math: rows are packed
along one axis with cumulative sequence lengths instead of padded, and every kernel comes from
`dohnuts.kernels` (fused on CUDA, plain PyTorch elsewhere). Hugging Face's forward is the test
oracle.
"""

from __future__ import annotations

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


def causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
                     scale: float, prefix=None) -> torch.Tensor:
    """Causal attention within each packed sequence. query, key, value: [T, H, D] -> [T, H, D].

    Sequences are attended side by side, padded to the longest, so the work grows with
    N * L^2 rather than T^2. With `prefix` = (key [N, P, H, D], value, valid [N, P]) every
    token also sees its sequence's whole shared prefix.
    """
    (query, valid), (key, _), (value, _) = (kernels.unpack(x[None], cu_seqlens) for x in (query, key, value))
    length = query.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=query.device).tril()
    mask = causal[None, None] & valid[:, None, None, :]  # [N, 1, L, L]: past keys of the same row
    if prefix is not None:
        prefix_key, prefix_value, prefix_valid = prefix
        key, value = torch.cat([prefix_key, key], dim=1), torch.cat([prefix_value, value], dim=1)
        seen = prefix_valid[:, None, None, :].expand(-1, 1, length, -1)
        mask = torch.cat([seen, mask], dim=-1)
    out = F.scaled_dot_product_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                         attn_mask=mask, scale=scale)
    return kernels.pack(out.transpose(1, 2), valid)[0]


def _attention(module, config, hidden: torch.Tensor, cos, sin, cu_seqlens: torch.Tensor, context=None):
    """Gated, partially rotary, grouped-query attention of packed tokens. hidden: [T, D]."""
    head_dim = config.head_dim
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    total = hidden.shape[0]
    query, gate = module.q_proj(hidden).view(total, heads, 2 * head_dim).chunk(2, dim=-1)
    query = kernels.rms_norm(query, module.q_norm.weight, config.rms_norm_eps)
    key = kernels.rms_norm(module.k_proj(hidden).view(total, kv_heads, head_dim), module.k_norm.weight,
                           config.rms_norm_eps)
    value = module.v_proj(hidden).view(total, kv_heads, head_dim)
    query, key = _rotate(query, cos, sin), _rotate(key, cos, sin)
    groups = heads // kv_heads
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    out = causal_attention(query, key, value, cu_seqlens, head_dim**-0.5, context)
    out = out.reshape(total, heads * head_dim) * torch.sigmoid(gate.reshape(total, -1))
    return module.o_proj(out), (key, value)


def _delta_rule(module, config, hidden: torch.Tensor, cu_seqlens: torch.Tensor, context=None):
    """Gated delta-rule token mixer of packed tokens. hidden: [T, D]."""
    total = hidden.shape[0]
    key_heads, value_heads = config.linear_num_key_heads, config.linear_num_value_heads
    key_dim, value_dim = config.linear_key_head_dim, config.linear_value_head_dim
    mixed = module.in_proj_qkv(hidden)[None]  # [1, T, 2 * Hk * K + Hv * V]
    conv_state, recurrent_state = context if context is not None else (None, None)
    mixed, conv_final = kernels.causal_conv1d(mixed, module.conv1d.weight.squeeze(1), conv_state, True,
                                              cu_seqlens=cu_seqlens)
    query, key, value = mixed[0].split([key_heads * key_dim, key_heads * key_dim, value_heads * value_dim], -1)
    beta = torch.sigmoid(module.in_proj_b(hidden))
    # Qwen3.5's decay: g = -exp(A_log) * softplus(a + dt_bias), in float32 (A may overflow in bf16).
    g = -module.A_log.float().exp() * F.softplus(module.in_proj_a(hidden).float() + module.dt_bias.float())
    out, recurrent_final = kernels.chunk_gated_delta_rule(
        query.reshape(1, total, key_heads, key_dim), key.reshape(1, total, key_heads, key_dim),
        value.reshape(1, total, value_heads, value_dim), g[None], beta[None], recurrent_state, True,
        cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=True)
    gate = module.in_proj_z(hidden).view(total, value_heads, value_dim)
    out = kernels.rms_norm_gated(out[0], gate, module.norm.weight, config.rms_norm_eps)
    return module.out_proj(out.reshape(total, value_heads * value_dim)), (conv_final, recurrent_final)


def _layer(layer, kind: str, config, hidden, cos, sin, cu_seqlens, context=None):
    """One decoder layer. Returns (hidden [T, D], state): the delta rule's (conv, recurrent)
    final states per sequence, or attention's packed (key, value)."""
    normed = kernels.rms_norm(hidden, layer.input_layernorm.weight, config.rms_norm_eps)
    if kind == "linear_attention":
        mixed, state = _delta_rule(layer.linear_attn, config, normed, cu_seqlens, context)
    else:
        mixed, state = _attention(layer.self_attn, config, normed, cos, sin, cu_seqlens, context)
    hidden = hidden + mixed
    normed = kernels.rms_norm(hidden, layer.post_attention_layernorm.weight, config.rms_norm_eps)
    mlp = layer.mlp
    return hidden + mlp.down_proj(kernels.swiglu(mlp.gate_proj(normed), mlp.up_proj(normed))), state


def _run_layers(language_model, inputs_embeds, position_ids, cu_seqlens, activation_checkpointing, contexts):
    """All layers over packed sequences. Returns (last hidden [T, D] before the final norm,
    per-layer states)."""
    config = language_model.config
    cos, sin = rotary_tables(config, position_ids, inputs_embeds.dtype)
    hidden, states = inputs_embeds, []
    for index, (layer, kind) in enumerate(zip(language_model.layers, config.layer_types)):
        context = contexts[index] if contexts is not None else None
        if activation_checkpointing and torch.is_grad_enabled():
            hidden, state = checkpoint(_layer, layer, kind, config, hidden, cos, sin, cu_seqlens, context,
                                       use_reentrant=False)
        else:
            hidden, state = _layer(layer, kind, config, hidden, cos, sin, cu_seqlens, context)
        states.append(state)
    return hidden, states


def packed_forward(language_model, inputs_embeds: torch.Tensor, position_ids: torch.Tensor,
                   cu_seqlens: torch.Tensor, activation_checkpointing: bool = False, prefix=None) -> torch.Tensor:
    """Final (normed) hidden states of packed rows.

    Args:
        language_model: a Hugging Face Qwen3_5TextModel (LoRA may be injected).
        inputs_embeds: [T, D] the rows' embeddings, concatenated.
        position_ids: [3, T] M-RoPE positions (a row continuing a prefix continues its count).
        cu_seqlens: [N + 1] int64 cumulative row lengths, cu_seqlens[-1] = T.
        activation_checkpointing: recompute each layer in the backward pass.
        prefix: optional `SharedPrefix` the rows continue (one per row, see `fork`).

    Returns:
        [T, D] hidden states.
    """
    contexts = prefix.contexts if prefix is not None else None
    hidden, _ = _run_layers(language_model, inputs_embeds, position_ids, cu_seqlens, activation_checkpointing,
                            contexts)
    return kernels.rms_norm(hidden, language_model.norm.weight, language_model.config.rms_norm_eps)


class SharedPrefix:
    """Per-layer states at the end of each of several prefixes, computed in one packed pass.

    Delta-rule layers keep (conv [P, D, W], recurrent [P, H, K, V]) states; attention layers
    keep the prefixes' keys and values padded to [P, L, H, D] with a [P, L] valid mask. The
    states are ordinary tensors of the autograd graph: gradients of every branch that forks
    them flow back into the prefix pass.
    """

    def __init__(self, contexts):
        self.contexts = contexts

    @classmethod
    def compute(cls, language_model, inputs_embeds, position_ids, cu_seqlens, activation_checkpointing=False):
        _, states = _run_layers(language_model, inputs_embeds, position_ids, cu_seqlens, activation_checkpointing,
                                None)
        contexts = []
        for kind, state in zip(language_model.config.layer_types, states):
            if kind == "linear_attention":
                contexts.append(state)
            else:
                (key, valid), (value, _) = (kernels.unpack(x[None], cu_seqlens) for x in state)
                contexts.append((key, value, valid))
        return cls(contexts)

    def fork(self, parents: torch.Tensor) -> SharedPrefix:
        """The states each row continues: row i continues prefix parents[i]."""
        return SharedPrefix([tuple(part[parents] for part in context) for context in self.contexts])
