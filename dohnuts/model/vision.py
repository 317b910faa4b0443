"""The frozen vision tower as the runtime runs it: Hugging Face's modules, its patch projection
as one matrix product, and the merged features of a batch's images."""

from __future__ import annotations

import functools
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
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
def _axis_taps():
    """transformers' per-axis interpolation of the position table (`transformers.vision_utils.
    _interpolation_axis_taps_weights`, what its vision-plan helpers tap every patch with; 5.17 to
    5.24 have it), or None where a release lacks it: the tower then runs Hugging Face's own
    forward."""
    try:
        from transformers.vision_utils import _interpolation_axis_taps_weights
    except ImportError:
        return None
    return _interpolation_axis_taps_weights


@torch.no_grad()
def vision_plan(visual, grid_thw_cpu: torch.Tensor, device) -> VisionPlan:
    """The `VisionPlan` of images with patch grids grid_thw_cpu [I, 3] (on the host), as the
    tower's forward makes it with transformers' helpers (`grid_inputs` gives their results) and
    the tower's own modules."""
    indices, weights, rotary_ids, cu = grid_inputs(
        grid_thw_cpu, visual.num_grid_per_side, visual.config.spatial_merge_size, visual.interpolation_mode,
        visual.interpolation_align_corners)
    table = visual.pos_embed
    device = torch.device(device)
    positions = (table(_moved(indices, device)) * _moved(weights, device).to(table.weight.dtype)[:, :, None]).sum(1)
    cos, sin = visual.rotary_pos_emb(positions, _moved(rotary_ids, device))
    return VisionPlan(positions, cos, sin, _moved(cu, device), int((cu[1:] - cu[:-1]).max()))


def _moved(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`; to a GPU from pinned memory, without waiting: a copy from
    pageable memory first waits for every kernel queued on the stream (the batch's before it, in
    the engine, and the image's resize), and a plan is made while they run. (Not
    `inputs.batch.move_packed`: its one staging buffer first waits until its last copy, the
    batch's own, queued behind the same kernels, has been read.)"""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def grid_inputs(grid_thw_cpu: torch.Tensor, side: int, merge: int, mode: str, align_corners: bool):
    """The host inputs of a plan for patch grids grid_thw_cpu [I, 3]: the position table's taps
    and weights [N, n] (n = 4 bilinear, 16 bicubic), the rotary position ids [N, 2] (row, column)
    and the frames' cumulative patch counts [F + 1] int32, patches in the tower's merge-block
    order; equal to transformers' helpers (`get_vision_interpolation_indices_and_weights`,
    `get_vision_position_ids`, `get_vision_cu_seqlens`; tests hold it). Those compute every
    patch's taps from its index: 0.42-0.67 ms of host time for one image of 432 to 2,240 patches
    on the development host, on a new image's critical path. Here each image's rows and columns
    get theirs from the same per-axis function (so the same values) and the patches gather them:
    0.24-0.43 ms, 0.02-0.03 for grids met before (a list of four new grids, 1.35-1.38 both)."""
    grids = [tuple(map(int, grid)) for grid in grid_thw_cpu.tolist()]
    parts = [_image_grid_inputs(height, width, side, merge, mode, align_corners) for _, height, width in grids]
    frames = [part for (frames, _, _), part in zip(grids, parts) for _ in range(frames)]
    counts = [height * width for frames, height, width in grids for _ in range(frames)]
    cu = torch.zeros(len(counts) + 1, dtype=torch.int32)
    torch.cumsum(torch.tensor(counts, dtype=torch.int32), 0, out=cu[1:])
    return (*(torch.cat([part[index] for part in frames]) for index in range(3)), cu)


@functools.lru_cache(maxsize=32)
def _image_grid_inputs(height: int, width: int, side: int, merge: int, mode: str, align_corners: bool):
    """(taps [h * w, n], weights [h * w, n], position ids [h * w, 2]) of one frame's grid, in
    merge-block order (see `grid_inputs`); the last 32 grids are kept (64 bytes a patch
    bilinear: 2 MB for 32 images of 1,024 patches)."""
    def axis(size: int):  # (taps [size, n], weights [size, n]) of an axis's positions
        taps, weights = _axis_taps()(torch.arange(size), torch.tensor(size), side, mode, align_corners)
        return taps.numpy(), weights.numpy()

    (rows, row_weights), (columns, column_weights) = axis(height), axis(width)
    # Merge-block order: block row, block column, row within the block, column within it. In
    # numpy: torch's gathers of a few thousand entries cost ten times numpy's on the host.
    blocks = (height // merge, width // merge, merge, merge)
    row = np.broadcast_to(np.arange(height).reshape(height // merge, 1, merge, 1), blocks).ravel()
    column = np.broadcast_to(np.arange(width).reshape(1, width // merge, 1, merge), blocks).ravel()
    taps = rows.shape[1]
    indices = (rows[row][:, :, None] * side + columns[column][:, None, :]).reshape(-1, taps * taps)
    weights = (row_weights[row][:, :, None] * column_weights[column][:, None, :]).reshape(-1, taps * taps)
    return torch.from_numpy(indices), torch.from_numpy(weights), torch.from_numpy(np.stack([row, column], axis=-1))


def vision_blocks(visual, pixel_values: torch.Tensor, plan: VisionPlan) -> torch.Tensor:
    """The tower's forward with its own modules but no host synchronisation: patch projection,
    positions, each block (norm, qkv, rotary in float32 with q, k and v split out in one kernel on
    CUDA (`kernels.split_rotate`), non-causal varlen attention per image,
    projection, norm, MLP) and the merger. Returns the merged features [tokens, D]."""
    hidden = visual.patch_embed(pixel_values.to(visual.dtype))
    hidden = hidden + plan.positions.to(hidden.dtype)
    total = hidden.shape[0]
    for block in visual.blocks:
        attention = block.attn
        qkv = attention.qkv(block.norm1(hidden)).view(total, 3, attention.num_heads, -1)
        query, key, value = kernels.split_rotate(qkv, plan.cos, plan.sin)
        out = kernels.attention(query, key, value, plan.cu_seqlens, plan.cu_seqlens, plan.max_seqlen, plan.max_seqlen,
                                attention.scaling, causal=False)
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
        if _axis_taps() is None:
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
