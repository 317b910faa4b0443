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
    plan = chunk_plan(lengths)
    if not lengths or lengths[-1] != 0 or len(plan) > chunks:
        raise ValueError(f"a plan padded to {chunks} chunks needs an empty last sequence and at most that many "
                         f"chunks: {len(lengths)} sequences make {len(plan)}")
    padding = torch.tensor([[len(lengths) - 1, 0]], dtype=plan.dtype).expand(chunks - len(plan), 2)
    return torch.cat([plan, padding])


def cumulative(lengths) -> torch.Tensor:
    """[N + 1] int32 cumulative sums of `lengths`, from 0."""
    if isinstance(lengths, list) and len(lengths) <= FEW_SEQUENCES:
        return torch.from_numpy(np.array([0, *itertools.accumulate(int(length) for length in lengths)], dtype=np.int32))
    bounds = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=bounds[1:])
    return torch.from_numpy(bounds)


def plan_fork(prefix_lengths: list[int], row_lengths: list[int], parents: list[int]) -> Fork:
    """The `Fork` of rows (own lengths `row_lengths`) continuing prefixes of `prefix_lengths`."""
    prefix_lengths, row_lengths = np.asarray(prefix_lengths, dtype=np.int64), np.asarray(row_lengths, dtype=np.int64)
    parent_of = np.asarray(parents, dtype=np.int64).reshape(-1)
    prefix_starts = np.concatenate([[0], np.cumsum(prefix_lengths)])
    row_starts = prefix_starts[-1] + np.concatenate([[0], np.cumsum(row_lengths)[:-1]])
    # A row without a prefix (parent -1) inherits an empty one: index G, of length 0.
    lookup = np.where(parent_of >= 0, parent_of, len(prefix_lengths))
    inherited = np.append(prefix_lengths, 0)[lookup]
    # The key segments in order: each prefix's tokens, then per row its prefix's tokens and its own.
    segment_starts = np.concatenate([prefix_starts[:-1], np.stack([prefix_starts[lookup], row_starts], 1).ravel()])
    segment_lengths = np.concatenate([prefix_lengths, np.stack([inherited, row_lengths], 1).ravel()])
    # Entry i of a segment placed at offset o that starts at token s is token s + (i - o).
    offsets = np.concatenate([[0], np.cumsum(segment_lengths)[:-1]])
    key_index = np.arange(segment_lengths.sum(), dtype=np.int64) + np.repeat(segment_starts - offsets, segment_lengths)
    query_counts = np.concatenate([prefix_lengths, row_lengths])
    key_counts = np.concatenate([prefix_lengths, inherited + row_lengths])
    return Fork(torch.from_numpy(parent_of.copy()), cumulative(query_counts), torch.from_numpy(key_index),
                cumulative(key_counts), int(query_counts.max(initial=0)), int(key_counts.max(initial=0)),
                bool((parent_of < 0).any()))
