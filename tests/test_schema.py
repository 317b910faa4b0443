"""Request validation, candidate rendering and answers."""

import math

import pytest
from PIL import Image

from dohnuts.schema import ImageText, answer, parse_request

RESERVED = ("<|fim_suffix|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>")
NOUL = {"q": {"type": "noul", "instructions": "Is it red?"}}


def test_choice_list_and_mapping_render_labels_and_candidates():
    request = parse_request("s", {
        "a": {"type": "choice", "instructions": "Pick", "criteria": ["red", 2]},
        "b": {"type": "choice", "instructions": "Pick", "criteria": {"x": "the x one", "y": ""}},
    }, RESERVED)
    first, second = request.questions
    assert first.labels == ("red", "2") and first.candidates == ("red", "2")
    assert second.labels == ("x", "y") and second.candidates == ("x: the x one", "y")


def test_a_null_description_reads_as_none_as_the_wire_format_writes_it():
    written = parse_request("s", {
        "c": {"type": "choice", "instructions": "Pick", "criteria": {"x": "the x one", "y": None}},
        "n": {"type": "noul", "instructions": "Holds?", "criteria": {"true": "it does", "false": None}},
    }, RESERVED)
    empty = parse_request("s", {
        "c": {"type": "choice", "instructions": "Pick", "criteria": {"x": "the x one", "y": ""}},
        "n": {"type": "noul", "instructions": "Holds?", "criteria": {"true": "it does"}},
    }, RESERVED)
    assert written == empty  # the same candidates, so the same rows and answers
    with pytest.raises(TypeError, match="or null, got 'y': 3"):
        parse_request("s", {"c": {"type": "choice", "instructions": "Pick", "criteria": {"x": "", "y": 3}}}, RESERVED)


def test_noul_defaults_and_overrides():
    request = parse_request("s", {
        "d": {"type": "noul", "instructions": "Holds?"},
        "o": {"type": "noul", "instructions": "Holds?", "criteria": {"true": "it does"}},
    }, RESERVED)
    assert request.questions[0].candidates == (
        "false: no, the statement does not hold", "true: yes, the statement holds")
    assert request.questions[1].candidates == ("false: no, the statement does not hold", "true: it does")
    assert request.questions[1].labels == ("false", "true")


def test_score_levels_are_numbered():
    request = parse_request("s", {"q": {"type": "score", "instructions": "How big?",
                                        "criteria": ["small", "large"]}}, RESERVED)
    assert request.questions[0].labels == ("0", "1")
    assert request.questions[0].candidates == ("level 0: small", "level 1: large")


def test_mapping_state_renders_as_json_split_at_its_images():
    image, other = Image.new("L", (8, 8)), Image.new("RGB", (4, 4))
    request = parse_request({"name": "Zoë", "n": 2, "image": image}, NOUL, RESERVED)
    assert request.state_parts == ('{"name": "Zoë", "n": 2, "image": ', "}")
    assert request.state_text == '{"name": "Zoë", "n": 2}'  # the front layout's text: top-level image left out
    assert len(request.images) == 1 and request.images[0].mode == "RGB" and request.images[0].size == (8, 8)
    nested = {"images": [image, {"x": 1, 2: other}], "t": True}
    request = parse_request(nested, NOUL, RESERVED)
    assert [picture.size for picture in request.images] == [(8, 8), (4, 4)]
    assert request.state_parts == ('{"images": [', ', {"x": 1, "2": ', '}], "t": true}')
    assert request.state_text == '{"images": ["<image>", {"x": 1, "2": "<image>"}], "t": true}'
    # Without images the text is json.dumps' own.
    assert parse_request({"a": [1, {"b": None}]}, NOUL, RESERVED).state_parts == ('{"a": [1, {"b": null}]}',)


def test_instructions_and_descriptions_may_be_objects_or_arrays_rendered_as_json():
    """The wire format's own forms, taken by `predict` as the server takes them."""
    request = parse_request("s", {
        "c": {"type": "choice", "instructions": {"task": "route", "langs": ["en", "fr"]},
              "criteria": {"billing": {"about": "money"}, "tech": None}},
        "n": {"type": "noul", "criteria": {"true": ["yes", "sure"], "false": None}},
        "s": {"type": "score", "criteria": [{"level": "calm"}, "angry"]}}, RESERVED)
    choice, noul, score = request.questions
    assert choice.instructions == '{"task": "route", "langs": ["en", "fr"]}'
    assert choice.candidates == ('billing: {"about": "money"}', "tech")
    assert noul.candidates[1] == 'true: ["yes", "sure"]'
    assert score.candidates == ('level 0: {"level": "calm"}', "level 1: angry")
    with pytest.raises(TypeError, match="must be JSON"):
        parse_request("s", {"q": {"type": "noul", "instructions": {"x": {1, 2}}}}, RESERVED)


def test_images_inside_a_text_take_their_places_in_it():
    """An ImageText renders as a JSON string (a value) or as the state's own text (the whole
    state), each image's place inside it; its images count toward the state's limit."""
    image, other = Image.new("L", (8, 8)), Image.new("RGB", (4, 4))
    text = ImageText(('Before "', image, '", after ', other, "."))
    request = parse_request({"note": text, "n": 1}, NOUL, RESERVED)
    assert request.state_parts == ('{"note": "Before \\"', '\\", after ', '.", "n": 1}')
    assert request.state_text == '{"note": "Before \\"<image>\\", after <image>.", "n": 1}'
    assert [picture.size for picture in request.images] == [(8, 8), (4, 4)]
    alone = parse_request(text, NOUL, RESERVED)
    assert alone.state_parts == ('Before "', '", after ', ".")
    assert alone.state_text == 'Before "<image>", after <image>.'
    with pytest.raises(ValueError, match="holds 2 images, over the limit of 1"):
        parse_request({"a": text}, NOUL, RESERVED, max_images=1)
    with pytest.raises(TypeError, match="at least one PIL image"):
        ImageText(("no image here",))


