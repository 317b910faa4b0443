"""Shape buckets: a request met for the first time still replays a captured CUDA graph.

A graph replays fixed kernel launches, so it serves exactly one batch layout, and almost every
request of real traffic brings a layout never seen before (its state's length, its number of
questions). Run eagerly, such a request costs some 30 to 45 ms of host work on the H200 for a
few milliseconds of device work (docs/changelog.md). A bucket fixes every shape the graph's work
depends on, and `pad_to_bucket` brings any batch under it there:

- the prefix part holds `prefix_tokens` (P*) tokens in `prefixes` (G*) sequences: the real
  prefixes (at least 64 tokens each), then padding prefixes of the remaining tokens (at most 64
  tokens each), then empty ones; its chunk plan is padded with entries of an empty prefix to
  `prefix_chunks` (a prefix's last chunk may be partial, so the count varies);
- the rows' part holds `row_tokens` (S*) tokens in `rows` (N*) sequences: the real rows, then
  padding rows of the remaining tokens (at most 64 tokens each), then empty ones; its chunk plan
  is padded with entries of an empty row to `row_chunks`; a one-row bucket (`single`) has no
  prefix part and holds one row, then its padding as one sequence, then an empty row;
- markers and the candidate mask are [rows, candidates]; padding rows have no candidate.

Padding sequences are short so that they never outlast the real ones in the delta rule's walk,
whose sequences run in parallel, each part after part (a one-row bucket's padding is shorter
than any row it is the smallest fit for). Padding tokens are real tokens of padding sequences
(so every kernel writes every output) that no candidate reads: the rows' logits are those of
the batch alone, up to floating-point order. Only the device contents of the plan change within
a bucket; what the kernels decide on the host (grid sizes, the longest row) is the bucket's,
and the delta rule's walk picks its path on the device from the real sequences (`Segments.
routed`), since the bucket's count of sequences is its padding's. Attention, whose keys per row
(its prefix's, then its own) are the batch's, is planned by 64-token chunk (`plan.ChunkedFork`):
each chunk's queries against its own sequence's keys, and each row's chunk against its prefix,
two calls whose grids are the bucket's chunk counts; so a bucket's forward is one graph
(`cuda_graphs`). A one-row bucket has no prefix: every sequence's keys are its own tokens.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from ..inputs.batch import SHARED_MIN, Batch
from ..ops.plan import CHUNK, chunk_plan, cumulative, padded_plan, plan_chunked_fork

# The sizes captured at load: prefix tokens, and the rows' tokens for short rows (at most 64
# own tokens, `delta_rule_rows`) and for long ones (`delta_rule_scan`). Each is twice the one
# before, so padding adds less than the batch itself (finer below FINE_TOKENS). The serving mix
# (`bench.traffic`) has long rows (choices of up to 40 options) and prefixes of up to about
# 1,500 tokens, and a server fills a bucket with several requests: the long-row ladder reaches
# 8,192 tokens and the prefixes 4,096; the short-row buckets, met by short questions, stop at
# SHORT_ROW_TOKENS in all.
PREFIX_LADDER = (64, 128, 256, 512, 1024, 2048, 4096)
ROW_LADDER = (128, 256, 512, 1024, 2048, 4096)
LONG_ROW_LADDER = (128, 256, 512, 1024, 2048, 4096, 8192)
# One-row buckets (`Bucket.single`), for one long row and no shared prefix: a one-question
# request of a long state. Their padding is one sequence, shorter than the row, so the walk is
# the row's alone, planned on the host: a 1,287-token question in a long-row bucket of 2,048
# tokens (64% more, 193 row sequences, the walk routed on the device) took 14.2 ms on the H200,
# against 7.8 for its own graph. Such a request is alone in its batch, so its bucket's padding is
# all it computes beyond its own: steps of 128 tokens up to 2,048, then 256 up to 4,096, then
# 512 (at most 25% past 512 tokens, 12% past 1,024 and 6% past 2,048; the step before a graph's
# memory was freed after its capture, 2026-12-04, was half again the bucket below).
ONE_ROW_LADDER = (*range(128, 2048, 128), *range(2048, 4096, 256), *range(4096, 8193, 512))
# Buckets of at most FINE_TOKENS step finer: one request of the niche's real traffic
# (`bench.traffic.real_traffic`: a state of up to about 1,500 words, up to 20 questions of up to
# 40 options) is alone in its batch when it comes alone, and on the doubling ladders its padding
# was 48% of its tokens (the 80 requests of the benchmark's record); on the fine long-row ones,
# 15%. Short rows' prefixes step as finely: a state of four images (issue 40's `vision_protocol_images_4q`,
# a prefix of 1,052 tokens and short questions) padded to the 2,048-token prefix, 92% more,
# and took 11.9 ms on the H200 against 8.1 for its own graph (run `2026-12-06-3eaad48-b43-stage`).
# A bucket's pieces share their buffers (`cuda_graphs._Arena`), so it holds little memory of its own.
FINE_PREFIX_LADDER = (64, 128, 256, 384, 512, 768, 1024, 1280, 1536, 2048)
FINE_ROW_LADDER = (128, 256, 384, 512, 640, 768, 1024, 1280, 1536, 1792, 2048, 2560, 3072, 3584, 4096)
FINE_TOKENS = 4096
SHORT_ROW_TOKENS = 6144  # the most tokens of a short-row bucket
CANDIDATES = 64  # candidates a bucket's row may have
ROW_TOKENS = 64  # the longest short row (`ops.delta_rule.rows.ROW_TOKENS`)


@dataclass(frozen=True)
class Bucket:
    """Every shape a bucket's graph fixes (see the module's docstring). Its derived sizes are
    computed once: finding a batch's bucket reads them for several buckets (`Ladder`)."""

    prefix_tokens: int
    row_tokens: int
    long_rows: bool
    single: bool = False  # one row, its padding one sequence after it (`ONE_ROW_LADDER`)

    def __post_init__(self):
        if self.single:
            if not self.long_rows or self.prefix_tokens or self.row_tokens <= ROW_TOKENS:
                raise ValueError(f"a one-row bucket holds one long row and no prefix: got {self}")
        elif self.prefix_tokens < CHUNK or self.prefix_tokens % CHUNK or self.row_tokens < 1:
            raise ValueError(f"a bucket needs prefix tokens a positive multiple of {CHUNK} and row tokens: got {self}")

    @functools.cached_property
    def prefixes(self) -> int:
        # A real prefix has at least SHARED_MIN (64) tokens, a padding one at most 64 (one of them
        # partial); then an empty one. A one-row bucket has none.
        return 0 if self.single else self.prefix_tokens // SHARED_MIN + 2

    @functools.cached_property
    def prefix_chunks(self) -> int:
        """Chunks of any prefix layout: each real prefix and the partial padding one add at most
        one partial chunk to the prefix tokens' whole ones."""
        return 0 if self.single else self.prefix_tokens // CHUNK + self.prefix_tokens // SHARED_MIN + 1

    @functools.cached_property
    def rows(self) -> int:
        if self.single:
            return 3  # the row, its padding, an empty row
        return self.row_tokens // 8 + 1  # rows of 8 tokens on average fill it; one empty row at least

    @functools.cached_property
    def row_chunks(self) -> int:
        return self.rows if not self.long_rows else self.row_tokens // CHUNK + self.rows

    @functools.cached_property
    def longest_row(self) -> int:
        """The bound on a row the graph plans for: the delta rule's route and attention's
        longest row (its host decisions). Long rows may fill the bucket: forward only, the
        delta rule walks a sequence of any length (`delta_rule.scan.FORWARD_TOKENS` is None; a
        test holds it so), so no capture or replay routes to FLA, whose chunk plans a capture
        would memoise. (Bounded at the walk's gradient bound, 2,048 tokens, a one-question
        request of 2,787 tokens found no bucket and ran eagerly: 43 ms on the H200.)"""
        return self.row_tokens if self.long_rows else ROW_TOKENS

    @functools.cached_property
    def tokens(self) -> int:
        return self.prefix_tokens + self.row_tokens


