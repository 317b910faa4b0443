"""Packed batches: prefix planning (the whole shared beginning of at least 64 tokens, before
the first marker, fallbacks) and shared
prefixes against the unshared computation in logits and gradients."""


import copy

import pytest
import torch
from helpers import errs_like, state_of_tokens

from dohnuts.config import LoraConfig
from dohnuts.inputs.batch import EncodedImage, Row, mrope_positions, pack_rows, prefix_groups
from dohnuts.ops.plan import chunk_plan, padded_plan
from dohnuts.runtime.checkpoint import build_training_model
from dohnuts.schema import parse_request

QUESTION = None  # rows built by hand carry no question object


THREE_TYPES = {  # one question of each type
    "plan": {"type": "choice", "instructions": "Which plan?", "criteria": ["free", "business", "enterprise"]},
    "angry": {"type": "noul", "instructions": "Is the customer angry?"},
    "urgent": {"type": "score", "instructions": "How urgent?", "criteria": ["low", "mid", "high"]},
}


def _row(ids, shared, markers, image=None, images=None):
    """A row of one 2x2 image (`image`: its batch index) or of several (`images`), or none."""
    images = images if images is not None else (() if image is None else (image,))
    return Row(tuple(ids), tuple(markers), QUESTION, shared, tuple(images), ((2, 2),) * len(images))


def test_split_is_the_whole_shared_beginning_and_never_passes_the_first_marker():
    common = list(range(10, 140))  # 130 tokens in common
    rows = [_row(common + [1, 2, 3, 0], 130, [133]), _row(common + [4, 0], 130, [131])]
    assert prefix_groups(rows) == [(130, [0, 1])]
    # The first marker at 100 bounds the split: 100, although 130 tokens are shared.
    marked = common[:100] + [0] + common[100:]
    rows = [_row(marked + [1, 0], 130, [100, 132]), _row(marked + [0], 130, [100, 131])]
    assert prefix_groups(rows) == [(100, [0, 1])]
    # A marker before the 64th token leaves nothing worth sharing.
    early = common[:50] + [0] + common[50:]
    rows = [_row(early + [1, 0], 130, [50, 132]), _row(early + [0], 130, [50, 131])]
    assert prefix_groups(rows) == []


@pytest.mark.parametrize("shared, split", [(63, None), (64, 64), (127, 127), (128, 128)])
def test_prefix_lengths_at_the_sharing_threshold(shared, split):
    common = list(range(10, 10 + shared))
    rows = [_row(common + [1, 0], shared, [shared + 1]), _row(common + [2, 3, 0], shared, [shared + 2])]
    assert prefix_groups(rows) == ([] if split is None else [(split, [0, 1])])


def test_no_shared_prefix_for_a_single_row_differing_rows_or_differing_images():
    common = list(range(10, 90))
    assert prefix_groups([_row(common + [0], 80, [80])]) == []
    differing = [_row(common + [0], 80, [80]), _row([5] + common[1:] + [0], 80, [80])]
    assert prefix_groups(differing) == []
    # Same token ids (image pads look alike) but two different images: nothing is shared.
    images = [_row(common + [0], 80, [80], image=0), _row(common + [0], 80, [80], image=1)]
    assert prefix_groups(images) == []
    same_image = [_row(common + [0], 80, [80], image=0), _row(common + [1, 0], 80, [81], image=0)]
    assert prefix_groups(same_image) == [(80, [0, 1])]


