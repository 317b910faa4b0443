"""The engine: invocations planned by shape, split requests reassembled, the serving loop's
batches answering each request as it is answered alone (float32 on the CPU, 1e-5)."""

import threading
import time

import numpy as np
import pytest
from helpers import square_image, state_of_tokens

from dohnuts import Predictor
from dohnuts.runtime.buckets import Bucket, Shape, batch_shape, fits, joined
from dohnuts.runtime.engine import (
    Closed,
    EngineLoop,
    Expired,
    Overloaded,
    Piece,
    densest,
    parts_of,
    per_request,
    plan,
    request_shape,
)

QUESTIONS = {
    "colour": {"type": "choice", "instructions": "What colour is it?", "criteria": ["red", "green", "blue", "cyan"]},
    "warm": {"type": "noul", "instructions": "Is the colour warm?"},
    "size": {"type": "score", "instructions": "How big?", "criteria": ["small", "medium", "large"]},
}


@pytest.fixture(scope="module")
def predictor(deployable):
    root, _ = deployable
    return Predictor.from_checkpoint(root / "checkpoint", device="cpu")


def requests_of(predictor, count: int, tokens: int = 80) -> list:
    """`count` distinct requests, every third with an image, their states of about `tokens` tokens."""
    made = []
    for index in range(count):
        state = {"note": f"{index}: " + state_of_tokens(predictor.template, tokens)}
        if index % 3 == 0:
            state["image"] = square_image((20 * index % 256, 40, 200))
        made.append((state, dict(list(QUESTIONS.items())[: 1 + index % 3])))
    return made


def alone(predictor, requests) -> list[np.ndarray]:
    """Each request's logits from an invocation of its own."""
    return [predictor.engine.run(predictor._encode([request], collect=False)[0]) for request in requests]


def test_the_planned_shape_is_the_shape_of_the_packed_batch(predictor):
    encoded = predictor._encode(requests_of(predictor, 5), collect=False)[0]
    for request in encoded:
        batch = predictor.engine.collate([request], [Piece(0, list(range(len(request.rows))))])
        assert request_shape(request) == batch_shape(batch)
    together = joined(request_shape(request) for request in encoded)
    everything = predictor.engine.collate(encoded, [Piece(i, list(range(len(r.rows)))) for i, r in enumerate(encoded)])
    assert together == batch_shape(everything)  # distinct states: no prefix shared across requests


def test_requests_are_taken_whole_while_they_fit_and_one_over_the_budget_is_split_by_rows(predictor):
    encoded = predictor._encode(requests_of(predictor, 6), collect=False)[0]
    sizes = [request_shape(request).tokens for request in encoded]
    budget = sizes[0] + sizes[1]  # the first two fit together, not three
    planned = plan(encoded, lambda first, joined: joined.tokens <= budget)
    assert [piece.request for piece in planned[0]] == [0, 1]
    assert sorted(piece.request for pieces in planned for piece in pieces) == list(range(6))
    big = max(range(6), key=lambda index: len(encoded[index].rows))
    small = request_shape(encoded[big], [0]).tokens + 1  # room for one row of it and its prefix
    parts = parts_of(encoded[big], lambda first, joined: joined.tokens <= small)
    assert [row for part in parts for row in part] == list(range(len(encoded[big].rows))) and len(parts) > 1


def test_an_invocation_grows_within_a_bucket_when_its_first_request_fits_one_else_to_the_budget(predictor):
    engine = predictor.engine
    state = {"note": state_of_tokens(predictor.template, 70)}
    one, three = predictor._encode([(state, dict(list(QUESTIONS.items())[:1])), (state, QUESTIONS)],
                                   collect=False)[0]
    small, large = request_shape(one), request_shape(three)
    bucket = Bucket(64, 128, True)  # one short request's row, not two
    assert fits(small, bucket) and not fits(small.join(small), bucket) and not fits(large, bucket)
    real = engine.scores.buckets
    engine.scores.buckets = {bucket: None}  # as if captured: only the planning reads it here
    try:
        assert engine.graphed(small) and not engine.graphed(large)
        assert not engine.admits(small, small.join(small))  # a graphed invocation stays in its bucket
        assert engine.admits(large, large.join(small).join(small))  # an eager one grows to the budget
        assert [len(pieces) for pieces in plan([one, one, three, one, one], engine.admits)] == [1, 1, 3]
    finally:
        engine.scores.buckets = real