def all_buckets() -> list[Bucket]:
    """The buckets captured at load, smallest first (`rank`)."""
    short = {(p, s) for p in PREFIX_LADDER for s in ROW_LADDER if p + s <= SHORT_ROW_TOKENS}
    short |= {(p, s) for p in FINE_PREFIX_LADDER for s in ROW_LADDER if p + s <= FINE_TOKENS}
    buckets = [Bucket(p, s, False) for p, s in short]
    long = {(p, s) for p in PREFIX_LADDER for s in LONG_ROW_LADDER}
    long |= {(p, s) for p in FINE_PREFIX_LADDER for s in FINE_ROW_LADDER if p + s <= FINE_TOKENS}
    buckets += [Bucket(p, s, True) for p, s in long]
    buckets += [Bucket(0, s, True, single=True) for s in ONE_ROW_LADDER]
    return sorted(buckets, key=rank)


def sequence_lengths(cu_seqlens_cpu: torch.Tensor) -> list[int]:
    """The lengths of packed sequences from their host cumulative lengths."""
    bounds = cu_seqlens_cpu.tolist()
    return [end - begin for begin, end in zip(bounds[:-1], bounds[1:])]


def _row_padding(bucket: Bucket, rows: int, tokens: int) -> list[int] | None:
    """The padding rows' lengths that bring `rows` rows of `tokens` tokens to the bucket, or
    None when they cannot."""
    if not _rows_fit(bucket, rows, tokens):
        return None
    spare = bucket.row_tokens - tokens
    if bucket.single:
        return [spare, 0]
    padding = _pieces(spare)
    return padding + [0] * (bucket.rows - rows - len(padding))


