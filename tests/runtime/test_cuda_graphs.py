"""CUDA graphs of the inference forward against the eager forward (GPU tests), and the layout key."""

import copy
import dataclasses

import pytest
import torch
from helpers import LAYOUTS, batch_of, encoded, errs_like, square_image
from PIL import Image

from dohnuts.model.base import load_backbone
from dohnuts.model.decision import new_head
from dohnuts.runtime.checkpoint import assemble
from dohnuts.runtime.cuda_graphs import GraphedScores, layout_key
from dohnuts.schema import parse_request

QUESTIONS = {
    "red": {"type": "noul", "instructions": "Is the square red?"},
    "colour": {"type": "choice", "instructions": "What colour?", "criteria": ["red", "green", "blue"]},
}


def _batch(template, colour, note="a square on a page, drawn for the test " * 4):
    image = Image.new("RGB", (64, 64), "white")
    image.paste(colour, (8, 8, 40, 40))
    request = parse_request({"note": note, "image": image}, QUESTIONS, template.reserved)
    return template.collate(*encoded(template, request))


def test_the_ladder_finds_buckets_as_they_are_made_replaced_and_dropped():
    """`GraphedScores.ladder` follows `buckets` (filled at prepare, cleared with the graphs, or
    a new dict given in their place), so a batch's bucket is found among those captured."""
    from dohnuts.runtime.buckets import Bucket, Shape

    graphed = GraphedScores(None)  # no model is read: the ladder only orders the buckets
    shape = Shape(64, 1, 100, 1, 100, 2)
    small, large = Bucket(128, 128, True), Bucket(256, 256, True)
    assert graphed.ladder.smallest_fit(shape) is None
    graphed.buckets[large] = None
    assert graphed.ladder.smallest_fit(shape) == large
    graphed.buckets[small] = None
    assert graphed.ladder.smallest_fit(shape) == small
    graphed.buckets = {large: None}
    assert graphed.ladder.smallest_fit(shape) == large
    graphed.buckets.clear()
    assert graphed.ladder.smallest_fit(shape) is None
    # A model change empties the same dict and `prepare` fills it again, as many as before.
    graphed.buckets[small] = None
    assert graphed.ladder.smallest_fit(shape) == small
    graphed.model = type("Changed", (), {"generation": 1, "parameters": lambda self: [torch.zeros(1)]})()
    graphed._check_versions()  # a model of another generation: every graph and bucket dropped
    assert not graphed.buckets
    graphed.buckets[large] = None  # as `prepare` would after it
    assert graphed.ladder.smallest_fit(shape) == large


def test_layout_key_ignores_contents_but_not_the_plan(tiny):
    template = tiny.template()
    red, green = _batch(template, (220, 20, 20)), _batch(template, (20, 220, 20))
    assert red.fork is not None  # the rows share a prefix, so the key covers a fork
    assert layout_key(red) == layout_key(green)
    longer = _batch(template, (220, 20, 20), note="a longer note " * 30)
    assert layout_key(longer) != layout_key(red)
    moved = dataclasses.replace(red, cu_seqlens_cpu=red.cu_seqlens_cpu + torch.tensor([0, 1, 1], dtype=torch.int32))
    assert layout_key(moved) != layout_key(red)


def _on_cpu(tiny):
    """(the tiny model in float32 on the CPU, its GraphedScores)."""
    backbone = load_backbone(tiny.base, torch.float32).eval()
    model = assemble(backbone, new_head(backbone.config.text_config.hidden_size, 0.01)).eval()
    return model, GraphedScores(model)


def test_eager_on_the_cpu_equals_the_model(tiny):
    template = tiny.template()
    model, graphed = _on_cpu(tiny)
    batch = _batch(template, (220, 20, 20))
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(graphed(batch), model(batch))
    assert {name: graphed.stats[name] for name in ("eager", "captures", "replays", "failed", "bucket_replays")} == {
        "eager": 3, "captures": 0, "replays": 0, "failed": 0, "bucket_replays": 0}
    assert graphed.prepare() == 0  # no buckets on the CPU


def _on_cuda(tiny, dtype):
    """(template, the tiny model on CUDA, its GraphedScores)."""
    backbone = load_backbone(tiny.base, dtype).cuda().eval()
    model = assemble(backbone, new_head(backbone.config.text_config.hidden_size, 0.01).cuda()).eval()
    return tiny.template(), model, GraphedScores(model)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, on_host", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)])
