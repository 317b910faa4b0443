"""The frozen vision tower as the runtime runs it: Hugging Face's modules, its patch projection
as one matrix product, and the merged features of a batch's images."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


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


def image_features(visual, pixel_values, grid_thw) -> torch.Tensor:
    """Frozen vision tower: the merged features of every image, concatenated [tokens, D]."""
    with torch.no_grad():
        output = visual(pixel_values.to(visual.dtype), grid_thw=grid_thw)
    # transformers >= 5 returns a model output whose pooler_output holds the merged features.
    return getattr(output, "pooler_output", output)
