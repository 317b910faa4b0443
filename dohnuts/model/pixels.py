"""Image preprocessing for the vision tower: Qwen2-VL's processor, its float work in torch.

Hugging Face's PIL/NumPy Qwen2-VL processor resizes with PIL, then rescales and normalises in
float64 and float32 NumPy passes and copies the patches out one layout at a time: about 12 ms
of host work for a 512 x 512 image on the GPU machine, a third of an image miss
(docs/runtime.md). `qwen_pixels` keeps the processor's settings and its PIL resize (so the
pixels are the processor's to float rounding) and does the rest as a few torch operations.
Processors it does not recognise run themselves.
"""

from __future__ import annotations

import sys

import numpy as np
import torch


def _settings(processor):
    """(patch, merge, temporal, min pixels, max pixels, resample, scale, mean, std) of a Qwen2-VL
    image processor that resizes, rescales, normalises and converts to RGB, else None."""
    needed = ("patch_size", "merge_size", "temporal_patch_size", "image_mean", "image_std", "rescale_factor", "size")
    if processor is None or not all(getattr(processor, name, None) is not None for name in needed):
        return None
    if not all(getattr(processor, flag, False) for flag in ("do_resize", "do_rescale", "do_normalize",
                                                             "do_convert_rgb")):
        return None
    size = processor.size
    low = getattr(size, "shortest_edge", None) if not isinstance(size, dict) else size.get("shortest_edge")
    high = getattr(size, "longest_edge", None) if not isinstance(size, dict) else size.get("longest_edge")
    if not low or not high:
        return None
    return (processor.patch_size, processor.merge_size, processor.temporal_patch_size, low, high,
            getattr(processor, "resample", 3), processor.rescale_factor, processor.image_mean, processor.image_std)


def qwen_pixels(image, processor) -> tuple[torch.Tensor, torch.Tensor]:
    """(pixel_values [patches, C * temporal * patch * patch] float32, grid_thw [1, 3]) of a PIL
    image, as the processor's `images=[image], return_tensors="pt"` gives them."""
    settings = _settings(processor)
    if settings is None:
        out = processor(images=[image], return_tensors="pt")
        return out["pixel_values"], out["image_grid_thw"]
    smart_resize = getattr(sys.modules.get(type(processor).__module__), "smart_resize", None)
    if smart_resize is None:  # the processor's own module defines it in every release we know
        out = processor(images=[image], return_tensors="pt")
        return out["pixel_values"], out["image_grid_thw"]
    patch, merge, temporal, low, high, resample, scale, mean, std = settings
    rgb = image.convert("RGB")
    height, width = smart_resize(rgb.height, rgb.width, factor=patch * merge, min_pixels=low, max_pixels=high)
    if (width, height) != rgb.size:
        rgb = rgb.resize((width, height), resample=resample)
    x = torch.from_numpy(np.array(rgb)).permute(2, 0, 1)  # [C, H, W] uint8 (a writable copy)
    # The processor rescales in float64 and rounds to float32: float32 here, within an ulp.
    x = x.float() * scale
    x = (x - torch.tensor(mean, dtype=torch.float32)[:, None, None]) / torch.tensor(std, dtype=torch.float32)[:, None,
                                                                                                              None]
    channels, grid_h, grid_w = x.shape[0], height // patch, width // patch
    blocks = x.reshape(channels, grid_h // merge, merge, patch, grid_w // merge, merge, patch)
    blocks = blocks.permute(1, 4, 2, 5, 0, 3, 6)  # (gh/m, gw/m, m, m, C, p, p): merge blocks together
    patches = blocks[:, :, :, :, :, None].expand(*blocks.shape[:5], temporal, patch, patch)
    pixel_values = patches.reshape(grid_h * grid_w, channels * temporal * patch * patch)
    return pixel_values, torch.tensor([[1, grid_h, grid_w]], dtype=torch.long)
