"""Worker batches and prefetch keep order and content; overlapped evaluation writes the rows of
the synchronous loop."""

import dataclasses

import pandas as pd
import pytest
import torch

from dohnuts.data.loader import prefetch, worker_batches, workers_for
from dohnuts.data.records import RecordReader, load_records
from dohnuts.model.base import load_backbone
from dohnuts.model.decision import new_head
from dohnuts.runtime.checkpoint import assemble
from dohnuts.runtime.evaluation import EvaluationBatches, evaluate, plan_batches, request_tokens, state_records

BUDGET = 400  # computed tokens a test batch holds: two or three of the tiny partition's requests


def _same_item(a, b):
    assert a.meta == b.meta and len(a.tensors) == len(b.tensors)
    for x, y in zip(a.tensors, b.tensors):
        assert torch.equal(x.cpu(), y.cpu())
    for field in dataclasses.fields(a.batch):
        x, y = getattr(a.batch, field.name), getattr(b.batch, field.name)
        if isinstance(x, torch.Tensor):
            assert torch.equal(x.cpu(), y.cpu()), field.name
        elif field.name == "fork" and x is not None:
            assert all(torch.equal(u.cpu(), v.cpu()) for u, v in zip(x.tensors(), y.tensors()))
            assert x.plan() == y.plan()
        else:
            assert x == y, field.name


@pytest.fixture(scope="module")
def evaluation(tiny):
    template = tiny.template()
    folder = tiny.partition("dev")
    rows = load_records(folder)
    return template, RecordReader(folder), rows, EvaluationBatches(template, RecordReader(folder), 4096)


@pytest.mark.parametrize("workers", [0, 2])
def test_worker_batches_and_prefetch_keep_order_and_content(evaluation, workers):
    template, _, rows, build = evaluation
    plan = plan_batches(rows, BUDGET, template)
    assert len(plan) > 2
    expected = [build(tables) for tables in plan]
    device = torch.device("cpu")
    received = list(prefetch(worker_batches(build, plan, device, workers), device))
    assert len(received) == len(expected)
    for ours, reference in zip(received, expected):
        _same_item(ours, reference)


def test_batches_hold_whole_requests_and_every_row_once_within_the_token_budget(evaluation):
    template, _, rows, build = evaluation
    plan = plan_batches(rows, BUDGET, template)
    ids = [state_id for requests in plan for records in requests for state_id in [records.state_id] * len(records)]
    qids = [qid for requests in plan for records in requests for qid in records.qids]
    assert (ids, qids) == (list(rows.state_id), list(rows.qid))  # in order: results line up with the records
    assert len(set(ids)) == sum(len(requests) for requests in plan)  # a state's records make one request
    assert len(plan) > 2 and max(len(tables) for tables in plan) > 1
    for tables, following in zip(plan, plan[1:] + [None]):
        tokens = build(tables).batch.computed_tokens
        assert tokens <= BUDGET or len(tables) == 1
        if following is not None:  # closed only when the next request would not fit
            assert tokens + request_tokens(template, following[0]) > BUDGET


def test_request_tokens_are_the_tokens_its_packed_batch_computes(evaluation):
    """The planner's count, from text alone, equals what `pack_rows` lays out for the request:
    its shared prefix once, aligned down, image block included."""
    template, _, rows, build = evaluation
    requests = state_records(rows)
    assert {1, 2} <= {len(records.images) for records in requests}  # one image, and two (image_pair)
    assert any(len(records) > 1 for records in requests)
    # One question: its row runs whole, no prefix shared.
    alone = [dataclasses.replace(records, **{name: getattr(records, name)[:1] for name in (
        "groups", "qids", "questions", "targets")}) for records in requests]
    for records in requests + alone:
        assert request_tokens(template, records) == build([records]).batch.computed_tokens, records.state_id


def _synchronous_rows(model, template, build, rows, table):
    """The plain loop's result rows: build a batch, run it, read its logits."""
    expected = []
    with torch.no_grad():
        for tables in plan_batches(rows, BUDGET, template):
            item = build(tables)
            logits = model(item.batch.to(model.device)).cpu()
            for index, meta in enumerate(item.meta):
                record = {key: value for key, value in meta.items() if key != "candidates"}
                expected.append({**record, "logits": logits[index, : meta["candidates"]].tolist()})
    return pd.DataFrame.from_records(expected, columns=table.columns)