def test_several_prefixes_and_unshared_rows_in_one_batch_rebuild_every_row():
    first, second = list(range(10, 80)), list(range(100, 240))
    rows = [_row(first + [1, 0], 70, [71]), _row(second + [2, 0], 140, [141]), _row([7, 8, 0], 2, [2]),
            _row(first + [3, 4, 0], 70, [72]), _row(second + [0], 140, [140])]
    batch = pack_rows(rows, [], image_pad_id=-1)
    assert batch.fork.parents.tolist() == [0, 1, -1, 0, 1]
    assert batch.prefix_cu_seqlens.tolist() == [0, 70, 210]
    prefix = batch.input_ids[: batch.prefix_tokens]
    starts = batch.prefix_cu_seqlens.tolist()
    for index, row in enumerate(rows):
        own = batch.input_ids[batch.prefix_tokens:][batch.cu_seqlens[index]:batch.cu_seqlens[index + 1]]
        parent = int(batch.fork.parents[index])
        head = prefix[starts[parent]:starts[parent + 1]] if parent >= 0 else prefix[:0]
        assert torch.cat([head, own]).tolist() == list(row.input_ids)
        assert own[batch.markers[index, 0] - batch.cu_seqlens[index]].item() == 0  # the marker token
    assert batch.input_tokens == sum(len(row.input_ids) for row in rows)
    assert batch.computed_tokens == batch.input_tokens - 70 - 140  # each prefix once instead of twice


def test_image_block_cut_by_the_split_feeds_each_part_its_features():
    """An image of 4 tokens at positions 62..65: the prefix holds 2 of them, each row 2."""
    ids = [9] * 61 + [50] + [77] * 4 + [51] + list(range(10, 20))
    # The template marks 64 tokens as the rows' common beginning: the split is there.
    rows = [_row(ids + [1, 0], 64, [len(ids) + 1], image=0), _row(ids + [0], 64, [len(ids)], image=0)]
    image = EncodedImage(torch.zeros(16, 3), torch.tensor([[1, 4, 4]]), "one image")
    batch = pack_rows(rows, [image], image_pad_id=77)
    assert batch.image_slots.tolist() == [62, 63, 64 + 0, 64 + 1, 64 + 15, 64 + 16]
    assert batch.image_sources.tolist() == [0, 1, 2, 3, 2, 3]
    assert (batch.input_ids[batch.image_slots] == 77).all()
    full = mrope_positions(rows[0], len(rows[0].input_ids), 77)
    assert torch.equal(batch.position_ids[:, :64], full[:, :64])
    assert torch.equal(batch.position_ids[:, 64:64 + len(rows[0].input_ids) - 64], full[:, 64:])


def test_positions_of_a_mixed_batch_rebuild_every_rows_own_mrope_positions():
    """Text rows, rows whose image lies wholly in their shared prefix (their own part shifted
    as the image leaves it), an image cut by the split and a lone image row: each row's
    positions, its prefix's then its own, are `mrope_positions` of the row alone."""
    before = [9] * 61 + [50] + [77] * 4 + [51]  # an image block at 62..65, cut by a split at 64
    after = [9] * 3 + [50] + [77] * 4 + [51] + list(range(10, 70))  # the block wholly before 64
    text = list(range(100, 180))
    rows = [_row(before + [1, 0], 64, [len(before) + 1], image=0),  # 64 tokens marked common
            _row(before + [2, 3, 0], 64, [len(before) + 2], image=0),
            _row(text + [4, 0], 80, [81]), _row(after + [5, 0], len(after), [len(after) + 1], image=1),
            _row(text + [6, 7, 0], 80, [82]), _row(after + [8, 0], len(after), [len(after) + 1], image=1),
            _row([50] + [77] * 4 + [51, 3, 0], 0, [7], image=2)]
    images = [EncodedImage(torch.zeros(16, 3), torch.tensor([[1, 4, 4]]), key) for key in "abc"]
    batch = pack_rows(rows, images, image_pad_id=77)
    assert batch.fork.parents.tolist() == [0, 0, 1, 2, 1, 2, -1]
    prefix = batch.position_ids[:, : batch.prefix_tokens]
    own = batch.position_ids[:, batch.prefix_tokens:]
    starts, bounds = batch.prefix_cu_seqlens.tolist(), batch.cu_seqlens.tolist()
    for index, row in enumerate(rows):
        parent = int(batch.fork.parents[index])
        head = prefix[:, starts[parent]:starts[parent + 1]] if parent >= 0 else prefix[:, :0]
        rebuilt = torch.cat([head, own[:, bounds[index]:bounds[index + 1]]], 1)
        assert torch.equal(rebuilt, mrope_positions(row, len(row.input_ids), 77)), index
    text_rows = pack_rows([rows[2], rows[4]], [], image_pad_id=77)
    assert text_rows.position_ids.is_contiguous() and torch.equal(text_rows.position_ids[0], text_rows.position_ids[2])


