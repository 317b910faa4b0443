"""Token rows and their packed batches: shared prefixes planned once on the host.

A batch packs every row along one token axis. Rows of one request begin alike (the state
with its images' blocks); when at least two rows share that beginning and it holds at least 64 tokens, it is
a prefix computed once and forked into the rows, which then carry only their remaining tokens.
All the index arithmetic happens here, on the host, so the model's forward needs no device
synchronisation to find its way.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, fields
from typing import NamedTuple

import numpy as np
import torch

from ..ops.plan import ChunkedFork, Fork, ForkPlan, chunk_plan, cumulative, plan_fork
from ..schema import Question
from .pixels import PixelSettings
from .tokens import SPATIAL_MERGE

# The shortest prefix worth sharing: below a delta-rule chunk, forking its states into every
# row costs about what computing it again would.
SHARED_MIN = 64


class Row(NamedTuple):
    """One question of one request as token ids (a named tuple: see `schema.Question`).

    `shared` is the length of the request's common beginning (the state with its images);
    `images` index the encoded images of the batch this row goes into, one per vision block of
    the row in order (the same image twice: the same index); `image_grids` are those blocks'
    merged (height, width) token grids.
    """

    input_ids: tuple[int, ...]
    markers: tuple[int, ...]
    question: Question
    shared: int = 0
    images: tuple[int, ...] = ()
    image_grids: tuple[tuple[int, int], ...] = ()


@dataclass
class EncodedImage:
    """An image ready for a batch. `pixel_values` is None when its features were cached when
    it was encoded (the model then reads the cache and skips preprocessing entirely). With
    `settings`, they are the decoded RGB bytes [H, W, 3] uint8, which the model's device turns
    into patches (`pixels.PixelSettings.patches`); without, the processor's patches."""

    pixel_values: torch.Tensor | None  # [H, W, 3] uint8 with settings, else [patches, C * temporal * p * p]
    grid_thw: torch.Tensor  # [1, 3]
    key: str = ""  # BLAKE3 of the decoded RGB content (dohnuts.inputs.pixels.image_key)
    settings: PixelSettings | None = None

    @property
    def tokens(self) -> int:
        """Merged image tokens: one per 2x2 patches."""
        return int(self.grid_thw.prod()) // SPATIAL_MERGE**2

    def patches(self, device=None) -> torch.Tensor:
        """The tower's patches [patches, C * temporal * p * p] float32, made on `device` (where
        the bytes are by default)."""
        if self.pixel_values is None:
            raise ValueError("a cached image carries no pixels")
        pixels = self.pixel_values if device is None else self.pixel_values.to(device)
        return self.settings.patches(pixels) if self.settings is not None else pixels


