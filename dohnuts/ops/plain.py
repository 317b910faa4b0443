"""Plain-PyTorch helpers shared by the references and the dispatch: widening, L2 norm, forked states, packing."""

from __future__ import annotations

import torch


def wide(x: torch.Tensor) -> torch.Tensor:
    """x in at least float32: half precisions widen, float64 stays (so tests can be exact)."""
    return x if x.dtype == torch.float64 else x.float()


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def fork_states(states: torch.Tensor, parents: torch.Tensor, orphans: bool) -> torch.Tensor:
    """Per-prefix states [G, ...] -> each row's [N, ...]: states[parents[n]], or zeros for a
    row without a prefix (parent -1) when `orphans` (host bool) says some row has none."""
    if orphans:
        states = torch.cat([states, states.new_zeros(1, *states.shape[1:])])  # index -1: the zero state
    return states[parents]


# -- packed sequences -------------------------------------------------------------------------


def _segments(cu_seqlens: torch.Tensor, total: int, width: int | None = None):
    """Packed-to-padded index maps: (index [N, L] into the packed axis, valid [N, L]); L is
    `width` when the caller knows the longest sequence (no device synchronisation)."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    if width is None:
        width = int(lengths.max()) if len(lengths) else 0
    offsets = torch.arange(width, device=cu_seqlens.device)
    valid = offsets[None, :] < lengths[:, None]
    index = (cu_seqlens[:-1, None] + offsets[None, :]).clamp(max=max(total - 1, 0))
    return index, valid


def unpack(x: torch.Tensor, cu_seqlens: torch.Tensor | None,
           width: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[1, T, ...] packed (or [B, T, ...] when cu_seqlens is None) -> ([N, L, ...] padded with 0,
    [N, L] valid mask or None); `width` is the longest sequence when known."""
    if cu_seqlens is None:
        return x, None
    index, valid = _segments(cu_seqlens, x.shape[1], width)
    padded = x[0][index]
    mask = valid.view(*valid.shape, *([1] * (padded.dim() - 2)))
    return padded * mask, valid


def pack(y: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """The inverse of `unpack`: [N, L, ...] -> [1, T, ...]."""
    return y if valid is None else y[valid].unsqueeze(0)
