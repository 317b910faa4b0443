"""Plain-PyTorch references of the delta rule's causal convolution and head split: the oracle of `fused`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..plain import l2norm, pack, unpack, wide


def causal_conv1d_reference(x, weight, initial_state=None, output_final_state=False, cu_seqlens=None,
                            activation="silu"):
    """Depthwise causal convolution with optional carried state, per packed sequence.

    Args:
        x: [B, T, D], or [1, T, D] packed with `cu_seqlens` [N + 1].
        weight: [D, W].
        initial_state: [N, D, W], the W inputs before each sequence (last one most recent).
        output_final_state: also return the last W inputs of each sequence, [N, D, W].
        activation: "silu" or None.

    Returns:
        ([B, T, D] output, final state or None)
    """
    padded, valid = unpack(x, cu_seqlens)
    count, length, dim = padded.shape
    width = weight.shape[-1]
    history = (initial_state.transpose(1, 2).to(x.dtype) if initial_state is not None
               else padded.new_zeros(count, width, dim))
    full = torch.cat([history, padded], dim=1)  # [N, W + L, D]
    # y[t] = sum_i weight[:, i] * full[t + 1 + i]: the kernel's last tap is the current input.
    windows = full[:, 1:].unfold(1, width, 1)  # [N, L, D, W]
    out = (wide(windows) * wide(weight)).sum(-1).to(x.dtype)
    if activation == "silu":
        out = F.silu(out)
    final = None
    if output_final_state:
        lengths = (valid.sum(-1) if valid is not None else torch.full((count,), length, device=x.device))
        # The last W entries of [history, sequence] end at W + length.
        picks = lengths[:, None] + torch.arange(width, device=x.device)[None, :]  # [N, W]
        final = torch.gather(full, 1, picks[..., None].expand(-1, -1, dim)).transpose(1, 2).contiguous()
    return pack(out, valid), final


def conv_split_heads_reference(x, weight, initial_state, output_final_state, cu_seqlens, heads, key_dim, value_heads,
                               value_dim):
    out, final = causal_conv1d_reference(x[None], weight, initial_state, output_final_state, cu_seqlens)
    return (*split_heads_reference(out[0], heads, key_dim, value_heads, value_dim), final)


def split_heads_reference(mixed, heads, key_dim, value_heads, value_dim):
    total = mixed.shape[0]
    q, k, v = mixed.split([heads * key_dim, heads * key_dim, value_heads * value_dim], -1)
    q, k = (l2norm(wide(x.reshape(total, heads, key_dim))).to(mixed.dtype) for x in (q, k))
    return q, k, v.reshape(total, value_heads, value_dim)
