"""The /v1/systemone wire format: requests as the official client builds them, answers as it parses them."""

import base64
import io
import json
import uuid

import pytest
from PIL import Image

from dohnuts.schema import parse_request
from dohnuts.serve.wire import (
    WireError,
    choice_confidence,
    parse_system_one,
    render_response,
    score_confidence,
)

NOUL = {"type": "noul", "instructions": "Is the parcel damaged?"}


def placeholder() -> str:
    """The official client's default placeholder: <image: + 32 lowercase hex digits + >."""
    return f"<image:{uuid.uuid4().hex}>"


def image_bytes(size=(6, 4), color=(200, 10, 30), file_format="PNG") -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, format=file_format)
    return buffer.getvalue()


def request(state, questions=None, **extra) -> dict:
    questions = {"damaged": NOUL} if questions is None else questions
    return {"state": state, "model": "jev-latest", "questions": questions, **extra}


def multipart(state, reference, questions=None) -> tuple[dict, dict]:
    """A body and its parts as the client sends one image: the asset names part asset-0."""
    body = request(state, questions, assets={reference: {"type": "image", "part": "asset-0"}})
    return body, {"asset-0": image_bytes()}


def test_plain_text_request():
    questions = {
        "damaged": NOUL,
        "team": {"type": "choice", "instructions": "Which team?", "criteria": {"billing": "money", "tech": None}},
        "severity": {"type": "score", "instructions": "How severe?", "criteria": ["low", "mid", "high"]},
    }
    state, parsed, model = parse_system_one(request("I was charged twice.", questions))
    assert state == "I was charged twice." and model == "jev-latest"
    assert parsed == {
        "damaged": {"type": "noul", "instructions": "Is the parcel damaged?"},
        "team": {"type": "choice", "instructions": "Which team?", "criteria": {"billing": "money", "tech": ""}},
        "severity": {"type": "score", "instructions": "How severe?", "criteria": ["low", "mid", "high"]},
    }
    validated = parse_request(state, parsed)
    assert [question.candidates for question in validated.questions][1] == ("billing: money", "tech")


@pytest.mark.parametrize("key", ["photo", "image"])
def test_state_object_with_an_image_value(key):
    reference = placeholder()
    body, parts = multipart({key: reference, "note": "parcel arrived"}, reference)
    state, _, _ = parse_system_one(body, parts)
    assert list(state) == [key, "note"] and isinstance(state[key], Image.Image) and state[key].mode == "RGB"
    assert state[key].size == (6, 4) and state[key].getpixel((0, 0)) == (200, 10, 30)
    validated = parse_request(state, {"damaged": NOUL})
    assert len(validated.images) == 1 and validated.state_parts == (f'{{"{key}": ', ', "note": "parcel arrived"}')


def test_whole_state_is_the_image():
    reference = placeholder()
    state, _, _ = parse_system_one(*multipart(reference, reference))
    assert list(state) == ["image"] and state["image"].size == (6, 4)


def test_same_placeholder_twice_is_one_decoded_image_in_both_places():
    reference = placeholder()
    state, _, _ = parse_system_one(*multipart({"front": reference, "back": reference}, reference))
    assert isinstance(state["front"], Image.Image) and state["front"] is state["back"]


def test_several_images_at_any_depth_in_the_order_of_the_text():
    body = request({"listing": {"photos": [OTHER, "no photo"], "cover": REFERENCE}, "after": OTHER},
                   assets=IMAGES)
    state, _, _ = parse_system_one(body, {"asset-0": image_bytes(color=(1, 2, 3)),
                                          "asset-1": image_bytes(color=(4, 5, 6))})
    validated = parse_request(state, {"damaged": NOUL})
    assert [image.getpixel((0, 0)) for image in validated.images] == [(4, 5, 6), (1, 2, 3), (4, 5, 6)]
    assert validated.state_parts == ('{"listing": {"photos": [', ', "no photo"], "cover": ', '}, "after": ', '}')
    listed, _, _ = parse_system_one(request([REFERENCE, "caption"], assets={REFERENCE: PART}),
                                    {"asset-0": image_bytes()})
    assert isinstance(listed[0], Image.Image) and listed[1] == "caption"


def test_a_request_whose_images_together_are_too_many_pixels_is_refused_before_decoding(monkeypatch):
    """Each image within its own limit, the request's total over its: 413 from the headers alone
    (no image decoded); one placeholder placed twice counts once."""
    from dohnuts.serve import wire

    monkeypatch.setattr(wire, "MAX_REQUEST_PIXELS", 1000)
    decoded = []
    monkeypatch.setattr(wire, "_decode", lambda key, data: decoded.append(key) or Image.new("RGB", (30, 30)))
    parts = {"asset-0": image_bytes((30, 30)), "asset-1": image_bytes((30, 30))}
    with pytest.raises(WireError, match="2 images hold 1,800 pixels together, over this server's limit of 1,000") \
            as caught:
        parse_system_one(request({"a": REFERENCE, "b": OTHER}, assets=IMAGES), parts)
    assert caught.value.status == 413 and decoded == []
    state, _, _ = parse_system_one(request({"a": REFERENCE, "b": REFERENCE}, assets={REFERENCE: PART}), parts)
    assert decoded == [REFERENCE] and state["a"] is state["b"]