def test_densest_keeps_the_requests_that_do_the_most_for_their_cost():
    """Of the requests admitted, as many as keep the most useful tokens per token of cost: a
    fourth that doubles the bucket stays for the next invocation; all when a shape has no price,
    and the most requests among equals."""
    shapes = [Shape(0, 0, tokens, 1, tokens, 2) for tokens in (400, 800, 1000, 1100)]

    def bucketed(shape):  # buckets of 512, 1,024 and 2,048 tokens, and 256 an invocation
        return next(size for size in (512, 1024, 2048) if shape.tokens <= size) + 256

    assert densest(shapes, bucketed) == 3  # 1,000 of 1,280, where 1,100 would cost 2,304
    assert densest(shapes[:1], bucketed) == 1 and densest(shapes, None) == 4 and densest([], bucketed) == 0
    assert densest(shapes[:2], lambda shape: 500 if shape.tokens <= 400 else 4000) == 1  # the first alone
    assert densest(shapes, lambda shape: None if shape.tokens > 900 else 1000) == 4  # one unpriced: all
    assert densest(shapes[:2], lambda shape: 2 * shape.tokens) == 2  # equal: the more requests


def test_the_plan_and_the_loop_leave_a_request_that_would_double_the_bucket_for_the_next(predictor):
    """With buckets of 128, 256 and 1,024 row tokens, two requests of about 100 tokens fill the
    256 well and a third would take the 1,024: `plan` and the serving loop take two, then one."""
    engine = predictor.engine
    state = {"note": state_of_tokens(predictor.template, 70)}
    one = predictor._encode([(state, dict(list(QUESTIONS.items())[:1]))], collect=False)[0][0]
    small = request_shape(one)
    fake = [Bucket(64, 128, True), Bucket(64, 256, True), Bucket(64, 1024, True)]
    assert fits(small.join(small), fake[1]) and not fits(small.join(small).join(small), fake[1])
    real = engine.scores.buckets
    engine.scores.buckets = dict.fromkeys(fake)  # as if captured: only the planning reads them
    sizes = []
    loop = EngineLoop(engine, predictor.lock, on_invocation=lambda requests, rows, waits: sizes.append(requests))
    try:
        assert engine.cost(small) == 64 + 128 + 256 and engine.cost(small.join(small)) == 64 + 256 + 256
        assert [len(pieces) for pieces in plan([one] * 3, engine.admits, engine.cost)] == [2, 1]
        assert [len(pieces) for pieces in plan([one] * 3, engine.admits)] == [3]  # every admitted one
        with predictor.lock:  # the loop takes its first invocation, then waits for the engine
            with loop.condition:
                for _ in range(3):
                    loop.submit(one, lambda result: None)
            deadline = time.monotonic() + 30
            while loop.depth != 1:
                assert time.monotonic() < deadline, "the loop took no invocation"
                time.sleep(0.01)
            engine.scores.buckets = real  # the CPU runs them eagerly
    finally:
        engine.scores.buckets = real
        loop.close()
    assert sizes == [2, 1]


