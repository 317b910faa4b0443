"""The frozen image-feature cache: vision-tower outputs kept per image content, LRU-bounded.

The vision tower is frozen (LoRA never touches it), so an image's merged features depend
only on its decoded pixels under the fixed preprocessing policy: they stay valid across
optimizer updates and serve training and prediction alike. Each loaded model owns a new,
empty cache.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

DEFAULT_CAPACITY = 128 * 2**20  # bytes of cached features


class ImageFeatureCache:
    """Least-recently-used features [tokens, D] per image key, at most `capacity` bytes of
    features, each kept with its patch grid [1, 3] (so a hit needs no preprocessing at all).

    `stats` counts hits, misses, vision calls and evictions.
    """

    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        if capacity < 0:
            raise ValueError(f"the image-feature cache capacity must be >= 0 bytes, got {capacity}")
        self.capacity = capacity
        self.entries: OrderedDict[str, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self.size = 0
        self.stats = {"hits": 0, "misses": 0, "vision_calls": 0, "evictions": 0}

    def __len__(self) -> int:
        return len(self.entries)

    def clear(self) -> None:
        self.entries.clear()
        self.size = 0

    def grid(self, key: str) -> torch.Tensor | None:
        """The patch grid [1, 3] of a cached image, or None when it is not cached."""
        entry = self.entries.get(key)
        return None if entry is None else entry[1].clone()

    def _put(self, key: str, features: torch.Tensor, grid: torch.Tensor) -> None:
        nbytes = features.numel() * features.element_size()
        if nbytes > self.capacity:
            return  # larger than the whole cache: used once, never kept
        # A copy: a view would keep the whole batch's vision output alive behind `size`.
        self.entries[key] = (features.clone(), grid.reshape(1, 3).cpu())
        self.size += nbytes
        while self.size > self.capacity:
            _, (evicted, _) = self.entries.popitem(last=False)
            self.size -= evicted.numel() * evicted.element_size()
            self.stats["evictions"] += 1

    def features(self, keys: tuple[str, ...], pixel_values: torch.Tensor | None, grid_thw_cpu: torch.Tensor,
                 has_pixels: tuple[bool, ...], encode, merge: int) -> torch.Tensor:
        """The merged features of a batch's images, concatenated in image order [tokens, D].

        Hits skip the vision tower; the misses (each distinct image once) are encoded
        together in one call of `encode(pixel_values, grid_thw)`.

        Args:
            keys: one `inputs.pixels.image_key` per image of the batch.
            pixel_values: [patches, C * temporal * patch * patch] of the images that carry
                pixels, in image order (None when none does).
            grid_thw_cpu: [images, 3] patch grids of every image, on the host.
            has_pixels: per image, whether its pixels are in pixel_values (an image found
                in the cache when the batch was built carries none).
            encode: the vision tower call (pixels, host grids), returning merged features of the
                images given.
            merge: patches per merged token (spatial_merge_size squared).

        Raises:
            RuntimeError: an image without pixels is no longer cached.
        """
        patches = grid_thw_cpu.prod(-1).tolist()
        starts = [0]
        for count, present in zip(patches, has_pixels):
            starts.append(starts[-1] + (count if present else 0))
        found: dict[str, torch.Tensor] = {}
        missing: dict[str, int] = {}
        for index, key in enumerate(keys):
            if key in found or key in missing:
                continue
            if key in self.entries:
                self.entries.move_to_end(key)
                found[key] = self.entries[key][0]
                self.stats["hits"] += 1
            elif has_pixels[index]:
                missing[key] = index
                self.stats["misses"] += 1
            else:
                raise RuntimeError(f"image {key[:12]}... was built without pixels as a cache hit, but its "
                                   f"features are no longer cached: encode its pixels again")
        if missing:
            indices = list(missing.values())
            pixels = torch.cat([pixel_values[starts[i]:starts[i + 1]] for i in indices])
            grids = grid_thw_cpu[indices]
            merged = encode(pixels, grids)  # the grids on the host: the tower plans without a sync
            self.stats["vision_calls"] += 1
            tokens = (grids.prod(-1) // merge).tolist()
            for key, index, features in zip(missing, indices, torch.split(merged, tokens)):
                found[key] = features
                self._put(key, features, grid_thw_cpu[index])
        return torch.cat([found[key] for key in keys])