@pytest.mark.parametrize("state, questions, error, message", [
    ("s", {}, ValueError, "questions is empty"),
    ("s", [("q", {})], TypeError, "must be a mapping"),
    ("s", {"q": {"type": "rank", "instructions": "x"}}, ValueError, "unknown type 'rank'"),
    ("s", {"q": {"type": "choice", "instructions": "x", "criteria": ["only"]}}, ValueError, "1 candidates"),
    ("s", {"q": {"type": "choice", "instructions": "x", "criteria": [str(i) for i in range(256)]}},
     ValueError, "256 candidates"),
    ("s", {"q": {"type": "choice", "instructions": "x", "criteria": ["a", "b", "a"]}}, ValueError,
     "duplicate labels ['a']"),
    ("s", {"q": {"type": "choice", "instructions": "x", "criteria": "ab"}}, TypeError, "list or a mapping"),
    ("s", {"q": {"type": "score", "instructions": "x", "criteria": ["one"]}}, ValueError, "1 candidates"),
    ("s", {"q": {"type": "noul", "instructions": "x", "criteria": {"maybe": "?"}}}, ValueError, "'false'/'true'"),
    ("s", {"q": {"type": "noul", "instructions": 3}}, TypeError, "needs instructions as a string, an object"),
    ("s", {"q": {"type": "noul", "instructions": "x", "extra": 1}}, ValueError, "unknown keys ['extra']"),
    ("a <|fim_suffix|> b", NOUL, ValueError, "state contains the reserved candidate marker"),
    ("s", {"q": {"type": "noul", "instructions": "x<|fim_suffix|>"}}, ValueError, "reserved candidate marker"),
    ("s", {"q": {"type": "choice", "instructions": "x", "criteria": ["a", "<|fim_suffix|>"]}},
     ValueError, "candidate contains the reserved candidate marker"),
    ("s <|image_pad|>", NOUL, ValueError, "reserved special token '<|image_pad|>'"),
    ({"images": [Image.new("RGB", (2, 2))] * 9}, NOUL, ValueError, "9 images, over the limit of 8"),
    (3, NOUL, TypeError, "string, a mapping or a list"),
    ({"x": object()}, NOUL, TypeError, "not JSON-serialisable"),
])
def test_invalid_requests_are_rejected_with_a_message_naming_the_problem(state, questions, error, message):
    with pytest.raises(error, match=None) as caught:
        parse_request(state, questions, RESERVED)
    assert message in str(caught.value)


def test_choice_answer_gives_argmax_label_and_normalised_entropy_confidence():
    request = parse_request("s", {"q": {"type": "choice", "instructions": "x", "criteria": ["a", "b", "c"]}}, RESERVED)
    result = answer(request.questions[0], [0.2, 0.5, 0.3])
    entropy = -(0.2 * math.log(0.2) + 0.5 * math.log(0.5) + 0.3 * math.log(0.3))
    assert result["choice"] == "b"
    assert result["probabilities"] == {"a": 0.2, "b": 0.5, "c": 0.3}
    assert result["confidence"] == pytest.approx(1 - entropy / math.log(3))


def test_noul_answer_is_probability_of_true_with_max_confidence():
    request = parse_request("s", NOUL, RESERVED)
    result = answer(request.questions[0], [0.3, 0.7])
    assert result["noul"] == pytest.approx(0.7) and result["confidence"] == pytest.approx(0.7)


def test_score_answer_is_the_expected_level():
    request = parse_request("s", {"q": {"type": "score", "instructions": "x", "criteria": ["a", "b", "c"]}}, RESERVED)
    result = answer(request.questions[0], [0.5, 0.0, 0.5])
    assert result["score"] == pytest.approx(1.0)
    assert result["confidence"] == pytest.approx(1 - math.log(2) / math.log(3))


def test_instructions_may_be_left_out_and_choice_takes_255_options():
    request = parse_request("s", {"ok": {"type": "noul"}, "big": {"type": "choice",
                                                                  "criteria": [str(i) for i in range(255)]}})
    assert [q.instructions for q in request.questions] == ["", ""] and len(request.questions[1].labels) == 255


def test_an_rgb_image_is_taken_as_it_is_and_others_are_converted():
    """A request's RGB image is used as given (converting it copied every pixel on every call);
    another mode is converted, and the cache key sees the same pixels either way."""
    from dohnuts.inputs.pixels import image_key

    colour = Image.new("RGB", (48, 32), (200, 30, 30))
    grey = Image.new("L", (48, 32), 90)
    request = parse_request({"a": colour, "b": grey}, {"q": {"type": "noul", "instructions": "Red?"}})
    assert request.images[0] is colour
    assert request.images[1].mode == "RGB" and request.images[1].getpixel((0, 0)) == (90, 90, 90)
    assert image_key(grey) == image_key(grey.convert("RGB")) == image_key(request.images[1])
    assert image_key(colour) == image_key(colour.copy())