def test_replayed_graphs_equal_the_eager_forward_for_new_contents(tiny, dtype, on_host):
    """With `on_host`, the batches come from the host, and a replay's batch moves in one copy
    straight into the graph's inputs (`_Graph.load`)."""
    template, model, graphed = _on_cuda(tiny, dtype)
    colours = [(220, 20, 20), (220, 20, 20), (20, 220, 20), (20, 20, 220)]
    assert graphed.capture_at == 3
    with torch.no_grad():
        for colour in colours:
            host = _batch(template, colour)
            batch = host.to("cuda")
            torch.testing.assert_close(graphed(host if on_host else batch), model(batch), rtol=1e-5, atol=1e-6)
    # Two sightings eager, the third captures (and replays), then replays with other images
    # (the same layout).
    assert {name: graphed.stats[name] for name in ("eager", "captures", "replays", "failed")} == {
        "eager": 2, "captures": 1, "replays": 2, "failed": 0}
    assert not graphed.failed
    if on_host:  # the replays' batches went into the graph's own inputs
        (graph,) = graphed.graphs.values()
        loaded = graph.load(_batch(template, (20, 20, 220)))
        assert loaded is not None and all(a is b for a, b in zip(loaded.device_tensors(), graph.tensors))


@pytest.mark.gpu
def test_a_graph_replayed_after_many_other_layouts_still_equals_eager(tiny):
    """Eager calls of other layouts churn flash-linear-attention's plan memo; the captured graph
    owns its plans, so its replay stays right."""
    template, model, graphed = _on_cuda(tiny, torch.bfloat16)
    with torch.no_grad():
        for _ in range(graphed.capture_at):
            graphed(_batch(template, (220, 20, 20)).to("cuda"))
        for index in range(12):
            graphed(_batch(template, (20, 220, 20), note="another note " * (index + 1)).to("cuda"))
        batch = _batch(template, (20, 20, 220)).to("cuda")
        torch.testing.assert_close(graphed(batch), model(batch), rtol=1e-5, atol=1e-6)
    assert graphed.stats["captures"] == 1 and not graphed.failed


@pytest.mark.gpu
def test_graphs_are_dropped_when_the_model_changes(tiny):
    template, model, graphed = _on_cuda(tiny, torch.bfloat16)
    batch = _batch(template, (220, 20, 20)).to("cuda")
    with torch.no_grad():
        for _ in range(graphed.capture_at):
            graphed(batch)
        assert len(graphed.graphs) == 1
        # In place, on a weight the forward derives a cached constant from (RMSNorm's 1 + weight).
        model.backbone.language_model.layers[0].input_layernorm.weight.add_(0.5)
        torch.testing.assert_close(graphed(batch), model(batch), rtol=1e-5, atol=1e-6)
        assert len(graphed.graphs) == 0
        graphed(batch)  # seen three times again: captured with the new constant
        torch.testing.assert_close(graphed(batch), model(batch), rtol=1e-5, atol=1e-6)
        assert graphed.stats["captures"] == 2 and len(graphed.graphs) == 1
        model.changed()
        graphed(batch)
        assert graphed.stats["captures"] == 2 and len(graphed.graphs) == 0  # seen again from scratch


@pytest.mark.gpu
def test_deferred_layouts_are_captured_when_idle_and_never_on_a_request(tiny):
    """With `deferred`, the sighting that would capture runs as the others did (eagerly here, no
    buckets), `capture_pending` captures later, and the layout then replays with the eager
    logits; a model changed in the meantime drops what was pending."""
    template, model, graphed = _on_cuda(tiny, torch.bfloat16)
    graphed.deferred = True
    with torch.no_grad():
        for colour in [(220, 20, 20)] * graphed.capture_at + [(20, 220, 20)]:
            host = _batch(template, colour)
            torch.testing.assert_close(graphed(host), model(host.to("cuda")), rtol=1e-5, atol=1e-6)
        assert {name: graphed.stats[name] for name in ("eager", "captures", "replays")} == {
            "eager": graphed.capture_at + 1, "captures": 0, "replays": 0}
        assert len(graphed.pending) == 1
        assert graphed.capture_pending() and not graphed.pending
        assert graphed.stats["captures"] == graphed.stats["idle_captures"] == 1
        assert not graphed.capture_pending()  # nothing left
        host = _batch(template, (20, 20, 220))
        torch.testing.assert_close(graphed(host), model(host.to("cuda")), rtol=1e-5, atol=1e-6)
        assert graphed.stats["replays"] == 1
        longer = [_batch(template, (220, 20, 20), note="a longer note " * 30) for _ in range(graphed.capture_at)]
        for host in longer:
            graphed(host)
        assert len(graphed.pending) == 1
        model.backbone.language_model.layers[0].input_layernorm.weight.add_(0.5)
        assert not graphed.capture_pending() and not graphed.pending and not graphed.graphs