def test_rows_of_several_images_get_each_blocks_features_and_positions_cut_anywhere():
    """Rows with two image blocks (the same image twice in one, two images in another), split
    inside the second block: every slot reads its own image's feature rows, and each row's
    positions, its prefix's then its own, are `mrope_positions` of the row alone."""
    two = [9] * 50 + [50] + [77] * 4 + [51] + [9] * 6 + [50] + [77] * 4 + [51] + [12, 13]  # blocks at 51, 63
    rows = [_row(two + [1, 0], 65, [len(two) + 1], images=(0, 1)), _row(two + [2, 0], 65, [len(two) + 1],
                                                                       images=(0, 1)),
            _row(two + [3, 0], 0, [len(two) + 1], images=(1, 1))]
    images = [EncodedImage(torch.zeros(16, 3), torch.tensor([[1, 4, 4]]), key) for key in "ab"]
    batch = pack_rows(rows, images, image_pad_id=77)
    assert batch.prefix_tokens == 65 and batch.fork.parents.tolist() == [0, 0, -1]
    slots, sources = batch.image_slots.tolist(), batch.image_sources.tolist()
    # The prefix holds image 0 whole and 2 tokens of image 1 (feature rows 4..7 follow image 0's 0..3).
    assert slots[:6] == [51, 52, 53, 54, 63, 64] and sources[:6] == [0, 1, 2, 3, 4, 5]
    assert sources[6:10] == [6, 7] * 2 and sources[10:] == [4, 5, 6, 7] * 2  # rows 0 and 1's rest, row 2 whole
    assert (batch.input_ids[batch.image_slots] == 77).all()
    prefix, own = batch.position_ids[:, :65], batch.position_ids[:, 65:]
    bounds = batch.cu_seqlens.tolist()
    for index, row in enumerate(rows):
        head = prefix if index < 2 else prefix[:, :0]
        rebuilt = torch.cat([head, own[:, bounds[index]:bounds[index + 1]]], 1)
        assert torch.equal(rebuilt, mrope_positions(row, len(row.input_ids), 77)), index
    full = mrope_positions(rows[2], len(rows[2].input_ids), 77)
    # Each 2x2 block takes positions (p, p + h, p + w) and leaves max(h, w) = 2 to the text after it.
    assert full[:, 51:55].tolist() == [[51] * 4, [51, 51, 52, 52], [51, 52, 51, 52]]
    assert full[0, 55].item() == 53 and full[0, 63].item() == 61 and full[0, 67].item() == 63


def test_shared_prefixes_of_64_and_127_tokens_match_unshared_logits_and_gradients(tiny):
    """Two requests whose beginnings are exactly 64 and 127 tokens, and a one-question request,
    in one batch: logits and LoRA and head gradients equal the unshared batch (float64, 1e-5
    relative)."""
    template = tiny.template()
    questions = THREE_TYPES
    rows = []
    for tokens in (64, 127):
        rows += template.encode(parse_request(state_of_tokens(template, tokens), questions, template.reserved), 4096)
    rows += template.encode(parse_request("short", {"plan": questions["plan"]}, template.reserved), 4096)
    assert [row.shared for row in rows[:6:3]] == [64, 127]
    shared = template.collate(rows, [])
    unshared = template.collate([row._replace(shared=0) for row in rows], [])
    assert shared.fork is not None and unshared.fork is None
    assert shared.prefix_cu_seqlens.tolist() == [0, 64, 64 + 127]
    assert shared.computed_tokens == unshared.computed_tokens - 2 * 64 - 2 * 127

    model, _ = build_training_model(tiny.base, "float32", LoraConfig(), 0.01, seed=0)
    model.double().train()
    model.activation_checkpointing = True
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, 0.05)
    trainable = [p for p in model.parameters() if p.requires_grad]
    weights = torch.randn(shared.markers.shape, dtype=torch.float64)
    results = []
    for batch in (shared, unshared):
        logits = model(batch)
        results.append((logits.detach(), torch.autograd.grad((logits * weights).sum(), trainable)))
    (logits, grads), (expected_logits, expected_grads) = results
    assert ((logits - expected_logits).abs().max() / expected_logits.abs().max()).item() <= 1e-5
    with torch.no_grad():  # without autograd, prefixes and rows write one output instead of joining two
        inference = model(shared)
    assert ((inference - expected_logits).abs().max() / expected_logits.abs().max()).item() <= 1e-5
    for ours, reference in zip(grads, expected_grads):
        assert ((ours - reference).abs().max() / reference.abs().max().clamp_min(1e-12)).item() <= 1e-5