def test_more_images_than_the_limit_are_refused_before_decoding():
    body = request({"photos": [REFERENCE] * 3}, assets={REFERENCE: PART})
    with pytest.raises(WireError) as caught:
        parse_system_one(body, {"asset-0": b"not even an image"}, max_images=2)
    assert caught.value.status == 413 and "3 images, over this model's limit of 2" in str(caught.value)


def test_data_base64_asset_without_parts():
    encoded = base64.b64encode(image_bytes(file_format="JPEG")).decode()
    wrapped = "\n".join(encoded[start:start + 60] for start in range(0, len(encoded), 60))
    body = request({"photo": "pic"}, assets={"pic": {"type": "image", "format": "jpeg", "data_base64": wrapped}})
    state, _, _ = parse_system_one(body)
    assert state["photo"].size == (6, 4)


def test_unknown_top_level_fields_and_unused_assets_are_ignored():
    body = request("text", x_trace_id="abc", seed=7, assets={placeholder(): {"type": "image", "part": "asset-9"}})
    assert parse_system_one(body, {})[:2] == ("text", {"damaged": NOUL})


def test_state_forms_kept_or_rendered_as_json_text():
    assert parse_system_one(request(["a", "é"]))[0] == '["a", "é"]'
    assert parse_system_one(request(3))[0] == "3"
    kept = {"image": "not a placeholder", "n": 1}
    assert parse_system_one(request(kept))[0] == kept


def test_descriptions_and_instructions_as_json_text():
    questions = {
        "tone": {"type": "choice", "instructions": {"task": "Pick the tone", "lang": "français"},
                 "criteria": {"calm": None, "angry": {"signs": ["caps"]}, "ok": "fine"}},
        "level": {"type": "score", "instructions": ["rate", "it"], "criteria": ["low", {"at": "least"}, ["x"]]},
    }
    _, parsed, _ = parse_system_one(request("s", questions))
    assert parsed["tone"]["instructions"] == '{"task": "Pick the tone", "lang": "français"}'
    assert parsed["tone"]["criteria"] == {"calm": "", "angry": '{"signs": ["caps"]}', "ok": "fine"}
    assert parsed["level"] == {"type": "score", "instructions": '["rate", "it"]',
                               "criteria": ["low", '{"at": "least"}', '["x"]']}


def test_noul_without_instructions_and_one_sided_criteria():
    questions = {"a": {"type": "noul", "criteria": {"true": "it is spam"}},
                 "b": {"type": "noul", "instructions": None, "criteria": {"true": None, "false": {"k": 1}}},
                 "c": {"type": "noul", "instructions": "Spam?", "criteria": None}}
    _, parsed, _ = parse_system_one(request("s", questions))
    assert parsed == {"a": {"type": "noul", "instructions": "", "criteria": {"true": "it is spam"}},
                      "b": {"type": "noul", "instructions": "", "criteria": {"false": '{"k": 1}'}},
                      "c": {"type": "noul", "instructions": "Spam?", "criteria": None}}
    candidates = [question.candidates for question in parse_request("s", parsed).questions]
    assert candidates[0] == ("false: no, the statement does not hold", "true: it is spam")


REFERENCE = placeholder()
OTHER = placeholder()
PART = {"type": "image", "part": "asset-0"}
IMAGES = {REFERENCE: PART, OTHER: {"type": "image", "part": "asset-1"}}