def test_overlapped_evaluation_writes_exactly_the_rows_of_the_synchronous_loop(tiny, evaluation):
    template, reader, rows, build = evaluation
    backbone = load_backbone(tiny.base, torch.float32).eval()
    model = assemble(backbone, new_head(backbone.config.text_config.hidden_size, 0.01)).eval()
    table = evaluate(model, template, reader, rows, BUDGET, 4096, workers=1)
    assert len(table) == len(rows)
    pd.testing.assert_frame_equal(table, _synchronous_rows(model, template, build, rows, table))


@pytest.mark.gpu
def test_evaluation_on_cuda_copies_results_on_a_side_stream_in_order_and_content(tiny, evaluation):
    """The logits come back through pinned memory on a side stream while the next batch's
    forward runs; in bf16 the rows, their order and their logits equal the synchronous loop's."""
    template, reader, rows, build = evaluation
    backbone = load_backbone(tiny.base, torch.bfloat16).eval()
    model = assemble(backbone, new_head(backbone.config.text_config.hidden_size, 0.01)).to("cuda").eval()
    table = evaluate(model, template, reader, rows, BUDGET, 4096, workers=1)
    expected = _synchronous_rows(model, template, build, rows, table)
    assert list(zip(table.state_id, table.qid)) == list(zip(expected.state_id, expected.qid))
    for ours, reference in zip(table.logits, expected.logits):
        assert ours == pytest.approx(reference, abs=1e-6)  # the same kernels on the same inputs


@pytest.mark.gpu
def test_prefetch_on_cuda_matches_synchronous_copies_and_pins_worker_batches(evaluation):
    template, _, rows, build = evaluation
    plan = plan_batches(rows, BUDGET, template)
    device = torch.device("cuda")
    loaded = list(worker_batches(build, plan, device, 1))
    assert all(item.batch.input_ids.is_pinned() for item in loaded)
    received = list(prefetch(loaded, device))
    torch.cuda.synchronize()
    for ours, tables in zip(received, plan):
        assert ours.batch.input_ids.is_cuda
        _same_item(ours, build(tables))


@pytest.mark.gpu
def test_prefetch_takes_the_next_item_ahead_only_when_asked_and_pins_only_worker_batches(evaluation):
    """Without `ahead`, an item built in the loop is taken only once the caller has the one
    before it (its host work then overlaps the caller's device work); with it, one item early.
    Batches built in the loop are not pinned."""
    template, _, rows, build = evaluation
    plan = plan_batches(rows, BUDGET, template)
    assert len(plan) >= 2
    device = torch.device("cuda")
    for ahead, taken_with_first in ((False, 1), (True, 2)):
        taken = []

        def items(taken=taken):
            for tables in plan:
                taken.append(len(taken))
                yield build(tables)

        stream = prefetch(items(), device, ahead=ahead)
        first = next(stream)
        assert len(taken) == taken_with_first
        rest = list(stream)
        torch.cuda.synchronize()
        for ours, tables in zip([first, *rest], plan):
            _same_item(ours, build(tables))
    assert not any(item.batch.input_ids.is_pinned() for item in worker_batches(build, plan, device, 0))


def test_training_updates_from_workers_equal_the_ones_built_in_process(tiny):
    from dohnuts.data.records import GroupSampler
    from dohnuts.pipeline.train import TrainingBatches, TrainingUpdates

    folder = tiny.partition("train")
    build = TrainingUpdates(TrainingBatches(tiny.template(), RecordReader(folder),
                                            GroupSampler(load_records(folder), 0, 8, 100), 2048), 2)
    indices = range(5, 9)
    device = torch.device("cpu")
    received = list(prefetch(worker_batches(build, indices, device, 2), device))
    assert len(received) == len(indices)
    for item, index in zip(received, indices):
        _same_item(item, build(index))


def test_worker_batches_start_no_more_workers_than_keys():
    loader = worker_batches(lambda key: key, [0, 1], torch.device("cpu"), workers=4)
    assert loader.num_workers == 2
    assert worker_batches(lambda key: key, range(2**40), torch.device("cpu"), workers=3).num_workers == 3
    assert worker_batches(lambda key: key, [], torch.device("cpu"), workers=3).num_workers == 0


def test_a_few_batches_are_built_in_the_loop_and_many_by_workers(monkeypatch):
    from dohnuts.data import loader

    monkeypatch.setattr(loader.os, "cpu_count", lambda: 16)
    cuda = torch.device("cuda")  # the policy only reads the device's type
    assert workers_for(cuda, 2) == 0  # the benchmark's evaluation set: a worker's start would cost more
    assert workers_for(cuda, loader.BATCHES_PER_WORKER) == 1
    assert workers_for(cuda, 1000) == workers_for(cuda, 2**40) == 4
    assert workers_for(torch.device("cpu"), 1000) == 0  # on the CPU the workers would take the compute's cores