def test_chunk_plan_lists_every_64_token_chunk_of_every_sequence():
    assert chunk_plan([63, 1, 130, 64]).tolist() == [[0, 0], [1, 0], [2, 0], [2, 1], [2, 2], [3, 0]]
    assert chunk_plan([]).shape == (0, 2)
    assert chunk_plan([0, 5], 4).tolist() == [[1, 0], [1, 1]] and chunk_plan([5]).dtype == torch.int32


def test_padded_plan_names_the_empty_last_sequence_or_refuses():
    assert padded_plan([63, 1, 70, 0], 6).tolist() == [[0, 0], [1, 0], [2, 0], [2, 1], [3, 0], [3, 0]]
    assert padded_plan([0], 2).tolist() == [[0, 0], [0, 0]]
    with pytest.raises(ValueError, match="empty last sequence"):
        padded_plan([63, 1], 4)
    with pytest.raises(ValueError, match="make 4"):
        padded_plan([63, 1, 70, 0], 3)


def test_plans_of_a_few_sequences_in_python_equal_numpys():
    """Lists of up to `FEW_SEQUENCES` lengths take a plain-Python path: the same chunk plans and
    cumulative lengths, dtypes and shapes as the numpy path (arrays always take), empty included."""
    import numpy as np

    from dohnuts.ops.plan import FEW_SEQUENCES, cumulative

    generator = torch.Generator().manual_seed(2)
    for count in range(FEW_SEQUENCES + 3):
        for _ in range(5):
            lengths = torch.randint(0, 300, (count,), generator=generator).tolist()
            for size in (64, 16):
                ours, numpys = chunk_plan(lengths, size), chunk_plan(np.array(lengths, dtype=np.int64), size)
                assert ours.dtype == numpys.dtype == torch.int32 and torch.equal(ours, numpys), (lengths, size)
            ours, numpys = cumulative(lengths), cumulative(np.array(lengths, dtype=np.int64))
            assert ours.dtype == numpys.dtype == torch.int32 and torch.equal(ours, numpys), lengths


@pytest.mark.gpu
def test_chunk_plan_equals_flash_linear_attentions_own():
    from fla.ops.utils.index import prepare_chunk_indices

    lengths = [63, 1, 130, 64, 200]
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    assert torch.equal(chunk_plan(lengths).cuda(), prepare_chunk_indices(cu, 64).to(torch.int32))