def test_a_request_split_over_invocations_gets_the_logits_it_gets_whole(predictor):
    requests = requests_of(predictor, 4, tokens=120)
    expected = alone(predictor, requests)
    encoded = predictor._encode(requests, collect=False)[0]
    engine = predictor.engine
    before = dict(engine.stats)
    engine.fixed_budget = max(request_shape(r, [0]).tokens for r in encoded) + 4  # one row and its prefix
    try:
        stacked = engine.run(encoded)
    finally:
        engine.fixed_budget = None
    several = sum(len(request.rows) > 1 for request in encoded)
    assert several == 2 and engine.stats["split_requests"] - before["split_requests"] == several
    assert engine.stats["invocations"] - before["invocations"] == sum(len(r.rows) for r in encoded)
    for got, want in zip(per_request(stacked, encoded), expected):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_the_loop_batches_concurrent_requests_and_answers_each_as_alone(predictor):
    requests = requests_of(predictor, 12)
    expected = alone(predictor, requests)
    encoded = predictor._encode(requests, collect=False)[0]
    invocations, answers, done = [], {}, threading.Event()

    def counted(requests, rows, waits):
        invocations.append(requests)

    loop = EngineLoop(predictor.engine, predictor.lock, on_invocation=counted)
    try:
        with predictor.lock:  # the loop cannot launch while this thread holds the engine: the rest queue
            for index, request in enumerate(encoded):
                loop.submit(request, lambda result, index=index: (answers.__setitem__(index, result),
                                                                 len(answers) == len(encoded) and done.set()))
        assert done.wait(60)
    finally:
        loop.close()
    assert sum(invocations) == 12 and len(invocations) < 12  # several requests an invocation
    for index, want in enumerate(expected):
        np.testing.assert_allclose(answers[index], want, rtol=1e-5, atol=1e-5)


def test_a_failed_invocation_fails_its_requests_and_the_loop_goes_on(predictor):
    encoded = predictor._encode(requests_of(predictor, 3), collect=False)[0]
    text = encoded[1]  # no image
    broken = text._replace(rows=[text.rows[0]._replace(input_ids=(10**9,) * len(text.rows[0].input_ids))])
    loop = EngineLoop(predictor.engine, predictor.lock)
    try:
        results = []
        for request in (broken, text):  # one after the other, each its own invocation
            answered = threading.Event()
            loop.submit(request, lambda result, answered=answered: (results.append(result), answered.set()))
            assert answered.wait(60)
    finally:
        loop.close()
    assert isinstance(results[0], IndexError)  # the embedding lookup of an id past the vocabulary
    np.testing.assert_allclose(results[1], alone(predictor, [requests_of(predictor, 3)[1]])[0], rtol=1e-5, atol=1e-5)


def test_a_bad_request_in_a_batch_fails_alone_and_the_others_are_answered(predictor):
    requests = requests_of(predictor, 5)
    encoded = predictor._encode(requests, collect=False)[0]
    text = encoded[1]  # no image
    broken = text._replace(rows=[text.rows[0]._replace(input_ids=(10**9,) * len(text.rows[0].input_ids))])
    batch = [encoded[0], broken, encoded[2], encoded[3], encoded[4]]
    expected = alone(predictor, [requests[index] for index in (0, 2, 3, 4)])
    results, done, sizes = {}, threading.Event(), []
    loop = EngineLoop(predictor.engine, predictor.lock, on_invocation=lambda requests, rows, waits: sizes.append(
        requests))
    try:
        with loop.condition:  # the loop takes all five at once, as one invocation
            for index, request in enumerate(batch):
                loop.submit(request, lambda result, index=index: (results.__setitem__(index, result),
                                                                 len(results) == 5 and done.set()))
        assert done.wait(60)
    finally:
        loop.close()
    assert isinstance(results[1], IndexError)
    for index, want in zip((0, 2, 3, 4), expected):
        np.testing.assert_allclose(results[index], want, rtol=1e-5, atol=1e-5)
    assert sum(sizes) == 5 and max(sizes) < 5  # answered in the halves' invocations, not the failed one