@pytest.mark.gpu
def test_a_pending_layout_that_fails_is_dropped_and_the_rest_still_captured(tiny, monkeypatch):
    """A pending batch that can no longer be embedded (its image's cached features evicted, in
    a server) is dropped, the call still counts as work done, and the next layout is captured."""
    template, model, graphed = _on_cuda(tiny, torch.bfloat16)
    graphed.deferred = True
    with torch.no_grad():
        for note in ("a note " * 5, "another note " * 9):
            for _ in range(graphed.capture_at):
                graphed(_batch(template, (220, 20, 20), note=note))
    assert len(graphed.pending) == 2
    embeddings = model.embeddings

    def evicted(batch):
        monkeypatch.setattr(model, "embeddings", embeddings)
        raise RuntimeError("the image's cached features are gone")

    monkeypatch.setattr(model, "embeddings", evicted)
    assert graphed.capture_pending() and len(graphed.pending) == 1 and not graphed.graphs
    assert graphed.capture_pending() and not graphed.pending and len(graphed.graphs) == 1
    assert not graphed.capture_pending()
    host = _batch(template, (20, 220, 20), note="another note " * 9)
    with torch.no_grad():
        torch.testing.assert_close(graphed(host), model(host.to("cuda")), rtol=1e-5, atol=1e-6)
    assert graphed.stats["replays"] == 1


def test_deferred_captures_are_a_no_op_on_the_cpu(tiny):
    model, graphed = _on_cpu(tiny)
    graphed.deferred = True
    batch = _batch(tiny.template(), (220, 20, 20))
    with torch.no_grad():
        for _ in range(graphed.capture_at + 1):
            assert torch.equal(graphed(batch), model(batch))
    assert not graphed.pending and not graphed.capture_pending() and graphed.stats["eager"] == graphed.capture_at + 1


def _varied(template):
    """Host batches of distinct layouts: images in the prefix and in a row, text only, long rows,
    one question of a long state (a one-row bucket's), and a state of four images (one of them
    twice) beside a text request."""
    batches = [batch_of(template, requests) for requests in LAYOUTS.values()]
    notes = [({"note": "a parcel " * (5 + 7 * index)}, _questions_of(index)) for index in range(4)]
    notes.append(({"note": "a long parcel of many words " * 40}, _questions_of(0)))
    red, green, blue = (square_image(colour) for colour in ((220, 20, 20), (20, 220, 20), (20, 20, 220)))
    several = [({"photos": [red, green], "note": "a listing", "detail": {"label": blue, "again": red}},
                _questions_of(2)), ("a text request beside it", _questions_of(1))]
    return batches + [batch_of(template, [note]) for note in notes] + [batch_of(template, several)]


def _questions_of(count):
    return {f"q{n}": {"type": "noul", "instructions": f"Is it number {n}?"} for n in range(count + 1)}


