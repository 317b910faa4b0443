"""CUDA graphs of the frozen vision tower: one per patch bucket, captured at load, so that an
image of a size met for the first time replays one, and one per exact grid list that recurs.

Eager, the tower's forward is some 12 launches a block and host-bound: 13.0 ms eager against
1.8 ms replayed for one 512 x 512 image of the Qwen3.5-0.8B shape on the H200
(bff99ba in docs/changelog.md). Under a fixed pixel
policy every image has about the same number of patches (1,024 to 1,144 for 512 x 512 at any
aspect ratio the varied traffic sends), but each aspect ratio is its own grid, so a graph per
grid list is met for the first time again and again.

A bucket fixes the patches (P*) and the segments (images, or frames: N*) its graph computes:

- pixels, position embeddings and rotary tables [P*, ...]: the images' patches first, then
  padding rows (whatever the last call left there: finite, read by no real patch);
- cumulative lengths [N* + 2]: the images' own, then one padding segment of the remaining
  patches, then empty ones. Attention runs per segment, so no real patch sees a padding one;
  the merger joins runs of `merge**2` patches, so no merged token mixes the two.

The real patches' features are those of the grid list alone, up to floating-point order (the
matrix products' shapes differ). Padding patches are counted in `stats["padding_patches"]`.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

from ..model.vision import VisionPlan, vision_blocks, vision_plan
from ..ops import kernels

IMAGES = (1, 2, 4, 8)  # images a bucket holds: one request's (model.max_images, 8) or several requests' together
SLACK = 1.125  # patches per image over the policy's nominal count (1,144 / 1,024 at 512 x 512)


@dataclass(frozen=True)
class VisionBucket:
    """Patches and segments a bucket's graph computes (see the module's docstring)."""

    patches: int
    segments: int

    def __post_init__(self):
        if self.patches < 1 or self.segments < 1:
            raise ValueError(f"a vision bucket needs at least one patch and one segment, got {self}")

    def fits(self, patches: int, segments: int) -> bool:
        return patches <= self.patches and segments <= self.segments


def vision_buckets(pixels: int, patch: int, merge: int, images=IMAGES, slack: float = SLACK) -> list[VisionBucket]:
    """The buckets captured at load for a processor that gives every image about `pixels`
    pixels in patches of `patch` x `patch`: for each count of images, that many images of up to
    `slack` times the nominal patches, rounded up to whole merged tokens."""
    block = merge * merge
    nominal = max(1, pixels // (patch * patch))
    per_image = -(-int(nominal * slack) // block) * block
    return [VisionBucket(count * per_image, count) for count in images]


def _capture_tower(visual, pixels: torch.Tensor, plan: VisionPlan, pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """The tower's CUDA graph over fixed inputs (`pixels` and `plan`'s tensors, which a replay
    reads) and its output tensor. Two calls on a side stream first keep the kernels' first
    calls (autotuning, workspaces) out of the graph."""
    side = torch.cuda.Stream(pixels.device)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            vision_blocks(visual, pixels, plan)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # thread_local: a loader's pin-memory thread may call CUDA meanwhile (evaluation)
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        output = vision_blocks(visual, pixels, plan)
    return graph, output


class _BucketGraph:
    """A bucket's inputs, written in place for each call, and (on CUDA) its captured graph;
    on the CPU it runs the tower eagerly over the same padded inputs (what the tests check)."""

    def __init__(self, visual, bucket: VisionBucket, device, pool=None):
        merge = visual.spatial_merge_size
        if bucket.patches % (merge * merge):
            raise ValueError(f"{bucket}: patches must be a multiple of {merge * merge} (whole merged tokens)")
        self.bucket, self.block = bucket, merge * merge
        # A plan of one grid of P* patches: buffers of the plan's shapes and dtypes, finite.
        seed = vision_plan(visual, torch.tensor([[1, merge, bucket.patches // merge]]), device)
        self.positions, self.cos, self.sin = seed.positions.clone(), seed.cos.clone(), seed.sin.clone()
        self.cu_seqlens = torch.full((bucket.segments + 2,), bucket.patches, dtype=torch.int32, device=device)
        self.cu_seqlens[0] = 0
        width = visual.patch_embed.proj.weight[0].numel()  # C * temporal * patch * patch
        self.pixels = torch.zeros(bucket.patches, width, dtype=visual.dtype, device=device)
        self.plan = VisionPlan(self.positions, self.cos, self.sin, self.cu_seqlens, bucket.patches)
        self.graph = self.output = None
        if torch.device(device).type == "cuda":
            self.graph, self.output = _capture_tower(visual, self.pixels, self.plan, pool)

    def __call__(self, visual, pixel_values: torch.Tensor, plan: VisionPlan) -> torch.Tensor:
        """The merged features [patches / merge**2, D] of pixel_values [patches, C*t*p*p] under
        their grid list's plan, computed padded to the bucket."""
        patches, bounds = pixel_values.shape[0], plan.cu_seqlens.shape[0]
        self.pixels[:patches].copy_(pixel_values)
        self.positions[:patches].copy_(plan.positions)
        self.cos[:patches].copy_(plan.cos)
        self.sin[:patches].copy_(plan.sin)
        self.cu_seqlens[:bounds].copy_(plan.cu_seqlens)
        self.cu_seqlens[bounds:].fill_(self.bucket.patches)  # the padding segment, then empty ones
        if self.graph is None:
            return vision_blocks(visual, self.pixels, self.plan)[:patches // self.block]
        self.graph.replay()
        return self.output[:patches // self.block].clone()  # the next replay reuses the graph's memory


class VisionGraphs:
    """The tower's CUDA graphs: the buckets' (`prepare`, at load), else one per exact list of
    image grids (and pixel dtype), captured on its `capture_at`-th sighting and kept in an LRU
    of `capacity`. A grid list that fits a bucket replays the smallest such bucket; one that
    fits none (more images, or larger ones, than the buckets hold) uses the exact graphs. A
    capture that fails leaves its batches eager, logged once. `clear` (the tower's weights
    moved) drops every graph; the buckets are captured again on the next call."""

    def __init__(self, capacity: int = 16, capture_at: int = 3):
        self.capacity, self.capture_at = capacity, capture_at
        self.graphs: OrderedDict = OrderedDict()
        self.buckets: dict[VisionBucket, _BucketGraph] = {}
        self.wanted: tuple = ()  # the buckets `prepare` was asked for, made again after a change
        self.stale = False
        self.seen: dict = {}
        self.failed: set = set()
        self.pool = None
        self.stats = {"eager": 0, "captures": 0, "replays": 0, "bucket_replays": 0, "padding_patches": 0}
        self.prepare_seconds = 0.0  # spent capturing the buckets, all calls of `prepare` together

    def clear(self) -> None:
        self.stale = self.stale or bool(self.buckets)
        self.graphs.clear()
        self.buckets.clear()
        self.seen.clear()
        self.failed.clear()
        self.pool = None

    def prepare(self, visual, buckets) -> int:
        """Capture the graphs of `buckets` on a CUDA tower (smallest first; nothing on the CPU).
        Returns how many are ready. A bucket whose capture fails is left out, logged once."""
        device = visual.patch_embed.proj.weight.device
        self.wanted, self.stale = tuple(sorted(buckets, key=lambda bucket: bucket.patches)), False
        if device.type != "cuda":
            return 0
        start = time.perf_counter()
        with torch.no_grad():
            for bucket in self.wanted:
                if bucket in self.buckets:
                    continue
                self._pool()
                try:
                    self.buckets[bucket] = _BucketGraph(visual, bucket, device, self.pool)
                except Exception as error:  # noqa: BLE001 - a failed bucket leaves its images to the exact graphs
                    kernels.slow_path(f"vision-bucket-capture-{bucket}",
                                      f"the vision tower's CUDA graph of {bucket} failed to capture, so its images "
                                      f"run through the exact graphs: {type(error).__name__}: {error}")
                    torch.cuda.synchronize()
        torch.cuda.synchronize()
        self.prepare_seconds += time.perf_counter() - start
        return len(self.buckets)

    def bucket_for(self, patches: int, segments: int) -> _BucketGraph | None:
        """The smallest prepared bucket that fits, or None."""
        fitting = [bucket for bucket in self.buckets if bucket.fits(patches, segments)]
        return self.buckets[min(fitting, key=lambda bucket: bucket.patches)] if fitting else None

    def __call__(self, visual, pixel_values: torch.Tensor, key: tuple, plan: VisionPlan) -> torch.Tensor:
        if not pixel_values.is_cuda:
            self.stats["eager"] += 1
            return vision_blocks(visual, pixel_values, plan)
        if self.stale:
            self.prepare(visual, self.wanted)  # the tower moved: its buckets are captured again
        bucket = self.bucket_for(pixel_values.shape[0], plan.cu_seqlens.shape[0] - 1)
        if bucket is not None:
            self.stats["bucket_replays"] += 1
            self.stats["padding_patches"] += bucket.bucket.patches - pixel_values.shape[0]
            return bucket(visual, pixel_values, plan)
        key = (key, pixel_values.dtype, pixel_values.shape[0])
        entry = self.graphs.get(key)
        if entry is None:
            self.seen[key] = self.seen.get(key, 0) + 1
            if len(self.seen) > 64 * self.capacity:  # a bound on the sightings remembered
                self.seen.pop(next(iter(self.seen)))
            if self.seen[key] < self.capture_at or key in self.failed:
                self.stats["eager"] += 1
                return vision_blocks(visual, pixel_values, plan)
            entry = self._capture(visual, pixel_values, key, plan)
            if entry is None:
                self.stats["eager"] += 1
                return vision_blocks(visual, pixel_values, plan)
        self.graphs.move_to_end(key)
        static, graph, output = entry
        static.copy_(pixel_values)
        graph.replay()
        self.stats["replays"] += 1
        return output.clone()  # the next replay reuses the graph's memory

    def _pool(self) -> None:
        """A fresh memory pool when no graph lives (see GraphedScores._capture: the allocator
        refuses a capture into a pool whose graphs are all gone)."""
        if not self.graphs and not self.buckets:
            self.pool = torch.cuda.graph_pool_handle()

    def _capture(self, visual, pixel_values, key, plan):
        """An exact grid list's graph (the plan fixed, the pixels copied in), or None."""
        self._pool()
        static = pixel_values.clone()
        try:
            graph, output = _capture_tower(visual, static, plan, self.pool)
        except Exception as error:  # noqa: BLE001 - a failed capture leaves the grid list eager
            self.failed.add(key)
            kernels.slow_path("vision-graph-capture", f"a CUDA graph capture of the vision tower failed (grids "
                                                      f"{key[0]}), so it runs eagerly: {type(error).__name__}: {error}")
            torch.cuda.synchronize()
            return None
        self.stats["captures"] += 1
        self.graphs[key] = (static, graph, output)
        if len(self.graphs) > self.capacity:
            self.graphs.popitem(last=False)
        return self.graphs[key]
