"""The plan of the delta rule walked in segments (`ops.delta_rule.segments.runs_of`), on the CPU:
its runs, and the tokens and chunk-plan entries each later run's fixes read, against a plain
per-run layout. The walk itself runs under Triton's interpreter (triton_interpreted.py)."""

import random

import pytest
import torch

from dohnuts.ops.delta_rule.segments import runs_of, segment_lengths, segment_plan
from dohnuts.ops.plan import CHUNK, chunk_plan, padded_plan


def _expected(lengths, segments):
    """(runs, [tokens of each later run], [chunk entries of each later run]) laid out run by run."""
    runs = segment_lengths(lengths, segments)
    tokens, chunks, token, entry = [], [], 0, 0
    for index, size in enumerate(runs):
        count = -(-size // CHUNK)
        if index % segments:
            tokens.append(list(range(token, token + size)))
            chunks.append(list(range(entry, entry + count)))
        token, entry = token + size, entry + count
    return runs, tokens, chunks


def _rows(table, sentinel):
    """Each row's values before its padding, which must fill the rest of the row."""
    rows = []
    for row in table.tolist():
        kept = [value for value in row if value != sentinel]
        assert row == kept + [sentinel] * (len(row) - len(kept)), row
        rows.append(kept)
    return rows


def _names_its_own_chunks(plan, lengths, segments):
    """Each later run's entries name, in the sequences' own chunk plan, its sequence and the
    chunks from its start on."""
    table = chunk_plan(lengths).tolist()
    rows = _rows(plan.entries, len(table))
    starts = (plan.run_cu[:-1].view(len(lengths), segments) - plan.run_cu[:-1].view(len(lengths), segments)[:, :1])
    for row, (sequence, index) in zip(rows, [(n, j) for n in range(len(lengths)) for j in range(1, segments)]):
        first = int(starts[sequence, index]) // CHUNK
        assert [table[entry] for entry in row] == [[sequence, first + chunk] for chunk in range(len(row))]


@pytest.mark.parametrize("segments", [1, 2, 3, 8])
def test_runs_of_lays_out_whole_chunks_and_the_fixes_indices_as_a_plain_layout(segments):
    generator = random.Random(segments)
    for _ in range(40):
        lengths = [generator.choice([0, 1, 63, 64, 65, 130, generator.randrange(1, 3000)])
                   for _ in range(generator.randrange(1, 6))]
        plan = segment_plan(lengths, segments, "cpu")
        total, entries = sum(lengths), len(chunk_plan(lengths))
        runs, tokens, chunks = _expected(lengths, segments)
        assert (plan.run_cu[1:] - plan.run_cu[:-1]).tolist() == runs
        for first in range(0, len(runs), segments):  # each non-empty run starts a chunk of its sequence
            own = runs[first:first + segments]
            assert all(sum(own[:index]) % CHUNK == 0 for index, size in enumerate(own) if size)
        assert _rows(plan.tokens, total) == tokens and _rows(plan.entries, entries) == chunks
        assert plan.tokens.shape[0] == plan.entries.shape[0] == len(lengths) * (segments - 1)
        _names_its_own_chunks(plan, lengths, segments)


def test_a_buckets_plan_pads_with_its_own_shapes():
    """As a bucket's graph would make it: a padded chunk plan, a last empty sequence and a bound
    on lengths above the longest: the same runs, padded with the bucket's token and entry counts."""
    lengths, segments = [700, 90, 0], 4
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    plan = runs_of(cu, padded_plan(lengths, 20), segments, longest=2048, total=1024)
    runs, tokens, chunks = _expected(lengths, segments)
    assert (plan.run_cu[1:] - plan.run_cu[:-1]).tolist() == runs
    assert plan.tokens.shape == (len(lengths) * (segments - 1), 2048 // segments)
    assert _rows(plan.tokens, 1024) == tokens and _rows(plan.entries, 20) == chunks


def test_fewer_than_one_segment_is_refused():
    with pytest.raises(ValueError, match="segments must be at least 1"):
        segment_plan([10], 0, "cpu")