@pytest.mark.parametrize(("body", "parts", "loc", "fragment"), [
    (request("s", {"q": {"type": "box", "instructions": "the dog"}}), None, ("body", "questions", "q", "type"),
     "box questions are not supported"),
    (request({"a": {REFERENCE: "as a key"}}, assets=IMAGES), {}, ("body", "state", "a", REFERENCE),
     "images go in the state"),
    (request("s", {"q": {"type": "noul", "instructions": f"Is {REFERENCE} red?"}}, assets=IMAGES), {},
     ("body", "questions", "q", "instructions"), "images go in the state"),
    (request("s", {"q": {"type": "choice", "instructions": "Pick", "criteria": {"x": REFERENCE, "y": None}}},
             assets=IMAGES), {}, ("body", "questions", "q", "criteria", "x"), "images go in the state"),
    (request(REFERENCE, assets={REFERENCE: PART}), {"asset-7": b""}, ("body", "assets", REFERENCE, "part"),
     "'asset-0'"),
    (request(REFERENCE, assets={REFERENCE: PART}), None, ("body", "assets", REFERENCE, "part"), "'asset-0'"),
    (request(REFERENCE, assets={REFERENCE: {"type": "image", "format": "png", "data_base64": "@@not base64@@"}}),
     None, ("body", "assets", REFERENCE, "data_base64"), "not valid base64"),
    (request(REFERENCE, assets={REFERENCE: PART}), {"asset-0": b"GIF89 but not really"}, ("body", "assets", REFERENCE),
     "not an image this server can decode"),
    (request(REFERENCE, assets={REFERENCE: {"type": "audio", "part": "asset-0"}}), {}, ("body", "assets", REFERENCE,
     "type"), "only image assets"),
    (request(REFERENCE, assets={REFERENCE: {"type": "image"}}), {}, ("body", "assets", REFERENCE, "data_base64"),
     "part name or data_base64"),
    ({"model": "jev-latest", "state": "s"}, None, ("body", "questions"), "questions is required"),
    (request("s", {}), None, ("body", "questions"), "at least one question"),
    (request("s", ["q"]), None, ("body", "questions"), "must be an object"),
    ([1, 2], None, ("body",), "must be a JSON object"),
    ("text", None, ("body",), "must be a JSON object"),
    ({"state": "s", "questions": {"q": NOUL}}, None, ("body", "model"), "model is required"),
    (request("s", model=3), None, ("body", "model"), "model must be a string"),
    (request(None), None, ("body", "state"), "state is required"),
    (request("s", {"q": {"type": "rank"}}), None, ("body", "questions", "q", "type"), "unknown type 'rank'"),
    (request("s", {"q": {"instructions": "x"}}), None, ("body", "questions", "q", "type"), "needs a type"),
    (request("s", {"q": "Is it?"}), None, ("body", "questions", "q"), "must be an object"),
    (request("s", {"": NOUL}), None, ("body", "questions", ""), "non-empty strings"),
    (request("s", assets=[PART]), None, ("body", "assets"), "assets must be an object"),
])
def test_wire_errors(body, parts, loc, fragment):
    with pytest.raises(WireError) as caught:
        parse_system_one(body, parts)
    assert caught.value.status == 422 and caught.value.loc == loc and fragment in str(caught.value)
    assert isinstance(caught.value.error_type, str)


def test_render_response_for_all_three_types():
    questions = {
        "damaged": {"type": "noul", "instructions": "Damaged?"},
        "team": {"type": "choice", "instructions": "Team?", "criteria": {"Billing ü": "", "tech": "computers"}},
        "severity": {"type": "score", "instructions": "Severity?", "criteria": ["calm", "annoyed", "angry"]},
    }
    result = {
        "answers": {
            "severity": {"type": "score", "score": 1.05, "probabilities": {"0": 0.0, "1": 0.95, "2": 0.05},
                         "confidence": 0.1},
            "team": {"type": "choice", "choice": "Billing ü", "probabilities": {"tech": 0.12, "Billing ü": 0.88},
                     "confidence": 0.5},
            "damaged": {"type": "noul", "noul": 0.93, "probabilities": {"false": 0.07, "true": 0.93},
                        "confidence": 0.93},
        },
        "usage": {"input_tokens": 304.0, "images": 1},
    }
    body = render_response(result, questions, "dohnuts-small")
    assert list(body) == ["model", "answers", "usage"] and body["model"] == "dohnuts-small"
    assert body["usage"] == {"input_tokens": 304, "output_tokens": 0}
    assert all(type(count) is int for count in body["usage"].values())
    assert list(body["answers"]) == ["damaged", "team", "severity"]
    assert body["answers"]["damaged"] == {"type": "noul", "noul": 0.93}
    team = body["answers"]["team"]
    assert list(team) == ["type", "choice", "probabilities", "confidence"] and team["choice"] == "Billing ü"
    assert list(team["probabilities"].items()) == [("Billing ü", 0.88), ("tech", 0.12)]
    assert team["confidence"] == pytest.approx(0.76)
    severity = body["answers"]["severity"]
    assert list(severity) == ["type", "score", "legend", "probabilities", "confidence"]
    assert severity["legend"] == {"0": "calm", "1": "annoyed", "2": "angry"}
    assert severity["probabilities"] == {"0": 0.0, "1": 0.95, "2": 0.05}
    assert severity["score"] == 1.05 and severity["confidence"] == pytest.approx(0.925)
    floats = [team["confidence"], severity["score"], severity["confidence"], *severity["probabilities"].values()]
    assert all(type(value) is float for value in floats)
    assert json.loads(json.dumps(body)) == body


def test_choice_confidence():
    assert choice_confidence([0.25] * 4) == pytest.approx(0.0)
    assert choice_confidence([0.0, 1.0, 0.0]) == pytest.approx(1.0)
    assert choice_confidence([0.88, 0.12]) == pytest.approx(0.76)
    assert choice_confidence([0.5, 0.3, 0.2]) == pytest.approx(0.25)  # (0.5 - 1/3) / (2/3)


def test_score_confidence():
    assert score_confidence([0.0, 0.0, 1.0, 0.0]) == pytest.approx(1.0)
    assert score_confidence([0.0, 0.95, 0.05]) == pytest.approx(0.925)  # D = 2/3, distance 0.05
    assert score_confidence([0.1, 0.2, 0.4, 0.2, 0.1]) == pytest.approx(1 / 3)  # D = 1.2, distance 0.8
    assert score_confidence([0.5, 0.1, 0.1, 0.3]) == 0.0  # D = 1, distance 1.2: clipped at zero
