"""Image preprocessing for the vision tower: Qwen2-VL's processor policy, run where it pays.

Hugging Face's PIL/NumPy Qwen2-VL processor resizes with PIL, then rescales and normalises in
float64 and float32 NumPy passes and copies the patches out one layout at a time: about 12 ms
of host work for a 512 x 512 image on the GPU machine, a third of an image miss
(docs/changelog.md). Two paths keep the processor's settings:

- `qwen_pixels`, the processor's own result to float rounding: its PIL resize, then the float
  work in torch (tests compare it with the processor at 1e-6);
- `PixelSettings.patches`, what batches use: the decoded RGB bytes travel as they are, and the
  resize (antialiased bicubic, PIL's kernel, rounded to bytes as PIL does), rescale, normalise
  and patch layout run on the device the tower runs on: host work is the decode alone. Its
  pixels differ from the processor's by PIL's integer rounding between its two resize passes
  (a few levels of 255 at most; tests bound it), the same in training and inference.

Processors it does not recognise run themselves, on the host.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass

import blake3
import numpy as np
import torch
import torch.nn.functional as F

from ..schema import rgb

BICUBIC = 3  # PIL.Image.Resampling.BICUBIC


def image_key(image) -> str:
    """BLAKE3 of a decoded image's RGB content and dimensions (the feature cache's and the
    isolation's key)."""
    return content(image)[0]


def content(image) -> tuple[str, bytes]:
    """(`image_key`, its RGB bytes) of a decoded image from one read of its pixels: a new image's
    tensor is made of the bytes its key was (`rgb_bytes`), where reading them again cost as much
    as hashing them. BLAKE3, not SHA-256: a key must resist a client forging another's image (so
    no xxHash), and the 4 MB of a 1,200 px image took 2.2 ms to SHA-256 on the development host
    against 0.63 ms to BLAKE3 on one thread."""
    converted = rgb(image)
    data = converted.tobytes()
    digest = blake3.blake3(f"{converted.width}x{converted.height}:".encode())
    digest.update(data)
    return digest.hexdigest(), data


