"""The decision model against Hugging Face's Qwen3_5Model: hidden states and logits at the markers."""

import inspect

import torch
from helpers import encoded
from PIL import Image

from dohnuts.model.base import load_backbone
from dohnuts.model.decision import new_head
from dohnuts.runtime.checkpoint import assemble
from dohnuts.schema import parse_request

TOLERANCE = 1e-4  # float32, max abs error on final hidden states


def _image() -> Image.Image:
    image = Image.new("RGB", (64, 48), "white")
    image.paste((220, 20, 20), (8, 8, 40, 40))
    return image


def _rows(template):
    """An image request with two questions whose shared beginning (image block and a long state)
    exceeds 64 tokens, a text request with one question, and a request of three vision blocks
    (two images) with two questions: rows of unequal length, two shared prefixes and one row
    without."""
    questions = {
        "colour": {"type": "choice", "instructions": "What colour is the square?",
                   "criteria": ["red", "green", "blue"]},
        "big": {"type": "noul", "instructions": "Is it big?"},
    }
    note = "a red square on a white page, drawn by hand for the test " * 3
    image_request = parse_request({"note": note, "image": _image()}, questions, template.reserved)
    rows, images = encoded(template, image_request)
    text_request = parse_request("Customer: I was billed twice.", {
        "urgent": {"type": "score", "instructions": "How urgent?", "criteria": ["low", "high", "critical"]}},
        template.reserved)
    rows += template.encode(text_request, 4096)
    # Several images in one state: two, one of them twice, between texts and inside a list.
    other = Image.new("RGB", (40, 72), "black")
    several = parse_request({"before": _image(), "note": note, "after": [other, "then", _image()]}, questions,
                            template.reserved)
    own, images = encoded(template, several, images=images)
    return rows + own, images


def _hugging_face_hidden(backbone, row, images):
    """Reference: Hugging Face's own forward (and its own M-RoPE positions) on one unpadded row."""
    ids = torch.tensor([row.input_ids])
    kwargs = {}
    if row.images:
        placed = [images[index] for index in row.images]
        kwargs = {"pixel_values": torch.cat([image.patches() for image in placed]),
                  "image_grid_thw": torch.cat([image.grid_thw for image in placed])}
        if "mm_token_type_ids" in inspect.signature(backbone.forward).parameters:
            kwargs["mm_token_type_ids"] = (ids == backbone.config.image_token_id).int()
    return backbone(input_ids=ids, use_cache=False, **kwargs).last_hidden_state[0]


def _model_and_batch(tiny):
    template = tiny.template()
    backbone = load_backbone(tiny.base, torch.float32).eval()
    model = assemble(backbone, new_head(backbone.config.text_config.hidden_size, 0.01)).eval()
    rows, images = _rows(template)
    return model, rows, images, template.collate(rows, images)


def _own_tokens(batch, index):
    """The slice of the packed rows' part that holds row `index`'s own tokens."""
    return slice(int(batch.cu_seqlens[index]), int(batch.cu_seqlens[index + 1]))


def test_forward_matches_hugging_face_with_images_shared_prefix_and_unequal_rows(tiny):
    model, rows, images, batch = _model_and_batch(tiny)
    assert batch.fork is not None and batch.fork.parents.tolist() == [0, 0, -1, 1, 1]  # shared, and a row without
    assert len(images) == 3 and rows[3].images == (1, 2, 1)  # the same image twice in a state: encoded once
    backbone = model.backbone
    with torch.no_grad():
        ours = model.hidden_states(batch)
        for index, row in enumerate(rows):
            reference = _hugging_face_hidden(backbone, row, images)
            own = ours[_own_tokens(batch, index)]
            error = (own - reference[len(row.input_ids) - len(own):]).abs().max().item()
            assert error <= TOLERANCE, f"row {index}: max abs error {error}"


def test_logits_are_read_at_the_markers(tiny):
    model, rows, _, batch = _model_and_batch(tiny)
    with torch.no_grad():
        hidden = model.hidden_states(batch)
        logits = model(batch)
    for index, row in enumerate(rows):
        own = hidden[_own_tokens(batch, index)]
        expected = model.head(own[torch.tensor(row.markers) - (len(row.input_ids) - len(own))]).squeeze(-1)
        torch.testing.assert_close(logits[index, : len(row.markers)], expected)
        assert (logits[index, len(row.markers):] == 0).all()
