"""Training buckets: a batch padded to its training bucket gives its rows the logits, and every
trainable weight the gradient, of the batch alone (float32, the plain-PyTorch path); on CUDA,
the replayed training graphs against the eager training forward (GPU tests)."""

import copy
import dataclasses

import pytest
import torch
from helpers import LAYOUTS, batch_of, errs_like, questions

from dohnuts.config import LoraConfig
from dohnuts.runtime.checkpoint import build_training_model
from dohnuts.runtime.training_graphs import BucketInputs, fits, graphable, training_bucket, training_plan

SEVERAL = [({"note": "a long note about a parcel " * 12}, questions(3)), ("short", questions(1)),
           ({"note": "another note, of other words, about a box " * 9}, questions(2, candidates=5))]
CASES = {**LAYOUTS, "several requests": SEVERAL}


def _training_model(tiny, dtype="float32"):
    model, _ = build_training_model(tiny.base, dtype, LoraConfig(), 0.01, seed=0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:  # LoRA B starts at zero: give the adapters something to do
                parameter.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    model.activation_checkpointing = True
    return model.train()


@pytest.fixture(scope="module")
def model(tiny):
    return _training_model(tiny)


def _parents(batch):
    return batch.fork.parents.tolist() if batch.fork is not None else [-1] * batch.markers.shape[0]


def _larger(bucket):
    """A bucket larger than `bucket` in every size, with over 1,024 spare prefix and row tokens
    (so more than one padding sequence of each)."""
    return dataclasses.replace(bucket, prefix_tokens=bucket.prefix_tokens + 1536, prefixes=bucket.prefixes + 8,
                               row_tokens=bucket.row_tokens + 1536, rows=bucket.rows + 16,
                               key_tokens=bucket.key_tokens + 6144, candidates=bucket.candidates + 8)


def _padded(model, batch, larger=False):
    """(the batch's bucket, or a larger one, and its BucketInputs filled with the batch)."""
    bucket = training_bucket(batch)
    bucket = _larger(bucket) if larger else bucket
    plan = training_plan(batch, bucket, _parents(batch))
    inputs = BucketInputs(model, bucket, batch, plan)
    inputs.fill(model.embeddings(batch), batch, plan)
    return bucket, inputs


def _gradients(model, logits, weights):
    parameters = [parameter for parameter in model.parameters() if parameter.requires_grad]
    return torch.autograd.grad((logits * weights).sum(), parameters)


@pytest.mark.parametrize("larger", [False, True], ids=["its bucket", "a larger bucket"])
@pytest.mark.parametrize("name", list(CASES))
def test_a_batch_padded_to_its_training_bucket_keeps_its_logits_and_gradients(tiny, model, name, larger):
    batch = batch_of(tiny.template(), CASES[name])
    bucket, inputs = _padded(model, batch, larger)
    assert inputs.embeds.shape[0] == bucket.tokens > batch.computed_tokens
    rows, candidates = batch.markers.shape
    weights = torch.randn(rows, candidates, generator=torch.Generator().manual_seed(0))

    alone = model.scores(model.embeddings(batch), batch)
    padded = model.scores(inputs.embeds, inputs.batch)
    torch.testing.assert_close(padded[:rows, :candidates], alone, rtol=1e-5, atol=1e-5)
    assert not padded[rows:].any() and not padded[:, candidates:].any()  # padding has no candidate

    expected = _gradients(model, alone, weights)
    got = _gradients(model, padded[:rows, :candidates], weights)
    assert len(expected) == 63  # every LoRA matrix of the 4 layers and the head
    for want, have in zip(expected, got):
        scale = want.abs().max().clamp_min(1e-8)
        assert ((have - want).abs().max() / scale).item() <= 1e-4


def test_batches_of_one_bucket_fill_the_same_shapes(tiny, model):
    template = tiny.template()
    first = batch_of(template, [({"note": "a long note about a parcel " * 12}, questions(3))])
    second = batch_of(template, [({"note": "a note about a box " * 10}, questions(2, candidates=5)),
                                 ("short", questions(1))])
    bucket = training_bucket(first)
    assert training_bucket(second) == bucket
    assert first.computed_tokens != second.computed_tokens and first.markers.shape != second.markers.shape
    shapes = []
    for batch in (first, second):
        plan = training_plan(batch, bucket, _parents(batch))
        shapes.append([tuple(tensor.shape) for tensor in plan.tensors()])
        lengths = plan.cu_seqlens.diff()
        assert lengths[-1] == 0 and lengths[batch.markers.shape[0]] > 0  # the padding row, then empty rows
        assert plan.prefix_cu_seqlens.diff()[-1] == 0  # an empty prefix, always
        assert plan.fork.parents[batch.markers.shape[0]:].eq(-1).all()
        assert int(plan.fork.cu_seqlens_k[-1]) == bucket.key_tokens == len(plan.fork.key_index)
    assert shapes[0] == shapes[1]
    assert shapes[0][3] == (bucket.row_chunks, 2) and shapes[0][2] == (bucket.prefix_chunks, 2)
    with pytest.raises(ValueError, match="does not fit"):
        training_plan(first, dataclasses.replace(bucket, candidates=2), _parents(first))


def test_a_batch_fits_its_own_bucket_and_larger_ones_only(tiny):
    batch = batch_of(tiny.template(), SEVERAL)
    bucket = training_bucket(batch)
    assert fits(batch, bucket) and fits(batch, _larger(bucket))
    real_prefixes, real_rows = len(batch.prefix_cu_seqlens_cpu) - 1, batch.markers.shape[0]
    for smaller in (dataclasses.replace(bucket, candidates=batch.markers.shape[1] - 1),
                    dataclasses.replace(bucket, key_tokens=bucket.tokens),  # no room for the rows' prefix keys
                    dataclasses.replace(bucket, prefixes=real_prefixes + 1),  # no empty prefix left over
                    dataclasses.replace(bucket, rows=real_rows + 1),  # no empty row after the padding row
                    # no token left for a padding row
                    dataclasses.replace(bucket, row_tokens=batch.computed_tokens - batch.prefix_tokens),
                    dataclasses.replace(_larger(bucket), row_tokens=8192)):  # over MIXER_KEEP_TOKENS
        assert not fits(batch, smaller), smaller
    with pytest.raises(ValueError, match="does not fit"):
        training_plan(batch, dataclasses.replace(bucket, candidates=2), _parents(batch))


def test_batches_beyond_the_buckets_have_none(tiny):
    template = tiny.template()
    long_row = batch_of(template, [("a state of many words " * 300, questions(1))])
    assert long_row.computed_tokens > 1024 and training_bucket(long_row) is None  # a sequence over the scan's
    many = batch_of(template, [("state " * 90 + str(index), questions(2)) for index in range(70)])
    assert many.computed_tokens > 8192 and training_bucket(many) is None  # over MIXER_KEEP_TOKENS once padded


def test_only_plain_lora_and_the_head_may_train_under_graphs_in_half_precision(tiny, model):
    assert "torch.float32" in graphable(model)  # attention would run the padded reference
    half = _training_model(tiny, "bfloat16")
    assert graphable(half) is None
    dropping, _ = build_training_model(tiny.base, "bfloat16", LoraConfig(dropout=0.1), 0.01, seed=0)
    assert "not plain LoRA" in graphable(dropping.train())
    assert graphable(dropping.eval()) is None  # dropout is not at work in evaluation
    half.backbone.language_model.norm.weight.requires_grad_(True)
    assert "language_model.norm.weight trains" in graphable(half)


def _on_cuda(tiny):
    return _training_model(tiny, "bfloat16").cuda()


def _relative(have, want):
    return ((have.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-8)).item()


@pytest.mark.gpu
def test_training_graphs_replay_the_eager_logits_and_gradients_for_new_batches(tiny):
    """bf16: replays of one bucket on three batches of different layouts and contents, against the
    eager forward of each batch alone. Both are held to the model in float64 on the CPU, in
    logits and in every gradient: the replay may err at most twice what the eager forward errs,
    plus 1% of the largest value (`errs_like`); the two bf16 paths differed from each other by
    11% of the largest gradient of this tiny model on the H200, each rounding its own way."""
    model = _on_cuda(tiny)
    exact = copy.deepcopy(model).double().cpu()
    template = tiny.template()
    batches = [batch_of(template, [({"note": f"note {index}: about a parcel " * (8 + index)}, questions(3 - index % 2)),
                                   ("short " * index, questions(1, candidates=4))]) for index in range(3)]
    assert len({training_bucket(batch) for batch in batches}) == 1
    assert len({batch.computed_tokens for batch in batches}) == 3
    parameters = [parameter for parameter in model.parameters() if parameter.requires_grad]
    exact_parameters = [parameter for parameter in exact.parameters() if parameter.requires_grad]
    for index, host in enumerate(batches):
        batch = host.to(model.device)
        rows, candidates = batch.markers.shape
        weights = torch.randn(rows, candidates, dtype=torch.float64, generator=torch.Generator().manual_seed(index))
        truth = exact.scores(exact.embeddings(host), host)
        true_grads = torch.autograd.grad((truth * weights).sum(), exact_parameters)
        weights = weights.to(model.device, torch.float32)
        expected = model.scores(model.embeddings(batch), batch)
        want = torch.autograd.grad((expected * weights).sum(), parameters)
        expected = expected.detach()  # no autograd graph outlives its step, as in `update_step`
        logits = model(batch)  # training, with gradients, on CUDA: through the training graphs
        (logits * weights).sum().backward()
        have = [parameter.grad for parameter in parameters]
        assert errs_like(logits, expected, truth)
        for h, w, true in zip(have, want, true_grads, strict=True):
            assert errs_like(h, w, true)
        for parameter in parameters:
            parameter.grad = None
        del logits
    stats = model.training_graphs.stats
    assert (stats["eager"], stats["captures"], stats["replays"], stats["failed"]) == (1, 1, 2, 0)

    with torch.no_grad():  # an optimizer step changes trainable weights in place: replays read them
        for parameter in parameters:
            parameter.mul_(1.5)
    batch = batches[0].to(model.device)
    expected = model.scores(model.embeddings(batch), batch)
    assert _relative(model(batch).detach(), expected) <= 2e-2
    assert model.training_graphs.stats["replays"] == 3


@pytest.mark.gpu
def test_a_training_graph_backward_must_follow_its_own_forward(tiny):
    model = _on_cuda(tiny)
    template = tiny.template()
    small = batch_of(template, [({"note": "a note about a parcel " * 8}, questions(2))]).to(model.device)
    large = batch_of(template, [({"note": "a note about a parcel " * 60}, questions(2))]).to(model.device)
    assert training_bucket(small) != training_bucket(large)
    for batch in (small, large, small, large):  # second sightings capture
        model(batch).sum().backward()
    first, second = model(small), model(large)
    with pytest.raises(RuntimeError, match="must follow its own forward"):
        first.sum().backward()
    second.sum().backward()
    first, second = model(small), model(small)  # one graph twice: the second rewrote the first's activations
    with pytest.raises(RuntimeError, match="must follow its own forward"):
        first.sum().backward()
    second.sum().backward()
    assert model.training_graphs.stats["captures"] == 2


@pytest.mark.gpu
def test_a_new_layout_replays_a_larger_captured_bucket_with_its_own_logits_and_gradients(tiny):
    """bf16: a batch whose own bucket has no graphs replays a larger bucket's (up to twice the
    tokens) on first sight, against its eager forward (2% of the largest logit, 5% of the largest
    gradient); its own bucket is captured on its fourth sighting."""
    model = _on_cuda(tiny)
    template = tiny.template()
    large = batch_of(template, [({"note": " ".join(f"parcel {i} went north" for i in range(80))}, questions(3))])
    small = batch_of(template, [({"note": " ".join(f"box {i} went south" for i in range(20))}, questions(2))])
    large, small = large.to(model.device), small.to(model.device)
    own, larger = training_bucket(small), training_bucket(large)
    assert own != larger and fits(small, larger) and larger.tokens <= 2 * own.tokens
    for _ in range(2):  # the large batch's bucket: eager, then captured
        model(large).sum().backward()
    parameters = [parameter for parameter in model.parameters() if parameter.requires_grad]
    for parameter in parameters:
        parameter.grad = None
    expected = model.scores(model.embeddings(small), small)
    want = torch.autograd.grad(expected.sum(), parameters)
    expected = expected.detach()
    before = dict(model.training_graphs.stats)
    logits = model(small)
    logits.sum().backward()
    after = model.training_graphs.stats
    assert (after["eager"], after["captures"], after["replays"]) == (
        before["eager"], before["captures"], before["replays"] + 1)
    assert after["padding_tokens"] - before["padding_tokens"] == larger.tokens - small.computed_tokens
    assert _relative(logits.detach(), expected) <= 2e-2
    assert max(_relative(p.grad, w) for p, w in zip(parameters, want)) <= 5e-2
    del logits
    for _ in range(3):  # sightings 2 and 3 replay the larger bucket; the fourth captures its own
        model(small).sum().backward()
    assert own in model.training_graphs.graphs and model.training_graphs.stats["captures"] == 2
