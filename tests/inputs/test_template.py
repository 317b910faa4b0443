"""The prompt template: rendered text, marker positions, shared beginnings, M-RoPE, budget."""

import inspect

import numpy as np
import pytest
import torch
from PIL import Image

from dohnuts.inputs.batch import mrope_positions
from dohnuts.inputs.template import Template, rendered_order
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
    # The options go in their hashed order ("g" first under the default salt); the markers stay
    # in the question's order: r's marker, then g's.
    assert text == (f'State: {{"city": "Oslo"}}\nchoice question: Which colour?\nOptions:\n'
                    f"- g{marker}- r: red{marker}")
    assert first.markers[0] == len(first.input_ids) - 1 > first.markers[1]
    assert [first.input_ids[i] for i in first.markers] == [template.marker_id] * 2
    assert first.input_ids.count(template.marker_id) == 2
    assert second.markers[-1] == len(second.input_ids) - 1
    # Rows of one request share their beginning token for token.
    shared = len(template.tokenizer('State: {"city": "Oslo"}\n', add_special_tokens=False)["input_ids"])
    assert first.input_ids[:shared] == second.input_ids[:shared]


def test_image_rows_carry_each_vision_block_in_its_place_in_the_state(tiny):
    template = tiny.template()
    white, black = Image.new("RGB", (64, 64), "white"), Image.new("RGB", (64, 32), "black")
    request = parse_request({"before": white, "note": "x", "after": [black, white]}, QUESTIONS, template.reserved)
    images = []
    indices = template.encode_images(request, images)
    assert indices == (0, 1, 0) and len(images) == 2  # the same image twice: encoded once
    rows = template.encode(request, 4096, indices, images)
    ids = list(rows[0].input_ids)
    # The pixel policy sizes every image to about image_pixels: 64 x 64 is 2 x 2 merged tokens.
    height, width = (images[1].grid_thw[0, 1:] // 2).tolist()
    assert rows[0].images == (0, 1, 0) and rows[0].image_grids == ((2, 2), (height, width), (2, 2))
    decoded = template.tokenizer.decode(ids)
    block = "<|vision_start|>{}<|vision_end|>"
    assert decoded.startswith('State: {"before": ' + block.format("<|image_pad|>" * 4) + ', "note": "x", "after": ['
                              + block.format("<|image_pad|>" * height * width) + ", "
                              + block.format("<|image_pad|>" * 4) + "]}\n")
    # The rows' common beginning is the whole state, images and all.
    assert rows[0].shared == rows[1].shared and template.tokenizer.decode(ids[:rows[0].shared]).endswith("]}\n")
    assert rows[0].input_ids[:rows[0].shared] == rows[1].input_ids[:rows[1].shared]


def test_the_front_layout_puts_the_blocks_before_the_state(tiny):
    """Checkpoints from before several images (`image_layout: front`): blocks first, each with its
    newline, and the state's text without its top-level image ("<image>" in other places)."""
    template = Template(tiny.template().tokenizer, tiny.template().image_processor, tiny.model.marker_token,
                        image_layout="front")
    white = Image.new("RGB", (64, 64), "white")
    request = parse_request({"image": white, "photo": white, "n": 1}, QUESTIONS, template.reserved)
    images = []
    indices = template.encode_images(request, images)
    ids = template.encode(request, 4096, indices, images)[0].input_ids
    tokens = 64 * 64 // (16 * 16) // 4  # 4x4 patches merged 2x2
    assert ids[0] == template.vision_start_id and ids[1 + tokens] == template.vision_end_id
    assert ids[1 : 1 + tokens] == (template.image_pad_id,) * tokens
    second = 2 + tokens + len(template.newline_ids)
    assert ids[second] == template.vision_start_id
    assert template.tokenizer.decode(list(ids[second + 2 + tokens:])).startswith(
        '\nState: {"photo": "<image>", "n": 1}\n')


def test_over_budget_input_is_rejected_not_truncated(tiny):
    template = tiny.template()
    request = parse_request("word " * 200, QUESTIONS, template.reserved)
    length = len(template.encode(request, 4096)[0].input_ids)
    with pytest.raises(ValueError, match=f"{length} tokens, over the budget of {length - 1}"):
        template.encode(request, length - 1)


def test_a_text_that_cannot_fit_is_refused_before_it_is_tokenised(tiny, monkeypatch):
    """Each token stands for at most `longest_token_bytes` bytes, so a text of more bytes than
    that many times the budget is refused without tokenising it; a text that may fit is
    tokenised and counted exactly."""
    template = tiny.template()
    budget = 64
    huge = "word " * (budget * template.longest_token_bytes // 5 + 1)  # more bytes than budget tokens can hold
    tokenised = []
    monkeypatch.setattr(template, "tokenize", lambda texts: tokenised.append(texts) or [])
    with pytest.raises(ValueError, match=f"at least {-(-len(huge) // template.longest_token_bytes)} tokens .* over "
                                         f"the budget of {budget}"):
        template.encode(parse_request(huge, QUESTIONS, template.reserved), budget)
    assert tokenised == []
    monkeypatch.undo()
    near = "word " * (budget * template.longest_token_bytes // 5 - 1)  # may fit by bytes: counted exactly
    with pytest.raises(ValueError, match=r"the input is \d+ tokens, over the budget"):
        template.encode(parse_request(near, QUESTIONS, template.reserved), budget)


def test_mrope_positions_match_hugging_face(tiny):
    template = tiny.template()
    backbone = load_backbone(tiny.base, torch.float32)
    for state in ({"image": Image.new("RGB", (96, 64), "white")},
                  {"a": Image.new("RGB", (96, 64), "white"), "b": "text", "c": [Image.new("RGB", (32, 128), "red")]}):
        request = parse_request(state, QUESTIONS, template.reserved)
        images = []
        indices = template.encode_images(request, images)
        placed = tuple(images[index] for index in indices)
        row = template.encode(request, 4096, indices, images)[0]
        ids = torch.tensor([row.input_ids])
        kwargs = {}
        if "mm_token_type_ids" in inspect.signature(backbone.get_rope_index).parameters:  # transformers >= 5.23
            kwargs["mm_token_type_ids"] = (ids == template.image_pad_id).int()
        grids = torch.cat([image.grid_thw for image in placed])
        reference, _ = backbone.get_rope_index(ids, image_grid_thw=grids, **kwargs)
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


def _candidate_texts(template, row):
    """Each marker's candidate text, read back from the row's tokens, in the row's marker order."""
    ends = sorted(row.markers)
    starts = {end: (ends[index - 1] + 1 if index else None) for index, end in enumerate(ends)}
    texts = [template.tokenizer.decode(list(row.input_ids[starts[end]:end])) for end in row.markers]
    return [text.split("Options:\n")[-1] for text in texts]  # the first also holds the header


def test_a_choice_renders_the_same_tokens_in_whatever_order_its_options_come(tiny):
    template = tiny.template()
    options = {"alpha": "first", "beta": None, "gamma": "third", "delta": "", "eps": "fifth", "zeta": "sixth"}
    rng = np.random.default_rng(0)
    rendered = None
    for _ in range(12):
        order = rng.permutation(len(options))
        criteria = {list(options)[i]: list(options.values())[i] for i in order}
        request = parse_request("s", {"q": {"type": "choice", "instructions": "Which?", "criteria": criteria}},
                                template.reserved)
        (row,) = template.encode(request, 4096)
        by_label = dict(zip(request.questions[0].labels, row.markers))
        texts = dict(zip(request.questions[0].labels, _candidate_texts(template, row)))
        assert texts == {label: f"- {label}: {text}" if text else f"- {label}" for label, text in options.items()}
        if rendered is None:
            rendered = (row.input_ids, by_label)
        assert (row.input_ids, by_label) == rendered  # the same tokens, each label at the same marker
    assert sorted(rendered[1].values()) != [rendered[1][label] for label in options]  # not the given order


def test_scores_nouls_and_the_given_layout_keep_their_order(tiny):
    template = tiny.template()
    given = Template(template.tokenizer, template.image_processor, tiny.model.marker_token, None)
    request = parse_request("s", {
        "c": {"type": "choice", "criteria": ["d", "c", "b", "a", "e", "f"]},
        "s": {"type": "score", "criteria": ["none", "some", "much", "all"]},
        "n": {"type": "noul", "instructions": "True?"},
    }, template.reserved)
    choice, score, noul = request.questions
    assert list(rendered_order(score, "salt")) == [0, 1, 2, 3] and list(rendered_order(noul, "salt")) == [0, 1]
    assert list(rendered_order(choice, None)) == list(range(6))
    orders = {tuple(rendered_order(choice, salt)) for salt in ("a", "b", "c", "d")}
    assert len(orders) > 1 and all(sorted(order) == list(range(6)) for order in orders)  # the salt decides
    for row in given.encode(request, 4096):
        assert list(row.markers) == sorted(row.markers)
    for row in template.encode(request, 4096)[1:]:
        assert list(row.markers) == sorted(row.markers)
