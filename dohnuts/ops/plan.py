"""Host-side plans of packed sequences: cumulative lengths, 64-token chunk plans and prefix forks.

Made on the host, in numpy (plain Python for a few sequences; a request's plans are on its
critical path), so that no kernel synchronises with the device to find its way.
flash-linear-attention keeps the same kind of helpers in `fla/ops/utils/index.py`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

CHUNK = 64  # the delta-rule kernels' chunk size


@dataclass(frozen=True)
class Fork:
    """How packed rows continue shared prefixes; planned on the host by `plan_fork`.

    The token axis holds the prefixes' tokens first, then the rows' own tokens. Attention sees
    G + N sequences, the prefixes then the rows, each row's keys being its prefix's tokens
    followed by its own.

    parents: [N] the prefix each row continues, -1 for none.
    cu_seqlens_q: [G + N + 1] int32 cumulative query counts of those sequences.
    key_index: [Tk] each sequence's keys as indices into the token axis.
    cu_seqlens_k: [G + N + 1] int32 cumulative key counts.
    max_seqlen_q, max_seqlen_k: the longest of each (host ints).
    orphans: whether some row continues no prefix (host bool; the forked states then need a
        zero state for it).
    """

    parents: torch.Tensor
    cu_seqlens_q: torch.Tensor
    key_index: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    orphans: bool = True

    def tensors(self) -> list[torch.Tensor]:
        return [self.parents, self.cu_seqlens_q, self.key_index, self.cu_seqlens_k]

    def plan(self) -> tuple:
        """The host values the work depends on (besides tensor shapes)."""
        return self.max_seqlen_q, self.max_seqlen_k, self.orphans

    def map(self, move) -> Fork:
        """The same fork with `move` applied to its tensors (device copies, pinning)."""
        return Fork(*(move(tensor) for tensor in self.tensors()), *self.plan())


# Up to this many sequences given as a list, the plans below are built in plain Python, then one
# numpy array: numpy's half a dozen calls cost a request of one or two sequences twice as much
# host time (8 against 4 us for a chunk plan on this project's CPU, three to five times that on
# the H200's hosts), and torch.tensor of a list half again numpy's.
FEW_SEQUENCES = 4


def chunk_plan(lengths, chunk_size: int = CHUNK) -> torch.Tensor:
    """[chunks, 2] int32 (sequence, chunk within it) of every chunk of packed sequences: the
    plan flash-linear-attention's varlen kernels walk."""
    if isinstance(lengths, list) and len(lengths) <= FEW_SEQUENCES:
        pairs = [value for sequence, length in enumerate(lengths)
                 for chunk in range(-(-int(length) // chunk_size)) for value in (sequence, chunk)]
        return torch.from_numpy(np.array(pairs, dtype=np.int32).reshape(-1, 2))
    counts = -(-np.asarray(lengths, dtype=np.int64).reshape(-1) // chunk_size)
    firsts = np.cumsum(counts) - counts  # each sequence's first row in the plan
    plan = np.empty((int(counts.sum()), 2), dtype=np.int32)
    plan[:, 0] = np.repeat(np.arange(len(counts)), counts)
    plan[:, 1] = np.arange(len(plan)) - np.repeat(firsts, counts)
    return torch.from_numpy(plan)


def padded_plan(lengths: list[int], chunks: int) -> torch.Tensor:
    """`chunk_plan(lengths)` padded to `chunks` entries with entries naming the last sequence,
    which must be empty (kernels skip a chunk past its sequence's end): the fixed-size plan a
    CUDA graph of a bucket reads.

    Raises:
        ValueError: the last sequence holds tokens, or the plan needs more than `chunks`.
    """
    counts = -(-np.asarray(lengths, dtype=np.int64) // CHUNK)
    used = int(counts.sum())
    if not lengths or lengths[-1] != 0 or used > chunks:
        raise ValueError(f"a plan padded to {chunks} chunks needs an empty last sequence and at most that many "
                         f"chunks: {len(lengths)} sequences make {used}")
    # Built in place (a bucket's plan is on a new request's critical path): each chunk's
    # sequence, then its place in it, the padding naming the last sequence's chunk 0.
    plan = np.empty((chunks, 2), dtype=np.int32)
    plan[:used, 0] = np.repeat(np.arange(len(counts), dtype=np.int32), counts)
    plan[used:, 0] = len(lengths) - 1
    plan[:used, 1] = np.arange(used, dtype=np.int32) - np.repeat(np.cumsum(counts) - counts, counts)
    plan[used:, 1] = 0
    return torch.from_numpy(plan)


def cumulative(lengths) -> torch.Tensor:
    """[N + 1] int32 cumulative sums of `lengths`, from 0."""
    if isinstance(lengths, list) and len(lengths) <= FEW_SEQUENCES:
        return torch.from_numpy(np.array([0, *itertools.accumulate(int(length) for length in lengths)], dtype=np.int32))
    bounds = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=bounds[1:])
    return torch.from_numpy(bounds)


def plan_fork(prefix_lengths: list[int], row_lengths: list[int], parents: list[int]) -> Fork:
    """The `Fork` of rows (own lengths `row_lengths`) continuing prefixes of `prefix_lengths`."""
    groups, rows = len(prefix_lengths), len(row_lengths)
    parent_of = np.asarray(parents, dtype=np.int64).reshape(-1)
    # One array of every sequence's length, prefixes then rows, and its cumulative sums: the
    # query counts, and where each prefix's and each row's own tokens start on the token axis.
    query_counts = np.empty(groups + rows, dtype=np.int64)
    query_counts[:groups], query_counts[groups:] = prefix_lengths, row_lengths
    query_cu = np.zeros(groups + rows + 1, dtype=np.int64)
    np.cumsum(query_counts, out=query_cu[1:])
    # A row without a prefix (parent -1) inherits an empty one: index G, of length 0.
    lookup = np.where(parent_of >= 0, parent_of, groups)
    inherited = np.zeros(groups + 1, dtype=np.int64)
    inherited[:groups] = query_counts[:groups]
    inherited = inherited[lookup]
    # The key segments in order: each prefix's tokens, then per row its prefix's tokens and its own.
    segment_starts = np.empty(groups + 2 * rows, dtype=np.int64)
    segment_lengths = np.empty(groups + 2 * rows, dtype=np.int64)
    segment_starts[:groups], segment_lengths[:groups] = query_cu[:groups], query_counts[:groups]
    segment_starts[groups::2], segment_lengths[groups::2] = query_cu[lookup], inherited
    segment_starts[groups + 1::2], segment_lengths[groups + 1::2] = query_cu[groups:-1], query_counts[groups:]
    # Entry i of a segment placed at offset o that starts at token s is token s + (i - o).
    ends = np.cumsum(segment_lengths)
    key_index = np.arange(int(ends[-1]) if len(ends) else 0, dtype=np.int64) + np.repeat(
        segment_starts - ends + segment_lengths, segment_lengths)
    key_counts = query_counts.copy()
    key_counts[groups:] += inherited
    key_cu = np.zeros(groups + rows + 1, dtype=np.int32)
    np.cumsum(key_counts, out=key_cu[1:])
    return Fork(torch.from_numpy(parent_of.copy()), torch.from_numpy(query_cu.astype(np.int32)),
                torch.from_numpy(key_index), torch.from_numpy(key_cu), int(query_counts.max(initial=0)),
                int(key_counts.max(initial=0)), bool((parent_of < 0).any()))