def test_a_closed_or_full_loop_refuses_new_requests(predictor):
    encoded = predictor._encode(requests_of(predictor, 3), collect=False)[0]
    loop = EngineLoop(predictor.engine, predictor.lock, max_queue=1)
    with predictor.lock:  # nothing is taken from the queue meanwhile
        assert not loop.refusing
        loop.submit(encoded[0], lambda result: None)
        assert loop.refusing  # what a front end reads before it does any work
        with pytest.raises(Overloaded):
            loop.submit(encoded[1], lambda result: None)
    loop.close()
    with pytest.raises(Closed):
        loop.submit(encoded[2], lambda result: None)


def test_a_request_past_its_deadline_is_dropped_before_it_runs(predictor):
    encoded = predictor._encode(requests_of(predictor, 2), collect=False)[0]
    loop = EngineLoop(predictor.engine, predictor.lock)
    results, done = [], threading.Event()
    before = predictor.engine.stats["requests"]
    try:
        with predictor.lock:  # the engine cannot run while this thread holds it
            loop.submit(encoded[0]._replace(deadline=time.monotonic() + 0.05), results.append)
            time.sleep(0.2)  # its deadline passes while it waits
        loop.submit(encoded[1], lambda result: (results.append(result), done.set()))
        assert done.wait(60)
    finally:
        loop.close()
    expired = [result for result in results if isinstance(result, Expired)]
    assert len(expired) == 1 and sum(isinstance(result, np.ndarray) for result in results) == 1
    assert predictor.engine.stats["requests"] - before <= 2  # the expired one may have been taken, never run


def test_a_cancelled_request_is_dropped_from_the_queue_and_never_answered(predictor):
    raw = requests_of(predictor, 3)
    encoded = predictor._encode(raw, collect=False)[0]
    loop = EngineLoop(predictor.engine, predictor.lock)
    answered, done = {}, threading.Event()

    def reply(name):
        def record(result):
            answered[name] = result
            if {"first", "third"} <= set(answered):
                done.set()
        return record

    try:
        with predictor.lock:  # the loop takes "first" and waits for the engine: the others queue behind it
            loop.submit(encoded[0], reply("first"))
            deadline = time.monotonic() + 30
            while loop.depth:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            second = loop.submit(encoded[1], reply("second"))
            loop.submit(encoded[2], reply("third"))
            assert loop.cancel(second) and loop.depth == 1
        assert done.wait(60)
        assert not loop.cancel(second)  # gone already: nothing to drop
    finally:
        loop.close()
    assert set(answered) == {"first", "third"} and loop.cancelled == 1
    for name, index in (("first", 0), ("third", 2)):
        np.testing.assert_allclose(answered[name], alone(predictor, [raw[index]])[0], rtol=1e-5, atol=1e-5)


def test_new_requests_are_refused_while_the_oldest_has_waited_past_max_wait(predictor):
    """Queue-delay admission: past the device's rate the excess is refused at once (a 429) rather
    than queued behind work it cannot overtake; once the queue moves again, requests are taken."""
    encoded = predictor._encode(requests_of(predictor, 3), collect=False)[0]
    loop = EngineLoop(predictor.engine, predictor.lock, max_wait=0.1)
    answered = threading.Event()
    try:
        with predictor.lock:  # the device "cannot keep up": the loop takes one and waits for it
            loop.submit(encoded[0], lambda result: None)
            deadline = time.monotonic() + 30
            while loop.depth:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            loop.submit(encoded[1], lambda result: None)  # nothing has waited yet: queued
            assert not loop.refusing
            time.sleep(0.3)
            assert loop.refusing
            with pytest.raises(Overloaded, match="waited over 0.1 s"):
                loop.submit(encoded[2], lambda result: None)
        deadline = time.monotonic() + 60
        while loop.depth:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert not loop.refusing
        loop.submit(encoded[2], lambda result: answered.set())
        assert answered.wait(60)
    finally:
        loop.close()