@pytest.mark.gpu
@pytest.mark.parametrize("whole", [False, True], ids=["pieces, attention by sequence", "whole graphs, one-row dense"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bucket_graphs_serve_first_seen_layouts_with_the_eager_logits(tiny, dtype, whole, monkeypatch):
    """Every host batch of a new layout replays its bucket's graphs (captured by `prepare`, none
    on a request), with the logits of the eager forward of the batch alone: to 1e-4 in float32;
    in bf16 (padding changes the matrix products' shapes) each held to the model in float64,
    the replay erring at most twice what the eager forward errs plus 2% of the largest logit
    (the two differed by 2.75% of the largest logit of this tiny model on the H200). Where rows
    continue prefixes, a bucket's attention merges two bf16 outputs, its rows' own and their
    prefix's (`kernels.chunked_fork_attention`), one rounding more than the eager forward's one
    softmax: on an H100 the shared-prefix batch erred 4.4% of the largest logit against the
    eager forward's 1.5%, over a floor of 1% (each merge is held to a float32 reference in
    `test_chunked_fork_flash_attention_matches_its_reference_and_replays_in_a_graph`, and the
    float32 replay to the eager forward at 1e-4). With the
    defaults, every bucket is one graph, attention in it (`cuda_graphs.WHOLE_BUCKETS`; by chunk
    where rows continue prefixes, `kernels.chunked_fork_attention`), and a one-row bucket's
    attention is one sequence (`attention.DENSE_LONE`); also with both off: a bucket with
    prefixes in pieces, attention eager between them, a one-row bucket's by sequence."""
    from dohnuts.ops import attention
    from dohnuts.runtime import cuda_graphs
    from dohnuts.runtime.buckets import all_buckets, bucket_for, pad_to_bucket

    monkeypatch.setattr(attention, "DENSE_LONE", whole)
    monkeypatch.setattr(cuda_graphs, "WHOLE_BUCKETS", whole)
    template, model, graphed = _on_cuda(tiny, dtype)
    exact = copy.deepcopy(model).double().cpu()
    graphed.pad_id = template.pad_id
    buckets = [bucket for bucket in all_buckets() if bucket.tokens <= 1536]
    assert graphed.prepare(buckets) == len(buckets)
    batches = _varied(template)
    assert any(bucket_for(batch, graphed.buckets).single for batch in batches)  # one graph, attention in it
    used = [graphed.buckets[bucket_for(batch, graphed.buckets)] for batch in batches]
    assert any(graphs.fork is not None for graphs in used)  # rows continuing prefixes too
    assert all(len(graphs.graphs) == 1 for graphs in used if whole or graphs.fork is None)
    with torch.no_grad():
        for batch in batches:
            ours = graphed(batch)
            eager = model(batch.to("cuda"))
            if dtype == torch.float32:
                torch.testing.assert_close(ours, eager, rtol=1e-4, atol=1e-4)
            else:  # a floor of 2% of the largest logit: see the docstring
                assert errs_like(ours, eager, exact(batch), floor=2e-2)
    assert graphed.stats["bucket_replays"] == len(batches)
    assert graphed.stats["captures"] == graphed.stats["eager"] == 0 and graphed.stats["padding_tokens"] > 0
    # A padded text batch moves straight into its bucket's inputs: the replay copies nothing more.
    text = next(batch for batch in batches if not batch.image_keys and bucket_for(batch, graphed.buckets).single)
    graphs = graphed.buckets[bucket_for(text, graphed.buckets)]
    loaded = graphs.load(pad_to_bucket(text, graphs.bucket, template.pad_id))
    assert loaded is not None and all(a is b for a, b in zip(loaded.device_tensors(), graphs.inputs.tensors))


@pytest.mark.gpu
def test_one_long_sequence_in_64_token_steps_gives_the_scans_logits_eager_and_in_bucket_graphs(tiny, monkeypatch):
    """With one long sequence walked in 64-token steps from 64 tokens on (`scan.ALONE_FROM`, so
    the tiny model's prefixes alone and its one-question request's one-row bucket take it), the
    eager forward and the bucket graphs captured with it give the logits of the eager forward
    without it, to 1e-4 in float32; the path ran in both (counted), and the one-row bucket
    served its request."""
    from dohnuts.ops.delta_rule import scan
    from dohnuts.runtime.buckets import all_buckets, bucket_for

    template, model, graphed = _on_cuda(tiny, torch.float32)
    batches = _varied(template)
    walks = []
    chunk_path = scan._chunk_path

    def counted(*args, **kwargs):
        walks.append(args[11].shape)  # each call's cu_seqlens
        return chunk_path(*args, **kwargs)

    monkeypatch.setattr(scan, "_chunk_path", counted)
    with torch.no_grad():
        monkeypatch.setattr(scan, "ALONE_FROM", None)
        plain = [model(batch.to("cuda")) for batch in batches]
        assert not walks, "the 64-token steps ran with ALONE_FROM None: the test would compare them with themselves"
        monkeypatch.setattr(scan, "ALONE_FROM", 64)
        eager = [model(batch.to("cuda")) for batch in batches]
        assert walks, "no eager forward walked one long sequence in 64-token steps"
        walks.clear()
        graphed.pad_id = template.pad_id
        buckets = [bucket for bucket in all_buckets() if bucket.tokens <= 1536]
        assert graphed.prepare(buckets) == len(buckets)
        assert walks, "no bucket graph captured the 64-token steps"
        assert any(bucket_for(batch, graphed.buckets).single for batch in batches), "no batch took a one-row bucket"
        for batch, expected, ours in zip(batches, plain, eager):
            torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(graphed(batch), expected, rtol=1e-4, atol=1e-4)
    assert graphed.stats["bucket_replays"] == len(batches)


@pytest.mark.gpu
def test_bucket_graphs_are_captured_again_after_the_model_changes(tiny):
    from dohnuts.runtime.buckets import Bucket

    template, model, graphed = _on_cuda(tiny, torch.bfloat16)
    graphed.pad_id = template.pad_id
    graphed.prepare([Bucket(256, 256, False), Bucket(64, 128, False)])  # the first layout: 131 prefix tokens
    batch = _varied(template)[0]
    with torch.no_grad():
        before = graphed(batch)
        model.backbone.language_model.layers[0].input_layernorm.weight.add_(0.5)
        ours, eager = graphed(batch), model(batch.to("cuda"))
        truth = copy.deepcopy(model).double().cpu()(batch)
    assert errs_like(ours, eager, truth) and not torch.equal(ours, before)  # the new weights, not the old
    assert graphed.stats["bucket_replays"] == 2 and len(graphed.buckets) == 2


@pytest.mark.gpu
def test_a_bucket_replayed_after_an_unnoticed_change_reads_constants_it_holds(tiny):
    """A bucket's graphs read the weights' versions after their launch: when a weight changed in
    place and an eager forward has since replaced (and freed) the constant derived from it, the
    replay still reads the old constant, which its graphs hold, and the batch runs again on the
    new weights."""
    from dohnuts.runtime.buckets import Bucket

    template, model, graphed = _on_cuda(tiny, torch.bfloat16)
    graphed.pad_id = template.pad_id
    graphed.prepare([Bucket(256, 256, False), Bucket(64, 128, False)])
    batch = _varied(template)[0]
    with torch.no_grad():
        before = graphed(batch)
        model.backbone.language_model.layers[0].input_layernorm.weight.add_(0.5)
        eager = model(batch.to("cuda"))  # derives the new constant; the old one is the graphs' alone
        torch.cuda.empty_cache()
        ours = graphed(batch)
        truth = copy.deepcopy(model).double().cpu()(batch)
    assert errs_like(ours, eager, truth) and not torch.equal(ours, before)
    assert graphed.stats["bucket_replays"] == 2 and len(graphed.buckets) == 2


@pytest.mark.gpu
def test_a_layout_a_bucket_serves_is_never_captured_on_a_request(tiny):
    """A host batch that recurs past `capture_at` while a bucket fits it replays the bucket each
    time (its logits the same): no capture stalls it. Deferred, as the server runs, the layout
    waits for `capture_pending` instead."""
    from dohnuts.runtime.buckets import all_buckets

    template, model, graphed = _on_cuda(tiny, torch.bfloat16)
    graphed.pad_id = template.pad_id
    graphed.prepare([bucket for bucket in all_buckets() if bucket.tokens <= 512])
    host = _batch(template, (220, 20, 20))
    with torch.no_grad():
        first = graphed(host)
        for _ in range(graphed.capture_at + 1):
            assert torch.equal(graphed(host), first)
        assert graphed.stats["captures"] == 0 and graphed.stats["bucket_replays"] == graphed.capture_at + 2
        graphed.deferred = True
        for _ in range(graphed.capture_at):
            graphed(host)
        assert len(graphed.pending) == 1 and graphed.stats["captures"] == 0
        assert graphed.capture_pending() and graphed.stats["idle_captures"] == 1
        # The layout's own graph, unpadded: the eager forward's logits.
        torch.testing.assert_close(graphed(host), model(host.to("cuda")), rtol=1e-5, atol=1e-6)
        assert graphed.stats["replays"] == 1