@dataclass(frozen=True)
class PixelSettings:
    """A Qwen2-VL image processor's policy: patch, merge and temporal patch sizes, the pixel
    count bounds of its resize, its rescale factor, mean and std, PIL resample filter, and its
    module's `smart_resize`."""

    patch: int
    merge: int
    temporal: int
    min_pixels: int
    max_pixels: int
    resample: int
    scale: float
    mean: tuple[float, ...]
    std: tuple[float, ...]
    smart_resize: object

    @classmethod
    def of(cls, processor) -> PixelSettings | None:
        """The settings of a Qwen2-VL processor that resizes, rescales, normalises and converts
        to RGB, else None."""
        needed = ("patch_size", "merge_size", "temporal_patch_size", "image_mean", "image_std", "rescale_factor",
                  "size")
        if processor is None or not all(getattr(processor, name, None) is not None for name in needed):
            return None
        if not all(getattr(processor, flag, False) for flag in ("do_resize", "do_rescale", "do_normalize",
                                                                 "do_convert_rgb")):
            return None
        size = processor.size
        low = size.get("shortest_edge") if isinstance(size, dict) else getattr(size, "shortest_edge", None)
        high = size.get("longest_edge") if isinstance(size, dict) else getattr(size, "longest_edge", None)
        # The processor's own module defines smart_resize in every release we know.
        smart_resize = getattr(sys.modules.get(type(processor).__module__), "smart_resize", None)
        # PIL's BICUBIC (3): the filter `patches` reproduces on the device.
        if not low or not high or smart_resize is None or int(getattr(processor, "resample", 3)) != BICUBIC:
            return None
        return cls(processor.patch_size, processor.merge_size, processor.temporal_patch_size, low, high,
                   int(getattr(processor, "resample", 3)), float(processor.rescale_factor),
                   tuple(processor.image_mean), tuple(processor.image_std), smart_resize)

    def size(self, height: int, width: int) -> tuple[int, int]:
        """The (height, width) the processor resizes an image of this size to."""
        return self.smart_resize(height, width, factor=self.patch * self.merge, min_pixels=self.min_pixels,
                                 max_pixels=self.max_pixels)

    def grid(self, height: int, width: int) -> torch.Tensor:
        """grid_thw [1, 3] of an image of this (original) size."""
        resized_height, resized_width = self.size(height, width)
        return torch.tensor([[1, resized_height // self.patch, resized_width // self.patch]], dtype=torch.long)

    def layout(self, x: torch.Tensor) -> torch.Tensor:
        """Normalised pixels [..., C, H, W] float32 (images of one size) -> patches [images * H/p *
        W/p, C * temporal * p * p], each image's in the tower's merge-block order, one image after
        another, each patch repeated over the temporal axis."""
        patch, merge = self.patch, self.merge
        channels, height, width = x.shape[-3:]
        grid_h, grid_w = height // patch, width // patch
        blocks = x.reshape(-1, channels, grid_h // merge, merge, patch, grid_w // merge, merge, patch)
        blocks = blocks.permute(0, 2, 5, 3, 6, 1, 4, 7)  # (images, gh/m, gw/m, m, m, C, p, p)
        patches = blocks[:, :, :, :, :, :, None].expand(*blocks.shape[:6], self.temporal, patch, patch)
        return patches.reshape(-1, channels * self.temporal * patch * patch)

    def normalised(self, x: torch.Tensor) -> torch.Tensor:
        """Bytes [..., C, H, W] (any dtype holding 0..255) -> (x * scale - mean) / std, float32."""
        mean, std = _constants(self.mean, self.std, x.device)
        return (x.float() * self.scale - mean) / std

    def patches(self, rgb: torch.Tensor) -> torch.Tensor:
        """Decoded RGB bytes [H, W, 3] uint8, or [N, H, W, 3] of N images of one size (on any
        device) -> the tower's patches, one image after another, computed there: antialiased
        bicubic resize to `size` (PIL's filter), rounded and clamped to bytes as PIL's result is,
        then `normalised` and `layout`. Images of one size go through each step together: a
        handful of launches for them all, where one at a time took that many an image."""
        height, width = rgb.shape[-3:-1]
        resized_height, resized_width = self.size(height, width)
        x = rgb.reshape(-1, height, width, rgb.shape[-1]).permute(0, 3, 1, 2)
        if (resized_height, resized_width) != (height, width):
            x = F.interpolate(x.float(), size=(resized_height, resized_width), mode="bicubic", antialias=True,
                              align_corners=False).round().clamp(0, 255)
        return self.layout(self.normalised(x))


@functools.lru_cache(maxsize=16)
def _constants(mean: tuple, std: tuple, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """mean and std [C, 1, 1] float32 on `device`, made once (a copy to a GPU would wait)."""
    return tuple(torch.tensor(values, dtype=torch.float32, device=device)[:, None, None] for values in (mean, std))


def rgb_bytes(image, data: bytes | None = None) -> torch.Tensor:
    """A PIL image's RGB bytes [H, W, 3] uint8 (a writable copy), of `data` (its RGB bytes, as
    `content` gives them) when given."""
    if data is None:
        return torch.from_numpy(np.array(rgb(image)))
    width, height = image.size
    if len(data) != width * height * 3:
        raise ValueError(f"{len(data)} bytes are not the RGB bytes of a {width} x {height} image")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(height, width, 3)


def qwen_pixels(image, processor) -> tuple[torch.Tensor, torch.Tensor]:
    """(pixel_values [patches, C * temporal * patch * patch] float32, grid_thw [1, 3]) of a PIL
    image, as the processor's `images=[image], return_tensors="pt"` gives them."""
    settings = PixelSettings.of(processor)
    if settings is None:
        out = processor(images=[image], return_tensors="pt")
        return out["pixel_values"], out["image_grid_thw"]
    picture = rgb(image)
    grid = settings.grid(picture.height, picture.width)
    height, width = settings.size(picture.height, picture.width)
    if (width, height) != picture.size:
        picture = picture.resize((width, height), resample=settings.resample)
    # The processor rescales in float64 and rounds to float32: float32 here, within an ulp.
    return settings.layout(settings.normalised(torch.from_numpy(np.array(picture)).permute(2, 0, 1))), grid