def _rows_fit(bucket: Bucket, rows: int, tokens: int) -> bool:
    """Whether padding rows can bring `rows` rows of `tokens` tokens to the bucket: a one-row
    bucket's one row; else padding rows of at most 64 tokens each, with the last row left
    empty (the padded chunk plan names it)."""
    spare, room = bucket.row_tokens - tokens, bucket.rows - rows
    if bucket.single:
        return rows == 1 and spare >= 0
    return spare >= 0 and -(-spare // ROW_TOKENS) < room


def _pieces(spare: int) -> list[int]:
    """`spare` padding tokens as sequences of at most ROW_TOKENS (64) tokens, the last one partial."""
    return [ROW_TOKENS] * (spare // ROW_TOKENS) + ([spare % ROW_TOKENS] if spare % ROW_TOKENS else [])


class Shape(NamedTuple):
    """What a bucket must hold of a batch: its prefix tokens and prefixes, its rows' own tokens
    and rows, its longest row and its most candidates a row. Shapes of batches packed together
    add (`join`), so a planner can tell whether requests fit a bucket before packing them."""

    prefix_tokens: int = 0
    prefixes: int = 0
    row_tokens: int = 0
    rows: int = 0
    longest_row: int = 0
    candidates: int = 0

    @property
    def tokens(self) -> int:
        return self.prefix_tokens + self.row_tokens

    def join(self, other: Shape) -> Shape:
        return Shape(self.prefix_tokens + other.prefix_tokens, self.prefixes + other.prefixes,
                     self.row_tokens + other.row_tokens, self.rows + other.rows,
                     max(self.longest_row, other.longest_row), max(self.candidates, other.candidates))


def joined(shapes: Iterable[Shape]) -> Shape:
    """The shape of batches packed together (`Shape.join` of all; the empty shape for none)."""
    return functools.reduce(Shape.join, shapes, Shape())


def batch_shape(batch: Batch) -> Shape:
    """The shape of a packed host batch."""
    rows = sequence_lengths(batch.cu_seqlens_cpu)
    return Shape(batch.prefix_tokens, len(sequence_lengths(batch.prefix_cu_seqlens_cpu)), sum(rows), len(rows),
                 max(rows), int(batch.markers.shape[1]))


def fits(shape: Shape, bucket: Bucket) -> bool:
    """Whether a batch of `shape` can be padded to `bucket` (`pad_to_bucket`)."""
    long_rows = shape.longest_row > ROW_TOKENS
    return (shape.row_tokens <= bucket.row_tokens and shape.candidates <= CANDIDATES and bucket.long_rows == long_rows
            and shape.prefix_tokens <= bucket.prefix_tokens
            and (shape.prefixes == 0 if bucket.single else shape.prefixes <= bucket.prefixes - 2)
            and shape.longest_row <= bucket.longest_row and _rows_fit(bucket, shape.rows, shape.row_tokens))


def rank(bucket: Bucket) -> tuple:
    """A bucket's place among others: fewer tokens first, a one-row bucket before another of its
    size, then fewer prefix tokens (a total order: the smallest fit does not depend on the order
    buckets are given in)."""
    return bucket.tokens, not bucket.single, bucket.prefix_tokens, bucket.long_rows


class Ladder:
    """Buckets in `rank` order with their token counts: a shape's smallest fit is the first that
    fits from the first bucket of at least its tokens (none with fewer can hold it), found by
    bisection. `smallest_fit` over every bucket read each of the 223 buckets of 2026-12-04 for
    every shape, 45 us on this project's CPU, twice a waiting request in the engine's batching."""

    def __init__(self, buckets):
        self.buckets = tuple(sorted(buckets, key=rank))
        self.tokens = [bucket.tokens for bucket in self.buckets]

    def smallest_fit(self, shape: Shape) -> Bucket | None:
        for index in range(bisect.bisect_left(self.tokens, shape.tokens), len(self.buckets)):
            if fits(shape, self.buckets[index]):
                return self.buckets[index]
        return None


def smallest_fit(shape: Shape, buckets) -> Bucket | None:
    """The smallest of `buckets` (a `Ladder`, or any collection) a batch of `shape` fits (a
    one-row bucket before another of its size), or None."""
    if isinstance(buckets, Ladder):
        return buckets.smallest_fit(shape)
    best = None
    for bucket in buckets:
        if (best is None or rank(bucket) < rank(best)) and fits(shape, bucket):
            best = bucket
    return best


def bucket_for(batch: Batch, buckets) -> Bucket | None:
    """The smallest of `buckets` the host batch fits, or None."""
    return smallest_fit(batch_shape(batch), buckets)


def pad_to_bucket(batch: Batch, bucket: Bucket, pad_id: int) -> Batch:
    """The host batch brought to `bucket`'s shapes (see the module's docstring); its first
    rows and candidates are the batch's, in order.

    Raises:
        ValueError: the batch does not fit the bucket.
    """
    prefix_lengths, row_lengths = sequence_lengths(batch.prefix_cu_seqlens_cpu), sequence_lengths(batch.cu_seqlens_cpu)
    if not fits(batch_shape(batch), bucket):  # the one rule `bucket_for` chose by
        raise ValueError(f"a batch of {batch.prefix_tokens} prefix tokens in {len(prefix_lengths)} prefixes and "
                         f"{len(row_lengths)} rows of {sum(row_lengths)} tokens (the longest {max(row_lengths)}) "
                         f"does not fit {bucket}")
    spare = bucket.prefix_tokens - batch.prefix_tokens
    rows = row_lengths + _row_padding(bucket, len(row_lengths), sum(row_lengths))
    row_plan = padded_plan(rows, bucket.row_chunks)
    prefixes, prefix_plan, fork = [], chunk_plan([]), None  # a one-row bucket's: its row runs alone
    if not bucket.single:
        padding = _pieces(spare)
        if len(prefix_lengths) + len(padding) >= bucket.prefixes:
            raise ValueError(f"{len(prefix_lengths)} prefixes and {len(padding)} padding ones leave no empty prefix "
                             f"in {bucket}")
        prefixes = prefix_lengths + padding + [0] * (bucket.prefixes - len(prefix_lengths) - len(padding))
        parents = (batch.fork.parents.tolist() if batch.fork is not None else [-1] * len(row_lengths))
        parents += [-1] * (len(rows) - len(row_lengths))  # the padding rows'
        prefix_plan = padded_plan(prefixes, bucket.prefix_chunks)
        fork = plan_chunked_fork(prefixes, rows, parents, prefix_plan, row_plan, bucket.prefix_tokens,
                                 bucket.longest_row)
    P, S = batch.prefix_tokens, batch.computed_tokens - batch.prefix_tokens

    # In numpy: a torch operation on the host costs several times a numpy one.
    def spread(values: torch.Tensor, fill: int) -> torch.Tensor:
        """values [..., P + S] -> [..., P* + S*]: the padding prefixes' tokens after the prefixes,
        the padding rows' after the rows."""
        source = values.numpy()
        out = np.full((*source.shape[:-1], bucket.tokens), fill, dtype=source.dtype)
        out[..., :P] = source[..., :P]
        out[..., bucket.prefix_tokens:bucket.prefix_tokens + S] = source[..., P:]
        return torch.from_numpy(out)

    def placed(values: torch.Tensor) -> torch.Tensor:
        """values [B, K] in the top left corner of zeros [rows, CANDIDATES]."""
        out = np.zeros((bucket.rows, CANDIDATES), dtype=values.numpy().dtype)
        out[:values.shape[0], :values.shape[1]] = values.numpy()
        return torch.from_numpy(out)

    slots = batch.image_slots.numpy()
    slots = torch.from_numpy(slots + np.where(slots >= P, spare, 0))
    markers, mask = placed(batch.markers), placed(batch.candidate_mask)
    prefix_cu, row_cu = cumulative(prefixes), cumulative(rows)
    return dataclasses.replace(
        batch, input_ids=spread(batch.input_ids, pad_id), position_ids=spread(batch.position_ids, 0),
        prefix_tokens=bucket.prefix_tokens, prefix_cu_seqlens=prefix_cu, prefix_cu_seqlens_cpu=prefix_cu,
        cu_seqlens=row_cu, cu_seqlens_cpu=row_cu, prefix_chunk_indices=prefix_plan,
        chunk_indices=row_plan, fork=fork, markers=markers,
        candidate_mask=mask, image_slots=slots, rows_bound=bucket.longest_row, lone_row=bucket.single)


def empty_batch(bucket: Bucket, pad_id: int) -> Batch:
    """A host batch of `bucket` holding only padding: what its graph is captured on."""
    ids = torch.full((1,), pad_id, dtype=torch.long)
    one = cumulative([1])
    none = torch.zeros(0, dtype=torch.long)
    seed = Batch(input_ids=ids, position_ids=torch.zeros(3, 1, dtype=torch.long), prefix_tokens=0,
                 prefix_cu_seqlens=cumulative([]), prefix_cu_seqlens_cpu=cumulative([]), cu_seqlens=one,
                 cu_seqlens_cpu=one, prefix_chunk_indices=chunk_plan([]), chunk_indices=chunk_plan([1]), fork=None,
                 markers=torch.zeros(1, 1, dtype=torch.long), candidate_mask=torch.zeros(1, 1, dtype=torch.bool),
                 image_slots=none, image_sources=none, pixel_values=None, image_grid_thw_cpu=None, image_keys=(),
                 image_has_pixels=(), input_tokens=0)
    if bucket.long_rows:  # a row over 64 tokens, as the bucket's batches have
        ids = torch.full((ROW_TOKENS + 1,), pad_id, dtype=torch.long)
        own = cumulative([ROW_TOKENS + 1])
        seed = dataclasses.replace(seed, input_ids=ids, position_ids=torch.zeros(3, len(ids), dtype=torch.long),
                                   cu_seqlens=own, cu_seqlens_cpu=own, chunk_indices=chunk_plan([ROW_TOKENS + 1]))
    return pad_to_bucket(seed, bucket, pad_id)


def padding_tokens(batch: Batch, bucket: Bucket) -> int:
    """Tokens a bucket adds to a batch: computed, but no useful work."""
    return bucket.tokens - batch.computed_tokens

