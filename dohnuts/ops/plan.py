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


class ForkPlan:
    """What a fork's kinds share: its device tensors (`tensors`, its first fields) and the host
    values its work depends on besides their shapes (`plan`, the rest), and `map`."""

    def tensors(self) -> list[torch.Tensor]:
        raise NotImplementedError

    def plan(self) -> tuple:
        raise NotImplementedError

    def map(self, move):
        """The same fork with `move` applied to its tensors (device copies, pinning)."""
        return type(self)(*(move(tensor) for tensor in self.tensors()), *self.plan())


@dataclass(frozen=True)
class Fork(ForkPlan):
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
        return self.max_seqlen_q, self.max_seqlen_k, self.orphans


@dataclass(frozen=True)
class ChunkedFork(ForkPlan):
    """How the rows of a batch padded to a bucket continue its prefixes, planned by 64-token
    chunk (`plan_chunked_fork`), so that attention's work has the bucket's shapes, not the
    batch's, and a CUDA graph captures it. A `Fork` gathers each row's keys (its prefix's, then
    its own) into one sequence, whose count of keys is the batch's; here attention runs in two
    calls of fixed sizes, merged by their log-sum-exps (`kernels.chunked_fork_attention`):

    - own: every chunk of the token axis (the prefixes' chunks, then the rows') sees the keys of
      its sequence up to its end, causally (aligned bottom-right);
    - cross: every chunk of the rows sees all of its row's prefix, none for a row without one.

    Each call is flash attention over chunks of at most 64 queries whose keys start where their
    sequence (or prefix) starts (`seqused_k` keys from there): its grid is the bucket's chunks,
    not its sequences times the longest, which padding sequences made large.

    parents: [N] the prefix each row continues, -1 for none (the delta rule's fork).
    own_q: [C + 1] int32 where each chunk's queries start on the token axis, then its end.
    own_k: [C + 1] int32 where each chunk's keys start (its sequence's first token); the last unread.
    own_used: [C] int32 keys each chunk sees.
    cross_q, cross_k, cross_used: the same for the rows' chunks on the rows' part of the axis
        (queries from the first row token on) against the prefix part's keys.
    max_keys, max_prefix: bounds on own_used and cross_used (host ints: the bucket's).
    """

    parents: torch.Tensor
    own_q: torch.Tensor
    own_k: torch.Tensor
    own_used: torch.Tensor
    cross_q: torch.Tensor
    cross_k: torch.Tensor
    cross_used: torch.Tensor
    max_keys: int
    max_prefix: int
    orphans: bool = True

    def tensors(self) -> list[torch.Tensor]:
        return [self.parents, self.own_q, self.own_k, self.own_used, self.cross_q, self.cross_k, self.cross_used]

    def plan(self) -> tuple:
        return self.max_keys, self.max_prefix, self.orphans

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


def _chunk_spans(plan: torch.Tensor, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each chunk of a padded chunk plan [chunks, 2] (sequence, chunk within it) over sequences
    starting at `starts` [N + 1]: its first token, its end and its sequence's first token (a
    padding chunk names the empty last sequence: it starts and ends at the part's end)."""
    of, index = plan.numpy().T
    opening = starts[of]
    first = opening + CHUNK * index
    return first, np.minimum(first + CHUNK, starts[of + 1]), opening


def plan_chunked_fork(prefix_lengths: list[int], row_lengths: list[int], parents: list[int],
                      prefix_plan: torch.Tensor, row_plan: torch.Tensor, max_prefix: int,
                      longest_row: int) -> ChunkedFork:
    """The `ChunkedFork` of rows (own lengths `row_lengths`, continuing `parents`) after
    prefixes of `prefix_lengths`, by the chunks of their padded chunk plans (`padded_plan`,
    whose padding names an empty last sequence); the bounds are a bucket's: its prefix tokens
    and its longest row. In numpy, its tensors views of one int32 array: a new request's
    padding is on its critical path."""
    prefix_starts, row_starts = cumulative(prefix_lengths).numpy(), cumulative(row_lengths).numpy()
    total, row_tokens = int(prefix_starts[-1]), int(row_starts[-1])
    prefix_first, prefix_end, prefix_key = _chunk_spans(prefix_plan, prefix_starts)
    row_first, row_end, row_key = _chunk_spans(row_plan, row_starts)
    # A row chunk's prefix is its row's parent's; a row without one (padding too) sees no keys
    # there. The key starts end with an entry flash attention's shape check wants and never
    # reads (`seqused_k` gives every length).
    parent_of = np.asarray(parents, dtype=np.int64).reshape(-1)
    parent = parent_of[row_plan.numpy()[:, 0]]
    has, known = parent >= 0, np.maximum(parent, 0)
    parts = [prefix_first, total + row_first, [total + row_tokens],  # own: queries
             prefix_key, total + row_key, [0],  # own: where the keys start
             prefix_end - prefix_key, row_end - row_key,  # own: how many
             row_first, [row_tokens],  # cross: queries
             np.where(has, prefix_starts[known], 0), [0],  # cross: where the prefix starts
             np.where(has, prefix_starts[known + 1] - prefix_starts[known], 0)]  # cross: how many
    chunks, rows = len(prefix_first) + len(row_first), len(row_first)
    tensors = torch.from_numpy(np.concatenate(parts).astype(np.int32)).split(
        [chunks + 1, chunks + 1, chunks, rows + 1, rows + 1, rows])
    return ChunkedFork(torch.from_numpy(parent_of), *tensors, max(max_prefix, longest_row), max_prefix,
                       bool((parent_of < 0).any()))
