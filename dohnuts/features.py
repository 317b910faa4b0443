"""The frozen image-feature cache: vision-tower outputs kept per image content, LRU-bounded.

The vision tower is frozen (LoRA never touches it), so an image's merged features depend
only on its decoded pixels under the fixed preprocessing policy: they stay valid across
optimizer updates and serve training and prediction alike. Each loaded model owns a new,
empty cache.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import torch

DEFAULT_CAPACITY = 128 * 2**20  # bytes of cached features


def image_key(image) -> str:
    """SHA-256 of a decoded image's RGB content and dimensions (the cache key)."""
    rgb = image.convert("RGB")
    digest = hashlib.sha256(f"{rgb.width}x{rgb.height}:".encode())
    digest.update(rgb.tobytes())
    return digest.hexdigest()


class ImageFeatureCache:
    """Least-recently-used features [tokens, D] per image key, at most `capacity` bytes.

    `stats` counts hits, misses, vision calls and evictions.
    """

    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        if capacity < 0:
            raise ValueError(f"the image-feature cache capacity must be >= 0 bytes, got {capacity}")
        self.capacity = capacity
        self.entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.size = 0
        self.stats = {"hits": 0, "misses": 0, "vision_calls": 0, "evictions": 0}

    def __len__(self) -> int:
        return len(self.entries)

    def clear(self) -> None:
        self.entries.clear()
        self.size = 0

    def _put(self, key: str, features: torch.Tensor) -> None:
        nbytes = features.numel() * features.element_size()
        if nbytes > self.capacity:
            return  # larger than the whole cache: used once, never kept
        self.entries[key] = features
        self.size += nbytes
        while self.size > self.capacity:
            _, evicted = self.entries.popitem(last=False)
            self.size -= evicted.numel() * evicted.element_size()
            self.stats["evictions"] += 1

    def features(self, keys: tuple[str, ...], pixel_values: torch.Tensor, grid_thw_cpu: torch.Tensor,
                 encode, merge: int) -> torch.Tensor:
        """The merged features of a batch's images, concatenated in image order [tokens, D].

        Hits skip the vision tower; the misses (each distinct image once) are encoded
        together in one call of `encode(pixel_values, grid_thw)`.

        Args:
            keys: one `image_key` per image of the batch.
            pixel_values: [patches, C * temporal * patch * patch] of all the batch's images.
            grid_thw_cpu: [images, 3] patch grids, on the host.
            encode: the vision tower call, returning merged features of the images given.
            merge: patches per merged token (spatial_merge_size squared).
        """
        patches = grid_thw_cpu.prod(-1).tolist()
        starts = [0]
        for count in patches:
            starts.append(starts[-1] + count)
        found: dict[str, torch.Tensor] = {}
        missing: dict[str, int] = {}
        for index, key in enumerate(keys):
            if key in found or key in missing:
                continue
            if key in self.entries:
                self.entries.move_to_end(key)
                found[key] = self.entries[key]
                self.stats["hits"] += 1
            else:
                missing[key] = index
                self.stats["misses"] += 1
        if missing:
            indices = list(missing.values())
            pixels = torch.cat([pixel_values[starts[i]:starts[i + 1]] for i in indices])
            grids = grid_thw_cpu[indices]
            merged = encode(pixels, grids.to(pixel_values.device))
            self.stats["vision_calls"] += 1
            tokens = (grids.prod(-1) // merge).tolist()
            for key, features in zip(missing, torch.split(merged, tokens)):
                found[key] = features
                self._put(key, features)
        return torch.cat([found[key] for key in keys])

