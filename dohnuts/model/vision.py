"""The frozen vision tower as the runtime runs it: Hugging Face's modules, its patch projection
as one matrix product, and the merged features of a batch's images."""

from __future__ import annotations

import functools
from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import kernels


class PatchProjection(nn.Module):
    """Qwen3.5's patch embedding as one linear map over flattened patches.

    The vision tower's `patch_embed.proj` is a Conv3d whose kernel equals its stride and the
    whole patch [C, t, p, p], so each output is one dot product of a patch with a filter: the
    matrix product x [N, C*t*p*p] @ W^T [C*t*p*p, D] + b. Conv3d runs it as a convolution
    (cuDNN's or PyTorch's im2col path); one GEMM is the same arithmetic. The parameters keep
    the Conv3d's names and shapes (`weight` [D, C, t, p, p], `bias` [D]), so checkpoints load
    and save unchanged; only the forward differs.
    """

    def __init__(self, conv: nn.Conv3d):
        super().__init__()
        if tuple(conv.kernel_size) != tuple(conv.stride) or conv.padding != (0, 0, 0) or conv.groups != 1:
            raise ValueError(f"only a non-overlapping patch Conv3d (kernel = stride, no padding, one group) is a "
                             f"linear map over patches, got {conv}")
        self.weight, self.bias = conv.weight, conv.bias
        self.kernel_size = tuple(conv.kernel_size)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """patches [N, C, t, p, p] -> [N, D, 1, 1, 1], as the Conv3d returns them."""
        flat = patches.reshape(patches.shape[0], -1)
        out = F.linear(flat, self.weight.reshape(self.weight.shape[0], -1), self.bias)
        return out[:, :, None, None, None]


def linear_patch_projection(visual) -> None:
    """Replace the vision tower's patch Conv3d by `PatchProjection`, in place (once)."""
    embed = visual.patch_embed
    if not isinstance(embed.proj, PatchProjection):
        embed.proj = PatchProjection(embed.proj)


@dataclass(frozen=True)
class VisionPlan:
    """What the vision tower's work depends on besides the pixels, for one list of image grids:
    the learned position embeddings resampled to each grid [N, D], the rotary cos and sin
    [N, head_dim] (both in the tower's merge-block patch order), and the images' (frames')
    cumulative patch counts with the longest (a host int)."""

    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int


@functools.cache
def _helpers():
    """transformers' vision-plan helpers (transformers.vision_utils), or None where a release
    lacks them: the tower then runs Hugging Face's own forward."""
    try:
        from transformers.vision_utils import (
            get_vision_cu_seqlens,
            get_vision_interpolation_indices_and_weights,
            get_vision_position_ids,
        )
    except ImportError:
        return None
    return get_vision_cu_seqlens, get_vision_interpolation_indices_and_weights, get_vision_position_ids


@torch.no_grad()
def vision_plan(visual, grid_thw_cpu: torch.Tensor, device) -> VisionPlan:
    """The `VisionPlan` of images with patch grids grid_thw_cpu [I, 3] (on the host), made with
    transformers' own helpers and the tower's own modules, as its forward makes them."""
    cu_of, interpolation, positions_of = _helpers()
    grid = grid_thw_cpu.to(torch.long)
    indices, weights = interpolation(grid, num_grid_per_side=visual.num_grid_per_side, mode=visual.interpolation_mode,
                                     align_corners=visual.interpolation_align_corners,
                                     spatial_merge_size=visual.config.spatial_merge_size)
    table = visual.pos_embed
    positions = (table(indices.to(device)) * weights.to(device, table.weight.dtype)[:, :, None]).sum(1)
    rotary_ids = positions_of(grid, visual.spatial_merge_size).to(device)
    cos, sin = visual.rotary_pos_emb(positions, rotary_ids)
    cu = cu_of(grid)
    return VisionPlan(positions, cos, sin, cu.to(device, torch.int32), int((cu[1:] - cu[:-1]).max()))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def vision_blocks(visual, pixel_values: torch.Tensor, plan: VisionPlan) -> torch.Tensor:
    """The tower's forward with its own modules but no host synchronisation: patch projection,
    positions, each block (norm, qkv, rotary in float32, non-causal varlen attention per image,
    projection, norm, MLP) and the merger. Returns the merged features [tokens, D]."""
    hidden = visual.patch_embed(pixel_values.to(visual.dtype))
    hidden = hidden + plan.positions.to(hidden.dtype)
    total = hidden.shape[0]
    cos, sin = plan.cos.unsqueeze(-2).float(), plan.sin.unsqueeze(-2).float()
    for block in visual.blocks:
        attention = block.attn
        heads = attention.num_heads
        query, key, value = attention.qkv(block.norm1(hidden)).reshape(total, 3, heads, -1).unbind(1)
        query = (query.float() * cos + _rotate_half(query.float()) * sin).to(value.dtype)
        key = (key.float() * cos + _rotate_half(key.float()) * sin).to(value.dtype)
        out = kernels.attention(query.contiguous(), key.contiguous(), value.contiguous(), plan.cu_seqlens,
                                plan.cu_seqlens, plan.max_seqlen, plan.max_seqlen, attention.scaling, causal=False)
        hidden = hidden + attention.proj(out.reshape(total, -1))
        hidden = hidden + block.mlp(block.norm2(hidden))
    return visual.merger(hidden)


class VisionPlans:
    """The `VisionPlan`s of the last `capacity` lists of image grids (a batch's misses make one
    list; device tensors of about 2 KB a patch each for the Qwen3.5-0.8B shape), least recent
    out first."""

    def __init__(self, capacity: int = 64):
        self.capacity = capacity
        self.entries: OrderedDict = OrderedDict()

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, key):
        """The plan of a grid list, now the most recent, or None."""
        plan = self.entries.get(key)
        if plan is not None:
            self.entries.move_to_end(key)
        return plan

    def __setitem__(self, key, plan: VisionPlan) -> None:
        self.entries[key] = plan
        if len(self.entries) > self.capacity:
            self.entries.popitem(last=False)

    def clear(self) -> None:
        self.entries.clear()


def image_features(visual, pixel_values, grid_thw_cpu, plans: dict | None = None,
                   graphs=None) -> torch.Tensor:
    """Frozen vision tower: the merged features of every image, concatenated [tokens, D].

    grid_thw_cpu [I, 3] on the host. `plans` (a `VisionPlans` or a dict) caches each grid
    list's `VisionPlan`, and `graphs` (a `vision_graphs.VisionGraphs`) replays the tower's CUDA
    graphs (their owner clears both when the tower's weights move; a graph holds its plan, so it
    needs `plans`); without transformers' helpers
    the tower runs Hugging Face's forward.
    """
    if graphs is not None and plans is None:
        raise ValueError("image_features: graphs need plans (a graph reads its grid list's plan)")
    with torch.no_grad():
        if _helpers() is None:
            output = visual(pixel_values.to(visual.dtype), grid_thw=grid_thw_cpu.to(pixel_values.device))
            # transformers >= 5 returns a model output whose pooler_output holds the merged features.
            return getattr(output, "pooler_output", output)
        key = tuple(map(tuple, grid_thw_cpu.tolist()))
        plan = plans.get(key) if plans is not None else None
        if plan is None:
            plan = vision_plan(visual, grid_thw_cpu, pixel_values.device)
            if plans is not None:
                plans[key] = plan
        if graphs is not None:
            return graphs(visual, pixel_values, key, plan)
        return vision_blocks(visual, pixel_values, plan)