@pytest.mark.gpu
def test_shared_prefixes_match_unshared_rows_end_to_end_on_cuda_in_bf16(tiny):
    """The whole decision model in bf16 on the GPU (fused kernels, flash attention, our delta
    rule of forked rows at inference): a batch of requests with shared prefixes against the same
    rows run whole, in logits (eval, no gradient) and in LoRA and head gradients (training).

    Each path is held to the same model in float64 on the CPU, in logits and in gradients,
    since two bf16 paths of this tiny random model differ by about as much as each errs: on the
    H200 the rows run whole erred 1.2% to 3.5% of the largest logit and the shared ones 1.1% to
    6.0%, over five draws of LoRA weights (GPU tests at d99f160: docs/changelog.md), and their
    gradients differed from each other by 5.2% of the largest (at 61e955b). Sharing reorders the
    same arithmetic, so its error must stay of the unshared rows' order; a wrong fork of states
    errs by the logits' own size."""
    template = tiny.template()
    questions = THREE_TYPES
    rows = []
    for tokens in (127, 200):
        rows += template.encode(parse_request(state_of_tokens(template, tokens), questions, template.reserved), 4096)
    shared = template.collate(rows, [])
    whole = template.collate([row._replace(shared=0) for row in rows], [])
    assert shared.fork is not None and whole.fork is None
    model, _ = build_training_model(tiny.base, "bfloat16", LoraConfig(), 0.5, seed=0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, 0.05)
    exact = copy.deepcopy(model).double().eval()
    model.to("cuda")
    model.eval()
    with torch.no_grad():
        ours, reference, truth = model(shared.to("cuda")), model(whole.to("cuda")), exact(whole)
    assert errs_like(ours, reference, truth)
    model.train()
    exact.train()
    lora = [p for name, p in model.named_parameters() if p.requires_grad]
    weights = torch.randn(reference.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    grads = torch.autograd.grad((model(shared.to("cuda")) * weights.to("cuda", torch.float32)).sum(), lora)
    expected = torch.autograd.grad((model(whole.to("cuda")) * weights.to("cuda", torch.float32)).sum(), lora)
    truths = torch.autograd.grad((exact(whole) * weights).sum(), [p for p in exact.parameters() if p.requires_grad])
    for grad, reference_grad, true_grad in zip(grads, expected, truths, strict=True):
        assert errs_like(grad, reference_grad, true_grad)


@pytest.mark.gpu
def test_a_request_batch_moves_in_one_packed_copy_bitwise(tiny):
    """`move_packed`: a request's host batch (image, shared prefix) laid out by `packed_layout`
    (aligned starts) arrives in one device buffer bitwise equal to tensor-by-tensor copies, and a
    second batch reusing the thread's pinned buffer does not disturb the first's copy."""
    from helpers import batch_of, questions, square_image

    from dohnuts.inputs.batch import PACKED_ALIGN, move_packed, packed_layout

    template = tiny.template()
    hosts = [batch_of(template, [({"image": square_image(colour), "note": "two rows share this"}, questions(3)),
                                 ("a text request", questions(2))]) for colour in ("red", "blue")]
    arrivals = []
    for host in hosts:
        tensors = host.device_tensors()
        offsets, total = packed_layout(tensors)
        assert all(offset % PACKED_ALIGN == 0 for offset in offsets)
        target = torch.full((total + 64,), 7, dtype=torch.uint8, device="cuda")
        move_packed(tensors, target, offsets, total)
        arrivals.append((target, tensors, offsets))
    for target, tensors, offsets in arrivals:
        for tensor, offset in zip(tensors, offsets, strict=True):
            size = tensor.numel() * tensor.element_size()
            arrived = target[offset:offset + size].view(tensor.dtype).view(tensor.shape)
            assert torch.equal(arrived.cpu(), tensor)
        assert (target[-64:] == 7).all()  # nothing written past the layout


@pytest.mark.gpu
def test_a_moved_batch_equals_the_batch_moved_tensor_by_tensor(tiny):
    """`Batch.moved`: every device tensor (the fork's too) equals `to`'s, bitwise, with its shape
    and dtype, the host plans untouched; a batch over PACKED_BYTES moves tensor by tensor."""
    from helpers import batch_of, questions, square_image

    from dohnuts.inputs import batch as batches

    template = tiny.template()
    host = batch_of(template, [({"image": square_image("red"), "note": "three rows share this note " * 12},
                                questions(3)),
                               ("a text request", questions(2))])
    assert host.fork is not None
    moved, plain = host.moved(torch.device("cuda")), host.to("cuda")
    for ours, theirs in zip(moved.device_tensors(), plain.device_tensors(), strict=True):
        assert ours.is_cuda and ours.dtype == theirs.dtype and torch.equal(ours, theirs)
    assert moved.fork.plan() == host.fork.plan() and moved.cu_seqlens_cpu is host.cu_seqlens_cpu
    limit = batches.PACKED_BYTES
    try:
        batches.PACKED_BYTES = 64
        one_by_one = host.moved(torch.device("cuda"))
    finally:
        batches.PACKED_BYTES = limit
    assert all(torch.equal(ours, theirs) for ours, theirs in zip(one_by_one.device_tensors(), plain.device_tensors()))


def test_a_moved_batch_views_its_buffer_as_each_tensor(tiny, monkeypatch):
    """`Batch.moved`'s layout on the CPU (its one copy, `move_packed`, stood in for by a copy of
    the same bytes): each tensor, the fork's and the pixels' too, comes back equal, with its shape
    and dtype, as a view of one buffer; the host plans stay the batch's own."""
    from helpers import LAYOUTS, batch_of

    from dohnuts.inputs import batch as batches

    def copy_bytes(tensors, target, offsets, total):
        for tensor, offset in zip(tensors, offsets, strict=True):
            if tensor.numel():  # as move_packed
                raw = tensor.view(torch.uint8).reshape(-1)
                target[offset:offset + raw.numel()] = raw

    monkeypatch.setattr(batches, "move_packed", copy_bytes)
    template = tiny.template()
    hosts = [batch_of(template, requests) for requests in LAYOUTS.values()]
    assert any(host.fork is not None for host in hosts) and any(host.pixel_values is not None for host in hosts)
    for host in hosts:
        moved = host.moved(torch.device("cpu"))
        assert len({tensor.untyped_storage().data_ptr() for tensor in moved.device_tensors()}) == 1
        for ours, theirs in zip(moved.device_tensors(), host.device_tensors(), strict=True):
            assert ours.dtype == theirs.dtype and ours.shape == theirs.shape and torch.equal(ours, theirs)
        assert (moved.fork is None) == (host.fork is None) and moved.cu_seqlens_cpu is host.cu_seqlens_cpu
        assert moved.fork is None or moved.fork.plan() == host.fork.plan()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_images_of_one_size_make_their_patches_together_as_one_at_a_time(device):
    """A batch's new images in runs of one size (two of 40 x 56, one of 90 x 30, two of 40 x 56
    again) go through `PixelSettings.patches` run by run: bitwise the patches of each image made
    alone, in the batch's image order, where the batch's bytes are (the model's device)."""
    from dohnuts.inputs.pixels import PixelSettings
    from dohnuts.model.base import new_image_processor

    settings = PixelSettings.of(new_image_processor(16, 64 * 64))
    generator = torch.Generator().manual_seed(3)
    shapes = [(40, 56, 3), (40, 56, 3), (90, 30, 3), (40, 56, 3), (40, 56, 3)]
    pixels = [torch.randint(0, 256, shape, generator=generator, dtype=torch.uint8) for shape in shapes]
    images = [EncodedImage(rgb, settings.grid(*rgb.shape[:2]), f"image-{index}", settings)
              for index, rgb in enumerate(pixels)]
    blocks = [int(image.tokens) for image in images]
    ids = []
    for count in blocks:
        ids += [9, 50] + [77] * count + [51]
    row = Row(tuple(ids + [1, 0]), (len(ids) + 1,), QUESTION, 0, tuple(range(len(images))),
              tuple((int(image.grid_thw[0, 1]) // 2, int(image.grid_thw[0, 2]) // 2) for image in images))
    batch = pack_rows([row], images, image_pad_id=77)
    batch.pixel_values = batch.pixel_values.to(device)
    alone = torch.cat([settings.patches(rgb.to(device)) for rgb in pixels])
    assert batch.patches().device.type == device and torch.equal(batch.patches(), alone)
    assert batch.patches().shape[0] == sum(image.tokens * 4 for image in images)
