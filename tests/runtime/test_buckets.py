"""Shape buckets: a padded batch gives its rows the logits of the batch alone (float32, the
plain-PyTorch path), and the padding keeps every shape the bucket fixes."""

import pytest
import torch
from helpers import LAYOUTS, batch_of, questions

from dohnuts.model.base import load_backbone
from dohnuts.model.decision import new_head
from dohnuts.ops import attention as attention_ops
from dohnuts.ops import kernels
from dohnuts.runtime.buckets import (
    CANDIDATES,
    ROW_TOKENS,
    Bucket,
    all_buckets,
    batch_shape,
    bucket_for,
    empty_batch,
    fits,
    pad_to_bucket,
)
from dohnuts.runtime.checkpoint import assemble


@pytest.fixture(scope="module")
def parts(tiny):
    backbone = load_backbone(tiny.base, torch.float32).eval()
    model = assemble(backbone, new_head(backbone.config.text_config.hidden_size, 0.5)).eval()
    return tiny.template(), model


@pytest.mark.parametrize("dense", [False, True], ids=["each sequence", "one sequence"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_padded_batch_gives_its_rows_the_logits_of_the_batch_alone(parts, name, dense, monkeypatch):
    """A one-row bucket's attention, `kernels.lone_row_attention`, runs each sequence apart or,
    with `attention.DENSE_LONE` (on by default), the whole bucket as one sequence
    (counted by the sequences its attention calls see)."""
    template, model = parts
    batch = batch_of(template, LAYOUTS[name])
    bucket = bucket_for(batch, all_buckets())
    assert bucket is not None
    assert bucket.long_rows == (int(batch.cu_seqlens_cpu.diff().max()) > ROW_TOKENS)
    assert bucket.long_rows or name != "long rows"
    assert bucket.single or name != "one long row"
    padded = pad_to_bucket(batch, bucket, template.pad_id)
    assert padded.computed_tokens == bucket.tokens > batch.computed_tokens
    monkeypatch.setattr(attention_ops, "DENSE_LONE", dense)
    with torch.no_grad():
        alone = model(batch)
        sequences = []  # of each attention call: tokens and sequences, or chunks of a chunked fork
        plain, chunked = kernels.attention, kernels.chunked_fork_attention
        monkeypatch.setattr(kernels, "attention", lambda q, k, v, cu, *rest: sequences.append(
            (q.shape[0], len(cu) - 1)) or plain(q, k, v, cu, *rest))
        monkeypatch.setattr(kernels, "chunked_fork_attention", lambda q, k, v, fork, *rest: sequences.append(
            (q.shape[0], "chunks", len(fork.own_used))) or chunked(q, k, v, fork, *rest))
        inside = model(padded)
    layers = model.backbone.config.text_config.layer_types.count("full_attention")
    assert len(sequences) == layers
    if bucket.single:  # its row, its padding and an empty row; or all as one
        assert set(sequences) == {(bucket.tokens, 1 if dense else 3)}
    else:  # the prefixes and rows by chunk, the bucket's count of them
        assert set(sequences) == {(bucket.tokens, "chunks", bucket.prefix_chunks + bucket.row_chunks)}
    rows, candidates = batch.markers.shape
    torch.testing.assert_close(inside[:rows, :candidates], alone, rtol=1e-5, atol=1e-5)
    assert not inside[rows:].any() and not inside[:, candidates:].any()  # padding has no candidate


def layout(batch):
    """The shapes of a padded batch's device tensors (the fork's too, when it has one) and the
    fork's host plan."""
    fork = [] if batch.fork is None else [tuple(tensor.shape) for tensor in batch.fork.tensors()] + [batch.fork.plan()]
    return [tuple(getattr(batch, name).shape) for name in
            ("input_ids", "position_ids", "prefix_cu_seqlens", "cu_seqlens", "prefix_chunk_indices", "chunk_indices",
             "markers", "candidate_mask")] + fork


def test_padding_keeps_the_shapes_the_bucket_fixes(parts):
    template, _ = parts
    for bucket in (Bucket(128, 256, False), Bucket(256, 512, True), Bucket(0, 768, True, single=True)):
        shapes = []
        for requests in LAYOUTS.values():
            batch = batch_of(template, requests)
            if not fits(batch_shape(batch), bucket):
                continue
            padded = pad_to_bucket(batch, bucket, template.pad_id)
            lengths = padded.cu_seqlens_cpu.diff()
            assert lengths.max() <= bucket.longest_row and lengths[-1] == 0  # an empty row for the plan's padding
            assert padded.lone_row == bucket.single  # attention may then take the axis as one sequence
            prefixes = padded.prefix_cu_seqlens_cpu.diff()
            if bucket.single:  # no prefix part: its row runs alone
                assert padded.prefix_tokens == 0 and padded.fork is None and len(prefixes) == 0
            else:
                assert prefixes[-1] == 0 and prefixes.sum() == bucket.prefix_tokens  # an empty prefix for the plan
                assert padded.fork.parents[len(batch.markers):].eq(-1).all()
            shapes.append(layout(padded))
        shapes.append(layout(empty_batch(bucket, template.pad_id)))
        assert len(shapes) >= 2 and all(shape == shapes[0] for shape in shapes), bucket
        assert shapes[0][0] == (bucket.tokens,) and shapes[0][5] == (bucket.row_chunks, 2)
        assert shapes[0][4] == (bucket.prefix_chunks, 2)
        assert shapes[0][6] == (bucket.rows, CANDIDATES)


def test_bucket_for_picks_the_smallest_that_fits_or_none(parts):
    template, _ = parts
    batch = batch_of(template, LAYOUTS["shared prefix"])
    bucket = bucket_for(batch, all_buckets())
    fitting = [b for b in all_buckets() if not b.long_rows and b.prefix_tokens >= batch.prefix_tokens
               and b.row_tokens >= batch.computed_tokens - batch.prefix_tokens]
    assert bucket == min(fitting, key=lambda b: b.tokens)
    assert bucket_for(batch, [Bucket(64, 128, True)]) is None  # short rows never take a long-row bucket
    many = batch_of(template, [("state", questions(1, candidates=CANDIDATES + 1))])
    assert bucket_for(many, all_buckets()) is None  # more candidates than a bucket holds
    with pytest.raises(ValueError, match="does not fit"):
        pad_to_bucket(batch, Bucket(64, 128, True), template.pad_id)


def test_the_fit_test_agrees_with_the_padding_and_any_order_of_buckets():
    """`fits` decides without making the padding (`_rows_fit`) as the padding would, and
    `smallest_fit` finds the same bucket whatever the order it is given them in, and through a
    `Ladder` of them (bisected by tokens)."""
    import random

    from dohnuts.runtime.buckets import Ladder, Shape, _row_padding, _rows_fit, rank, smallest_fit

    buckets = all_buckets()
    for bucket in buckets:
        for rows in (1, 2, 3, bucket.rows - 1, bucket.rows):
            for tokens in (1, 65, bucket.row_tokens // 2, bucket.row_tokens - 64 * (bucket.rows - rows),
                           bucket.row_tokens - 1, bucket.row_tokens, bucket.row_tokens + 1):
                assert _rows_fit(bucket, rows, tokens) == (_row_padding(bucket, rows, tokens) is not None)
    generator = random.Random(3)
    shuffled = buckets[:]
    ladder = Ladder(reversed(buckets))
    for _ in range(2000):
        rows = generator.choice((1, 1, 2, 5, 40))
        longest = generator.choice((20, 64, 65, 300, 1287, 5000))
        shape = Shape(generator.choice((0, 64, 700, 3000)), generator.choice((0, 1, 3)), longest * rows, rows,
                      longest, generator.choice((2, 40, 65)))
        shape = shape if shape.prefix_tokens else shape._replace(prefixes=0)
        generator.shuffle(shuffled)
        expected = min((b for b in buckets if fits(shape, b)), key=rank, default=None)
        assert smallest_fit(shape, buckets) == smallest_fit(shape, shuffled) == expected
        assert smallest_fit(shape, ladder) == expected


def test_the_last_row_of_a_padded_batch_is_always_empty_and_buckets_stay_within_the_scan():
    """Rows that would use up every row slot of a bucket go to the next one, so the padded chunk
    plan can always name an empty row; a bucket's long rows may be as long as its row tokens,
    since forward only the scan kernel walks any length (a bound there would route longer rows
    to FLA, whose plans a capture would memoise)."""
    from dohnuts.ops.delta_rule import scan
    from dohnuts.runtime.buckets import _row_padding

    full = Bucket(64, 128, True)
    assert full.rows == 17 and _row_padding(full, 16, 65 + 15 * 3) is None  # 16 rows + 1 padding = no room
    assert _row_padding(full, 15, 65 + 14 * 3)[-1] == 0
    assert scan.FORWARD_TOKENS is None
    assert Bucket(64, 4096, True).longest_row == 4096 and Bucket(64, 4096, False).longest_row == ROW_TOKENS
    # One long row (a one-question request): a one-row bucket of no prefix, at most a step of the
    # ladder (128 tokens to 2,048, 256 to 4,096, then 512) beyond it, up to 8,192 tokens, its
    # padding one sequence shorter than the row; two rows never fit one.
    from dohnuts.runtime.buckets import Shape, smallest_fit

    for tokens, row_tokens in ((100, 128), (300, 384), (513, 640), (1287, 1408), (1600, 1664), (2047, 2048),
                               (2787, 2816), (3500, 3584), (4097, 4608), (5000, 5120), (7979, 8192)):
        bucket = smallest_fit(Shape(0, 0, tokens, 1, tokens, 2), all_buckets())
        assert bucket == Bucket(0, row_tokens, True, single=True)
        assert _row_padding(bucket, 1, tokens) == [row_tokens - tokens, 0] and row_tokens - tokens < tokens
    assert not smallest_fit(Shape(0, 0, 1300, 2, 1287, 2), all_buckets()).single
    # A shared prefix up to 2,048 tokens with short questions steps as finely as one with long
    # ones: four images' state (1,052 tokens, three rows of 83) takes 1,280 prefix tokens, not 2,048.
    for prefix, prefix_tokens in ((300, 384), (700, 768), (1052, 1280), (1300, 1536), (1600, 2048)):
        for longest, long_rows in ((30, False), (200, True)):
            bucket = smallest_fit(Shape(prefix, 1, 83 + longest, 3, longest, 4), all_buckets())
            assert (bucket.prefix_tokens, bucket.long_rows) == (prefix_tokens, long_rows)
    # A row that continues a prefix never takes one: its keys are then more than the bucket's tokens.
    assert not smallest_fit(Shape(64, 1, 1287, 1, 1287, 2), all_buckets()).single
    assert smallest_fit(Shape(0, 0, 10000, 1, 10000, 2), all_buckets()) is None
    for bad in ((64, 1024, True), (0, 1024, False), (0, 64, True)):
        with pytest.raises(ValueError, match="one-row bucket"):
            Bucket(*bad, single=True)
    for bad in ((100, 128, False), (0, 128, False), (64, 0, True)):
        with pytest.raises(ValueError, match="a bucket needs"):
            Bucket(*bad)


def test_the_serving_mix_replays_buckets_alone_and_several_together(parts, tiny):
    """The load harness's requests (long states, up to 40 options, long rows) each fit a bucket,
    and the engine's plan joins several of them into one bucket's invocation: under load no call
    runs eagerly (the issue's acceptance), which a ladder stopping at 16 candidates or 1,024
    prefix tokens did not allow."""
    from dohnuts.bench.traffic import serving_mix
    from dohnuts.runtime.buckets import smallest_fit
    from dohnuts.runtime.engine import plan, request_shape
    from dohnuts.runtime.predict import Predictor

    template, model = parts
    predictor = Predictor(model, template, tiny.model, {"noul": 1.0, "choice": 1.0, "score": 1.0})
    requests = [predictor._encode([pair], collect=False)[0][0] for pair in serving_mix(48, seed=5)]
    buckets = all_buckets()
    alone = [smallest_fit(request_shape(request), buckets) for request in requests]
    assert all(bucket is not None for bucket in alone)
    assert max(request_shape(request).candidates for request in requests) > 16
    assert max(request_shape(request).prefix_tokens for request in requests) > 1024

    def admits(first, joined):
        return smallest_fit(joined, buckets) is not None

    invocations = plan(requests, admits)
    assert sum(len(pieces) for pieces in invocations) == len(requests)  # none split
    assert len(invocations) <= len(requests) / 4


def test_padding_sequences_are_short_whatever_the_spare_tokens(parts):
    """A bucket's padding prefixes and rows hold at most 64 tokens each: the delta rule walks its
    sequences in parallel, so one long padding sequence would outlast every real one. (A one-row
    bucket's one padding row is shorter than any row it is the smallest fit for:
    `test_the_last_row_of_a_padded_batch_is_always_empty_and_buckets_stay_within_the_scan`.)"""
    template, _ = parts
    for name, bucket in (("shared prefix", Bucket(2048, 4096, False)), ("long rows", Bucket(4096, 8192, True))):
        batch = batch_of(template, LAYOUTS[name])
        padded = pad_to_bucket(batch, bucket, template.pad_id)
        prefixes, rows = padded.prefix_cu_seqlens_cpu.diff(), padded.cu_seqlens_cpu.diff()
        real_prefixes = len(batch.prefix_cu_seqlens_cpu) - 1
        assert prefixes[real_prefixes:].max() <= ROW_TOKENS and prefixes.sum() == bucket.prefix_tokens
        assert rows[len(batch.markers):].max() <= ROW_TOKENS and rows.sum() == bucket.row_tokens