@dataclass
class Batch:
    """Packed rows: the prefixes' tokens first (P of them), then each row's own tokens.

    input_ids [P + S], position_ids [3, P + S] M-RoPE (temporal, height, width);
    prefix_cu_seqlens [G + 1] and cu_seqlens [B + 1] (int32) segment the two parts; their
    *_cpu copies stay on the host, so kernels plan their work without a device sync, and
    prefix_chunk_indices and chunk_indices are those plans (`dohnuts.ops.plan.chunk_plan`);
    fork says which prefix each row continues (None: no shared prefix in this batch; planned by
    chunk, a `ChunkedFork`, once padded to a bucket);
    markers [B, K] index the rows' part, candidate_mask [B, K];
    image_slots [I] are the image-token positions in input_ids and image_sources [I] their
    rows in the concatenated features of the batch's images (image_grid_thw_cpu, image_keys for
    the feature cache; pixel_values of the images with image_has_pixels, the others being
    cache hits known when the batch was built).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    prefix_tokens: int
    prefix_cu_seqlens: torch.Tensor
    prefix_cu_seqlens_cpu: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_cpu: torch.Tensor
    prefix_chunk_indices: torch.Tensor
    chunk_indices: torch.Tensor
    fork: Fork | ChunkedFork | None
    markers: torch.Tensor
    candidate_mask: torch.Tensor
    image_slots: torch.Tensor
    image_sources: torch.Tensor
    pixel_values: torch.Tensor | None
    image_grid_thw_cpu: torch.Tensor | None
    image_keys: tuple[str, ...]
    image_has_pixels: tuple[bool, ...]
    input_tokens: int  # tokens of the rows as written, prefix counted in every row
    rows_bound: int | None = None  # a bound on the longest row, planned for instead of it (buckets)
    lone_row: bool = False  # one real row, then padding sequences no candidate reads (a one-row bucket's)
    pixel_settings: PixelSettings | None = None  # with it, pixel_values are RGB bytes, flat
    image_shapes_cpu: torch.Tensor | None = None  # [images with pixels, 3] their byte arrays' shapes

    def patches(self) -> torch.Tensor | None:
        """The patches of the images with pixels, concatenated [patches, C * temporal * p * p],
        made where pixel_values are (the model's device once the batch is there)."""
        if self.pixel_values is None or self.pixel_settings is None:
            return self.pixel_values
        # Each run of images of one size goes through `patches` together (the bytes lie one image
        # after another, so a run is one view).
        runs, start = [], 0
        for shape, images in itertools.groupby(map(tuple, self.image_shapes_cpu.tolist())):
            count = len(list(images))
            size = count * shape[0] * shape[1] * shape[2]
            runs.append(self.pixel_settings.patches(self.pixel_values[start:start + size].view(count, *shape)))
            start += size
        return runs[0] if len(runs) == 1 else torch.cat(runs)

    @property
    def computed_tokens(self) -> int:
        """Tokens the language model runs: each prefix once, then the rows' own tokens."""
        return int(self.input_ids.shape[0])

    def map_tensors(self, move) -> Batch:
        """`move` applied to every tensor bound for the device (the *_cpu copies stay)."""
        values = {}
        for field in fields(self):
            value = getattr(self, field.name)
            if isinstance(value, torch.Tensor) and not field.name.endswith("_cpu"):
                value = move(value)
            elif isinstance(value, ForkPlan):
                value = value.map(move)
            values[field.name] = value
        return Batch(**values)

    def to(self, device) -> Batch:
        """The batch on `device`; copies from pinned memory do not block the host."""
        return self.map_tensors(lambda tensor: tensor.to(device, non_blocking=True))

    def pin_memory(self) -> Batch:
        return self.map_tensors(torch.Tensor.pin_memory)

    def moved(self, device: torch.device) -> Batch:
        """The host batch on the CUDA `device` in one copy (`move_packed` into a device buffer of
        its own, which its tensors view) when its tensors are contiguous and together at most
        PACKED_BYTES; else from pinned memory tensor by tensor. Neither blocks the host. (A
        bucket's padded batch of a 1,287-token question, eleven tensors, took 0.54 ms of host
        time pinned and moved one by one on the H200's host.)"""
        tensors = self.device_tensors()
        offsets, total = packed_layout(tensors)
        if total > PACKED_BYTES or not all(tensor.is_contiguous() for tensor in tensors):
            return self.pin_memory().to(device)
        buffer = torch.empty(max(total, 1), dtype=torch.uint8, device=device)
        move_packed(tensors, buffer, offsets, total)
        placed = iter(packed_views(buffer, tensors, offsets))
        return self.map_tensors(lambda tensor: next(placed))

    def device_tensors(self) -> list[torch.Tensor]:
        """The tensors `to` moves."""
        found = []
        self.map_tensors(lambda tensor: found.append(tensor) or tensor)
        return found


# A request's batch holds about ten small tensors (ids, positions, plans, the fork). Moved one
# by one, each is a host-to-device copy of its own, about 10 us of host time apiece on the
# H200's host, and a CUDA graph's replay then copies each again into the graph's inputs. A host
# batch of a captured graph's layout instead goes straight into the graph's inputs, laid out in
# one pinned buffer and moved in one copy (`move_packed`).
PACKED_BYTES = 1 << 20  # larger batches move tensor by tensor
PACKED_ALIGN = 16  # bytes: every tensor starts aligned for any dtype's view


class _Staging(threading.local):
    """A thread's pinned host buffer for `move_packed` and the event after its last copy."""

    tensor: torch.Tensor | None = None
    array: np.ndarray | None = None
    done: torch.cuda.Event | None = None


_STAGING = _Staging()


def packed_layout(tensors: list[torch.Tensor]) -> tuple[list[int], int]:
    """(byte offset of each tensor, total bytes) of `tensors` laid out one after another, each
    start aligned to PACKED_ALIGN."""
    offsets, at = [], 0
    for tensor in tensors:
        offsets.append(at)
        at += -(-tensor.numel() * tensor.element_size() // PACKED_ALIGN) * PACKED_ALIGN
    return offsets, at


def lay_out(tensors: list[torch.Tensor], array: np.ndarray, offsets: list[int]) -> None:
    """The bytes of contiguous host tensors into the uint8 `array` at `offsets` (`packed_layout`)."""
    for tensor, offset in zip(tensors, offsets):
        if tensor.numel():
            raw = tensor.view(torch.uint8).numpy().reshape(-1)  # bytes of any dtype (bf16 too)
            array[offset:offset + raw.size] = raw


def packed_views(buffer: torch.Tensor, tensors: list[torch.Tensor], offsets: list[int]) -> list[torch.Tensor]:
    """Views of the uint8 `buffer` at `offsets` (`packed_layout`) with the shapes and dtypes of
    `tensors`."""
    return [buffer[offset:offset + tensor.numel() * tensor.element_size()].view(tensor.dtype).view(tensor.shape)
            for tensor, offset in zip(tensors, offsets)]


def move_packed(tensors: list[torch.Tensor], target: torch.Tensor, offsets: list[int], total: int) -> None:
    """Copy contiguous host tensors into the uint8 CUDA buffer `target` at `offsets` (their
    `packed_layout`, `total` bytes at most PACKED_BYTES) in one copy that does not block the host:
    laid out first in a pinned buffer of this thread, which waits for its last copy to be read."""
    staging = _STAGING
    if staging.array is None or staging.array.nbytes < total:
        staging.tensor = torch.empty(max(total, PACKED_BYTES), dtype=torch.uint8).pin_memory()  # once a thread
        staging.array = staging.tensor.numpy()
        staging.done = None
    elif staging.done is not None:
        staging.done.synchronize()
    lay_out(tensors, staging.array, offsets)
    target[:total].copy_(staging.tensor[:total], non_blocking=True)
    staging.done = torch.cuda.Event()
    staging.done.record(torch.cuda.current_stream(target.device))  # the stream the copy went on


def prefix_groups(rows: list[Row]) -> list[tuple[int, list[int]]]:
    """(split, row indices) of each prefix worth sharing.

    Rows share a prefix when they have the same images and the same first `split` tokens,
    where split is the row's whole common beginning, never past its first candidate marker
    (every candidate stays in the row's own part). A prefix serves at least two rows and is at
    least SHARED_MIN tokens long; other rows run whole. The delta-rule kernels carry state
    across any split, so a row computes none of its shared tokens again.
    """
    by_key: dict[tuple, list[int]] = {}
    for index, row in enumerate(rows):
        split = min(row.shared, min(row.markers, default=0))
        if split >= SHARED_MIN:
            by_key.setdefault((row.images, row.input_ids[:split]), []).append(index)
    return [(len(key[1]), members) for key, members in by_key.items() if len(members) > 1]


def image_blocks(row: Row, image_pad_id: int) -> list[tuple[int, int, int]]:
    """(start, height, width) of each of a row's image blocks' pad runs, in order."""
    blocks, at = [], 0
    for height, width in row.image_grids:
        start = row.input_ids.index(image_pad_id, at)
        blocks.append((start, height, width))
        at = start + height * width
    return blocks


def _image_tokens(row: Row, blocks: list[tuple[int, int, int]], begin: int, end: int,
                  feature_offsets: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Image-token positions of row[begin:end] (relative to begin) and their feature rows, int64
    arrays; `blocks` are the row's `image_blocks`. (Arrays, not lists: a 4-image request has
    about a thousand image tokens, which a list built item by item paid for on every request.)"""
    places, sources = [], []
    for image, (start, height, width) in zip(row.images, blocks):
        first, last = max(begin, start), min(end, start + height * width)
        if first < last:
            places.append(np.arange(first - begin, last - begin, dtype=np.int64))
            offset = feature_offsets[image] - start
            sources.append(np.arange(offset + first, offset + last, dtype=np.int64))
    return _joined(places), _joined(sources)


def _joined_pixels(carried: list[torch.Tensor], raw: bool) -> torch.Tensor | None:
    """The images' pixels, one after another: raw bytes flattened, patches stacked; one image's
    as they are (a new image of a request alone: its megabytes not copied again)."""
    if not carried:
        return None
    parts = [pixels.reshape(-1) for pixels in carried] if raw else carried
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _joined(parts: list[np.ndarray]) -> np.ndarray:
    """int64 arrays end to end (an empty one for none)."""
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def pack_rows(rows: list[Row], images: list[EncodedImage], image_pad_id: int) -> Batch:
    """Pack rows into one batch, planning shared prefixes; `images` are those the rows'
    `image` indices name."""
    if not rows:
        raise ValueError("a batch needs at least one row")
    feature_offsets = [0]
    for image in images:
        feature_offsets.append(feature_offsets[-1] + image.tokens)
    groups = prefix_groups(rows)
    parents, splits = [-1] * len(rows), [0] * len(rows)
    for group, (split, members) in enumerate(groups):
        for index in members:
            parents[index], splits[index] = group, split

    # Plain lists, one tensor per field at the end: per-row tensors cost more than the rows. Text
    # advances the three M-RoPE axes together, so the positions are one line built at the end from
    # each piece's shift (its first position less its place on the token axis) and length; a
    # piece holding image tokens has its own [3, n] positions laid over the line.
    ids: list[int] = []
    shifts: list[int] = []
    spans: list[int] = []
    explicit: list[tuple[int, np.ndarray]] = []  # (place, positions [3, n]) of pieces with images
    slot_positions: list[np.ndarray] = []
    slot_sources: list[np.ndarray] = []
    prefix_lengths = [split for split, _ in groups]
    prefix_tokens = sum(prefix_lengths)
    lengths = [len(row.input_ids) for row in rows]
    own_lengths = [length - split for length, split in zip(lengths, splits)]
    # The pieces in order: each prefix once (from its first row), then each row past its split.
    segments = [(rows[members[0]], 0, split) for split, members in groups] + list(zip(rows, splits, lengths))
    for row, begin, end in segments:  # inline, no call a piece: a request's rows are most of its host time
        offset = len(ids)
        ids.extend(row.input_ids[begin:end])
        shift = begin - offset
        if row.image_grids:
            if end == len(row.input_ids) and image_pad_id not in row.input_ids[begin:end]:
                # All after the images: each leaves max(h, w) positions where it holds h w tokens.
                shift += sum(max(height, width) - height * width for height, width in row.image_grids)
            else:
                blocks = image_blocks(row, image_pad_id)
                explicit.append((offset, _mrope(blocks, len(row.input_ids))[:, begin:end]))
                places, sources = _image_tokens(row, blocks, begin, end, feature_offsets)
                slot_positions.append(places + offset)
                slot_sources.append(sources)
        shifts.append(shift)
        spans.append(end - begin)
    # Each row's markers move by its start on the rows' axis less its split, laid out [B, K] by
    # one boolean assignment (row-major, as they are listed), zero where a row has fewer.
    counts = np.fromiter(map(len, (row.markers for row in rows)), dtype=np.int64, count=len(rows))
    candidates = np.arange(int(counts.max()))[None, :] < counts[:, None]
    starts = np.cumsum(own_lengths) - np.asarray(own_lengths) - np.asarray(splits)
    placed = np.zeros(candidates.shape, dtype=np.int64)
    placed[candidates] = np.fromiter(itertools.chain.from_iterable(row.markers for row in rows), dtype=np.int64,
                                     count=int(counts.sum())) + np.repeat(starts, counts)
    markers, candidate_mask = torch.from_numpy(placed), torch.from_numpy(candidates)

    carried = [image.pixel_values for image in images if image.pixel_values is not None]
    kinds = {image.settings for image in images if image.pixel_values is not None}
    if len(kinds) > 1:
        raise ValueError("a batch's images come from one template: their pixel settings differ")
    settings = kinds.pop() if kinds else None
    raw = settings is not None
    prefix_cu, row_cu = cumulative(prefix_lengths), cumulative(own_lengths)
    grid = torch.cat([image.grid_thw for image in images]) if images else None
    return Batch(
        input_ids=torch.from_numpy(np.fromiter(ids, dtype=np.int64, count=len(ids))),  # twice np.asarray's speed
        position_ids=_positions(shifts, spans, len(ids), explicit),
        prefix_tokens=prefix_tokens,
        # The *_cpu fields are the same host tensors: `to` moves the others, never these.
        prefix_cu_seqlens=prefix_cu, prefix_cu_seqlens_cpu=prefix_cu, cu_seqlens=row_cu, cu_seqlens_cpu=row_cu,
        prefix_chunk_indices=chunk_plan(prefix_lengths), chunk_indices=chunk_plan(own_lengths),
        fork=plan_fork(prefix_lengths, own_lengths, parents) if groups else None,
        markers=markers, candidate_mask=candidate_mask, image_slots=torch.from_numpy(_joined(slot_positions)),
        image_sources=torch.from_numpy(_joined(slot_sources)),
        pixel_values=_joined_pixels(carried, raw),
        image_grid_thw_cpu=grid,
        image_keys=tuple(image.key for image in images),
        image_has_pixels=tuple(image.pixel_values is not None for image in images),
        input_tokens=sum(lengths),
        pixel_settings=settings if raw else None,
        image_shapes_cpu=_longs([list(pixels.shape) for pixels in carried]).reshape(-1, 3) if raw and carried
        else None,
    )


def _positions(shifts: list[int], spans: list[int], tokens: int, explicit: list[tuple[int, np.ndarray]]
               ) -> torch.Tensor:
    """[3, tokens] int64 positions of `pack_rows`' pieces: token i of the axis has position i plus
    its piece's shift, except in the pieces with images, whose own positions are given at their
    place."""
    line = np.arange(tokens, dtype=np.int64) + np.repeat(np.asarray(shifts, dtype=np.int64), spans)
    positions = np.broadcast_to(line, (3, tokens)).copy()
    for place, given in explicit:
        positions[:, place:place + given.shape[1]] = given
    return torch.from_numpy(positions)


def _longs(values: list) -> torch.Tensor:
    """int64 tensor of (nested) integer lists; numpy converts long lists several times faster."""
    return torch.from_numpy(np.asarray(values, dtype=np.int64))


def mrope_positions(row: Row, length: int, image_pad_id: int) -> torch.Tensor:
    """[3, length] M-RoPE positions: text advances all three axes together; an image's tokens
    take (p, p + h, p + w), p the position its block starts at, and the text after it resumes
    at p + max(H, W)."""
    return torch.from_numpy(_mrope(image_blocks(row, image_pad_id), length))


def _mrope(blocks: list[tuple[int, int, int]], length: int) -> np.ndarray:
    """`mrope_positions` in numpy (int64) from a row's `image_blocks`: a dozen small torch
    operations cost several times more."""
    positions = np.broadcast_to(np.arange(length, dtype=np.int64), (3, length)).copy()
    shift = 0  # what the blocks so far took from the positions after them
    for start, height, width in blocks:
        count = height * width
        first = start + shift
        positions[:, start:start + count] = first
        positions[1, start:start + count] += np.repeat(np.arange(height), width)
        positions[2, start:start + count] += np.tile(np.arange(width), height)
        shift += max(height, width) - count
        positions[:, start + count:] = np.arange(start + count, length) + shift
    return positions
