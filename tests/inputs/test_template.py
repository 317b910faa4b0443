"""The prompt template: rendered text, marker positions, shared beginnings, M-RoPE, budget."""

import inspect

import pytest
import torch
from PIL import Image

from dohnuts.inputs.batch import mrope_positions
from dohnuts.model.base import load_backbone
from dohnuts.schema import parse_request

QUESTIONS = {
    "colour": {"type": "choice", "instructions": "Which colour?", "criteria": {"r": "red", "g": ""}},
    "hot": {"type": "noul", "instructions": "Is it hot?"},
}


def test_rows_render_the_recipe_template_with_one_marker_per_candidate(tiny):
    template = tiny.template()
    request = parse_request({"city": "Oslo"}, QUESTIONS, template.reserved)
    first, second = template.encode(request, 4096)
    text = template.tokenizer.decode(list(first.input_ids))
    marker = tiny.model.marker_token
    assert text == (f'State: {{"city": "Oslo"}}\nchoice question: Which colour?\nOptions:\n'
                    f"- r: red{marker}- g{marker}")
    assert [first.input_ids[i] for i in first.markers] == [template.marker_id] * 2
    assert first.input_ids.count(template.marker_id) == 2
    assert second.markers[-1] == len(second.input_ids) - 1
    # Rows of one request share their beginning token for token.
    shared = len(template.tokenizer('State: {"city": "Oslo"}\n', add_special_tokens=False)["input_ids"])
    assert first.input_ids[:shared] == second.input_ids[:shared]


def test_image_rows_carry_the_vision_block_before_the_state(tiny):
    template = tiny.template()
    request = parse_request({"image": Image.new("RGB", (64, 64), "white")}, QUESTIONS, template.reserved)
    image = template.encode_image(request.image)
    rows = template.encode(request, 4096, 0, image)
    tokens = 64 * 64 // (16 * 16) // 4  # 4x4 patches merged 2x2
    ids = rows[0].input_ids
    assert ids[0] == template.vision_start_id and ids[1 + tokens] == template.vision_end_id
    assert ids[1 : 1 + tokens] == (template.image_pad_id,) * tokens
    assert template.tokenizer.decode(list(ids[2 + tokens :])).startswith("\nState: {}\n")


def test_over_budget_input_is_rejected_not_truncated(tiny):
    template = tiny.template()
    request = parse_request("word " * 200, QUESTIONS, template.reserved)
    length = len(template.encode(request, 4096)[0].input_ids)
    with pytest.raises(ValueError, match=f"{length} tokens, over the budget of {length - 1}"):
        template.encode(request, length - 1)


def test_mrope_positions_match_hugging_face(tiny):
    template = tiny.template()
    backbone = load_backbone(tiny.base, torch.float32)
    request = parse_request({"image": Image.new("RGB", (96, 64), "white")}, QUESTIONS, template.reserved)
    image = template.encode_image(request.image)
    row = template.encode(request, 4096, 0, image)[0]
    ids = torch.tensor([row.input_ids])
    kwargs = {}
    if "mm_token_type_ids" in inspect.signature(backbone.get_rope_index).parameters:  # transformers >= 5.23
        kwargs["mm_token_type_ids"] = (ids == template.image_pad_id).int()
    reference, _ = backbone.get_rope_index(ids, image_grid_thw=image.grid_thw, **kwargs)
    assert torch.equal(mrope_positions(row, len(row.input_ids), template.image_pad_id), reference[:, 0])


def test_tokenized_pieces_are_cached_and_equal_the_tokenizer(tiny, monkeypatch):
    template = tiny.template()
    texts = ["State: hello\n", "- red", "- blue", "- red"]
    direct = template.tokenizer(texts, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    assert template.tokenize(texts) == direct
    calls = []
    tokenizer = template.tokenizer
    monkeypatch.setattr(template, "tokenizer", lambda new, **kwargs: calls.append(new) or tokenizer(new, **kwargs))
    green = tokenizer("- green", add_special_tokens=False)["input_ids"]
    assert template.tokenize(texts + ["- green"]) == direct + [green]
    assert calls == [["- green"]]  # only the new piece went to the tokenizer
    monkeypatch.setattr("dohnuts.inputs.template.PIECE_CACHE_CHARS", 12)
    pieces = template.tokenize(["- red", "a long new piece of text"])
    assert pieces[0] == direct[1]
    # Older pieces are evicted; those of the call stay, even over the bound.
    assert list(template.pieces) == ["- red", "a long new piece of text"]