def test_the_warm_up_batches_take_every_eager_route_of_the_forward(predictor):
    """Between them: the delta rule's rows kernel (forked rows of at most 64 tokens, its longest
    row in each 16-token step: one compiled variant each, else a request compiles one), its scan
    from forked states by both paths (fewer than PARTS_BELOW sequences, and more), from zero
    states by both, and a sequence past the walk's gradient bound; on the CPU
    they run the eager forward (CUDA compiles their kernels there at load)."""
    from dohnuts.ops.delta_rule.parts import PART
    from dohnuts.ops.delta_rule.rows import ROW_TOKENS
    from dohnuts.ops.delta_rule.scan import ALONE_FROM, ALONE_TO, PARTS_BELOW, SCAN_TOKENS
    from dohnuts.runtime.engine import warm_up_batches

    batches = warm_up_batches(0)

    def lengths(bounds):
        return np.diff(bounds.numpy())

    forked = [batch for batch in batches if batch.fork is not None]
    whole = [batch for batch in batches if batch.fork is None]
    assert any(lengths(batch.cu_seqlens_cpu).max() <= ROW_TOKENS for batch in forked)
    parts = {-(-int(lengths(batch.cu_seqlens_cpu).max()) // PART) for batch in forked
             if lengths(batch.cu_seqlens_cpu).max() <= ROW_TOKENS}
    assert parts == set(range(1, ROW_TOKENS // PART + 1))
    assert any(lengths(batch.cu_seqlens_cpu).max() > ROW_TOKENS and len(batch.cu_seqlens_cpu) - 1 < PARTS_BELOW
               for batch in forked)
    assert any(len(batch.prefix_cu_seqlens_cpu) - 1 >= PARTS_BELOW and len(batch.cu_seqlens_cpu) - 1 >= PARTS_BELOW
               for batch in forked)
    assert {len(batch.cu_seqlens_cpu) - 1 >= PARTS_BELOW for batch in whole} == {True, False}
    assert max(batch.computed_tokens for batch in batches) > SCAN_TOKENS
    # One long prefix alone: the 64-token steps keeping a final state (a long state's requests).
    assert any(len(batch.prefix_cu_seqlens_cpu) == 2 and ALONE_FROM <= batch.prefix_tokens <= ALONE_TO
               for batch in forked)
    assert {batch.markers.shape[1] for batch in batches} >= {1, 2, 3}
    assert predictor.engine.warm_up() == len(batches)


@pytest.mark.gpu
def test_after_load_no_request_compiles_or_tunes_a_kernel(deployable):
    """Load (graphs captured, the warm-up run), then requests of new shapes run eagerly and
    through graphs: text of 1 to about 5,000 tokens, states shared or not, 1 to 40 candidates,
    images. Triton compiles and tunes nothing on them (`ops.compiles.kernel_variants`)."""
    from dohnuts.ops.compiles import compiled_keys, kernel_variants

    root, _ = deployable
    predictor = Predictor.from_checkpoint(root / "checkpoint", device="cuda")
    before, keys = kernel_variants(), compiled_keys()
    assert before["kernels"] > 0 and before["compiled"] > 0
    sent = 0
    for index, tokens in enumerate((3, 17, 64, 65, 130, 700, 1500, 2049, 3001, 5000)):
        state = {"note": "ok " * tokens}
        if index % 4 == 1:
            state["image"] = square_image((30 * index % 256, 80, 120))
        questions = {f"q{n}": {"type": "choice", "instructions": f"Which one, {n}?",
                               "criteria": [f"option {c}" for c in range(2 + (7 * index + n) % 39)]}
                     for n in range(1 + index % 4)}
        predictor.predict(state, questions)
        predictor.predict(state, dict(list(QUESTIONS.items())[: 1 + index % 3]))
        sent += 2
    after = kernel_variants()
    new = {name: sorted(variants - keys.get(name, set())) for name, variants in compiled_keys().items()}
    new = {name: variants for name, variants in new.items() if variants}  # what compiled, and how specialised
    assert (after["compiled"], after["tuned"]) == (before["compiled"], before["tuned"]), (before, after, sent, new)
