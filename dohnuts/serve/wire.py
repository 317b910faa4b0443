"""The /v1/systemone wire format (TypeSafe Jev): wire requests to Predictor inputs, Predictor results to answers."""

from __future__ import annotations

import base64
import io
import json
import re
from collections.abc import Mapping

from PIL import Image

from ..schema import MAX_IMAGES, ImageText

ALIAS = "jev-latest"  # the official client's default model name
QUESTION_TYPES = ("choice", "noul", "score")
# The official client's own placeholder form: the only one that text can hold inside a longer string (str(image)).
REFERENCE_PATTERN = re.compile(r"<image:[0-9a-f]{32}>")
REFERENCE_SPLIT = re.compile(r"(<image:[0-9a-f]{32}>)")  # a text split around them, kept
WHERE_IMAGES_GO = ("images go in the state: as the whole state, as a value at any depth in it, or inside a text "
                   "of it in the official client's form <image:32 hex digits>")


MAX_IMAGE_PIXELS = 40_000_000  # an image's width x height, read from its header before decoding
MAX_REQUEST_PIXELS = 2 * MAX_IMAGE_PIXELS  # a request's images together (about 240 MB of RGB bytes decoded)


class WireError(ValueError):
    """A request the wire format or this model cannot take: its HTTP status, error type, and where."""

    def __init__(self, message: str, status: int = 422, loc: tuple = ("body",), error_type: str = "value_error"):
        super().__init__(message)
        self.status = status
        self.loc = tuple(loc)
        self.error_type = error_type


def parse_system_one(body: object, parts: dict[str, bytes] | None = None,
                     max_images: int = MAX_IMAGES) -> tuple[object, dict, str]:
    """A wire request -> (state, questions) as Predictor.predict takes them, and the requested model name.

    Args:
        body: the decoded JSON body (the "request" part of a multipart request); its state is
            changed in place, each image's placeholder replaced by the decoded image.
        parts: a multipart request's other parts, name -> bytes; None for a JSON request.
        max_images: the most images a state may hold (counted before any is decoded).

    Returns:
        (state, questions, model): state a string, a mapping or a list holding the decoded images in
        their placeholders' places (a state that is an image alone: {"image": it}), questions in the
        form dohnuts.schema.parse_request validates, the model name as sent.

    Raises:
        WireError: with its status and FastAPI-style location, for any input this cannot take.
    """
    if not isinstance(body, Mapping):
        raise WireError(f"the request body must be a JSON object, got {_json_type(body)}", error_type="dict_type")
    for field in ("model", "state", "questions"):
        if body.get(field) is None:
            raise WireError(f"{field} is required", loc=("body", field), error_type="missing")
    if not isinstance(body["model"], str):
        raise WireError(f"model must be a string, got {_json_type(body['model'])}", loc=("body", "model"),
                        error_type="string_type")
    assets = {} if body.get("assets") is None else body["assets"]
    if not isinstance(assets, Mapping):
        raise WireError(f"assets must be an object, got {_json_type(assets)}", loc=("body", "assets"),
                        error_type="dict_type")
    for key, asset in assets.items():
        _check_asset(key, asset)
    state, places = _state(body["state"], assets)
    questions = _questions(body["questions"], assets)
    count = sum(1 if pieces is None else len(pieces) // 2 for _, _, pieces in places)
    if count > max_images:
        raise WireError(f"the state holds {count} images, over this model's limit of {max_images}",
                        status=413, loc=("body", "state"))
    # Decoding comes last: no image work for a request that fails on something cheaper. Each
    # image's size is read from its header first, and the request's total bounded before any
    # decoding (eight images of the limit each would decode to about a gigabyte).
    data = {}
    for container, key, pieces in places:
        for name in [container[key]] if pieces is None else pieces[1::2]:
            if name not in data:  # one placeholder placed twice: decoded once
                data[name] = _asset_bytes(name, assets[name], parts)
    sizes = {name: _size(name, content) for name, content in data.items()}
    total = sum(width * height for width, height in sizes.values())
    if total > MAX_REQUEST_PIXELS:
        raise WireError(f"the request's {len(sizes)} images hold {total:,} pixels together, over this server's "
                        f"limit of {MAX_REQUEST_PIXELS:,} a request", status=413, loc=("body", "assets"))
    decoded = {name: _decode(name, content) for name, content in data.items()}
    for container, key, pieces in places:
        container[key] = (decoded[container[key]] if pieces is None else
                          ImageText(decoded[piece] if index % 2 else piece for index, piece in enumerate(pieces)))
    if isinstance(state, list) and len(state) == 2 and state[1] is _WHOLE:  # one text with images inside
        state = state[0]
    return state, questions, body["model"]


def requested_risk(body: Mapping) -> float | None:
    """The risk a request asks its answers to abstain at: its "x_risk" field (a number; absent or
    null: none, and the response is exactly the format's). An extension, prefixed x_ as the
    format's convention asks; the official client ignores the "x_abstain" it adds to answers.

    Raises:
        WireError: x_risk is not a number.
    """
    risk = body.get("x_risk")
    if risk is not None and (isinstance(risk, bool) or not isinstance(risk, (int, float))):
        raise WireError(f"x_risk must be a number (a risk this model's calibration fitted), got {_json_type(risk)}",
                        loc=("body", "x_risk"), error_type="float_type")
    return None if risk is None else float(risk)


def render_response(result: dict, questions: dict, model_name: str) -> dict:
    """A Predictor result (for the questions parse_system_one returned) -> the wire response body.

    Args:
        result: Predictor.predict's {"answers": {qid: answer}, "usage": {"input_tokens", ...}}.
        questions: the questions parse_system_one returned for the request.
        model_name: the served model's name.

    Returns:
        {"model", "answers", "usage"} as the official client parses it: answers in question order,
        choice and score with the wire's confidence, noul without one, integer token counts.
    """
    answers = {qid: _answer(question, result["answers"][qid]) for qid, question in questions.items()}
    for qid, answer in answers.items():  # asked for with "x_risk": the format's prefix for an extra field
        if "abstain" in result["answers"][qid]:
            answer["x_abstain"] = bool(result["answers"][qid]["abstain"])
    usage = {"input_tokens": int(result["usage"]["input_tokens"]), "output_tokens": 0}
    return {"model": model_name, "answers": answers, "usage": usage}


def choice_confidence(probabilities: list[float]) -> float:
    """The wire's choice confidence: how far the top probability is from uniform, (p_max - 1/n) / (1 - 1/n).

    Args:
        probabilities: the option probabilities.

    Returns:
        0 for a uniform answer, 1 for a certain one.
    """
    count = len(probabilities)
    if count < 2:
        return 1.0
    value = (max(probabilities) - 1 / count) / (1 - 1 / count)
    return float(min(1.0, max(0.0, value)))


def score_confidence(probabilities: list[float]) -> float:
    """The wire's score confidence: max(0, 1 - sum_i p_i |i - k| / D), k the most probable level.

    D = (1/n) sum_i |i - (n-1)/2| is the mean distance of the levels from the middle of the scale.

    Args:
        probabilities: the level probabilities, low to high.

    Returns:
        1 when all mass is on one level, falling as mass spreads away from it.
    """
    count = len(probabilities)
    spread = sum(abs(level - (count - 1) / 2) for level in range(count)) / count if count else 0.0
    if spread == 0:
        return 1.0
    best = max(range(count), key=probabilities.__getitem__)
    distance = sum(value * abs(level - best) for level, value in enumerate(probabilities))
    return float(min(1.0, max(0.0, 1 - distance / spread)))


_WHOLE = object()  # marks the holder of a state that is one text with images inside


def _inside(text: str, assets) -> list[str] | None:
    """A text's pieces around the official placeholders inside it that name assets: texts at
    even indices, placeholders at odd ones (one more text than placeholders); None when it holds
    none."""
    pieces = REFERENCE_SPLIT.split(text)
    if len(pieces) == 1 or not any(name in assets for name in pieces[1::2]):
        return None
    merged = [pieces[0]]
    for name, after in zip(pieces[1::2], pieces[2::2]):
        if name in assets:
            merged += [name, after]
        else:  # not an asset of this request: text
            merged[-1] += name + after
    return merged


def _state(state, assets) -> tuple[object, list[tuple[object, object, list[str] | None]]]:
    """The state as `parse_request` takes it, and each place in it holding images as (container,
    key or index, pieces), in the order of the state's text: pieces None for a placeholder on its
    own, else the text's pieces around the official placeholders inside it (`_inside`; they
    become a `schema.ImageText`). A state that is a placeholder alone becomes {"image":
    placeholder}; one text with placeholders inside comes back in a holder list ending in
    _WHOLE. Raises where a placeholder is a key."""
    loc = ("body", "state")
    if isinstance(state, str) and state in assets:
        state = {"image": state}
    if isinstance(state, str):
        pieces = _inside(state, assets)
        if pieces is None:
            return state, []
        holder = [state, _WHOLE]
        return holder, [(holder, 0, pieces)]
    if not isinstance(state, Mapping | list):
        _reject_images(state, assets, loc)
        return _json_text(state, loc), []
    places = []
    for container, key, value, where in _walk(state, loc):
        if isinstance(key, str):
            _reject_images(key, assets, where)
        if isinstance(value, str) and value in assets:
            places.append((container, key, None))
        elif isinstance(value, str):
            pieces = _inside(value, assets)
            if pieces is not None:
                places.append((container, key, pieces))
        elif not isinstance(value, Mapping | list):
            _reject_images(value, assets, where)
    if not places:
        return state if isinstance(state, Mapping) else _json_text(state, loc), []
    return state, places


def _walk(value, loc):
    """(container, key or index, value, location) of every entry of a JSON value's objects and
    arrays, in the order of its text (an explicit stack, not recursion: a value may be nested as
    deep as the JSON parser allows)."""
    def entries(container):
        return iter(container.items() if isinstance(container, Mapping) else enumerate(container))

    stack = [(value, loc, entries(value))]
    while stack:
        container, where, items = stack[-1]
        for key, item in items:
            yield container, key, item, (*where, key)
            if isinstance(item, Mapping | list):
                stack.append((item, (*where, key), entries(item)))
                break
        else:
            stack.pop()


def _questions(questions, assets) -> dict:
    loc = ("body", "questions")
    if not isinstance(questions, Mapping):
        raise WireError(f"questions must be an object of id -> question, got {_json_type(questions)}", loc=loc,
                        error_type="dict_type")
    if not questions:
        raise WireError("questions is empty: a request needs at least one question", loc=loc, error_type="too_short")
    return {qid: _question(qid, question, assets, (*loc, qid)) for qid, question in questions.items()}


def _question(qid, question, assets, loc) -> dict:
    if not isinstance(qid, str) or not qid:
        raise WireError(f"question ids must be non-empty strings, got {qid!r}", loc=loc)
    if not isinstance(question, Mapping):
        raise WireError(f"question {qid!r} must be an object, got {_json_type(question)}", loc=loc,
                        error_type="dict_type")
    kind = question.get("type")
    if kind is None:
        raise WireError(f"question {qid!r} needs a type", loc=(*loc, "type"), error_type="missing")
    if kind == "box":
        raise WireError("box questions are not supported by this model", loc=(*loc, "type"))
    if kind not in QUESTION_TYPES:
        raise WireError(f"question {qid!r} has unknown type {kind!r}; expected one of {', '.join(QUESTION_TYPES)}",
                        loc=(*loc, "type"), error_type="union_tag_invalid")
    for field in ("instructions", "criteria"):
        _reject_images(question.get(field), assets, (*loc, field))
    parsed = dict(question)
    instructions = parsed.pop("instructions", None)
    if instructions is not None:
        parsed["instructions"] = _text(instructions, (*loc, "instructions"))
    elif kind == "noul":
        parsed["instructions"] = ""
    criteria = parsed.get("criteria")
    where = (*loc, "criteria")
    if kind == "choice" and isinstance(criteria, Mapping):
        # A null description: the option's name alone describes it.
        parsed["criteria"] = {name: "" if text is None else _text(text, (*where, name))
                              for name, text in criteria.items()}
    elif kind == "noul" and isinstance(criteria, Mapping):
        parsed["criteria"] = {side: _text(text, (*where, side)) for side, text in criteria.items() if text is not None}
    elif kind == "score" and isinstance(criteria, list):
        parsed["criteria"] = [_text(text, (*where, level)) for level, text in enumerate(criteria)]
    return parsed


def _answer(question: dict, answer: dict) -> dict:
    kind = question["type"]
    if kind == "noul":
        return {"type": "noul", "noul": float(answer["noul"])}
    criteria = question["criteria"]
    if kind == "choice":
        # The schema's labels: a mapping's keys, or a list's items as text.
        labels = list(criteria) if isinstance(criteria, Mapping) else [str(item) for item in criteria]
        values = [float(answer["probabilities"][label]) for label in labels]
        return {"type": "choice", "choice": answer["choice"], "probabilities": dict(zip(labels, values)),
                "confidence": choice_confidence(values)}
    levels = [str(level) for level in range(len(criteria))]
    values = [float(answer["probabilities"][level]) for level in levels]
    return {"type": "score", "score": float(answer["score"]), "legend": dict(zip(levels, criteria)),
            "probabilities": dict(zip(levels, values)), "confidence": score_confidence(values)}


def _check_asset(key, asset) -> None:
    loc = ("body", "assets", key)
    if not key:
        raise WireError("asset placeholders must be non-empty strings", loc=loc)
    if not isinstance(asset, Mapping):
        raise WireError(f"asset {key!r} must be an object, got {_json_type(asset)}", loc=loc, error_type="dict_type")
    # The format's schema leaves "type" optional: image is its only kind of asset.
    if asset.get("type", "image") not in ("image", None):
        raise WireError(f"asset {key!r} has type {asset['type']!r}; only image assets are supported",
                        loc=(*loc, "type"))
    source = "part" if asset.get("part") is not None else "data_base64"
    if not isinstance(asset.get(source), str):
        raise WireError(f"asset {key!r} needs a part name or data_base64 text", loc=(*loc, source),
                        error_type="missing" if asset.get(source) is None else "string_type")


def _asset_bytes(key: str, asset: Mapping, parts: dict[str, bytes] | None) -> bytes:
    """An asset's encoded image bytes, from its part or its base64 text."""
    loc = ("body", "assets", key)
    # With a part named, data_base64 is ignored (the format's rule).
    if asset.get("part") is not None:
        if parts is None or asset["part"] not in parts:
            raise WireError(f"asset {key!r} names part {asset['part']!r}, which the request does not have",
                            loc=(*loc, "part"))
        data = parts[asset["part"]]
    else:
        try:
            # Whitespace is dropped first, as the official client does: wrapped base64 is still base64.
            data = base64.b64decode("".join(asset["data_base64"].split()), validate=True)
        except ValueError:
            raise WireError(f"asset {key!r}: data_base64 is not valid base64", loc=(*loc, "data_base64")) from None
    if not data:
        raise WireError(f"asset {key!r} is empty", loc=loc)
    return data


def _size(key: str, data: bytes) -> tuple[int, int]:
    """An image's (width, height) from its header, before any decoding: a small file may decode
    to gigabytes."""
    loc = ("body", "assets", key)
    try:
        with Image.open(io.BytesIO(data)) as image:
            width, height = image.size
    except Exception as error:  # Pillow's decoders raise many types: OSError, SyntaxError...
        raise WireError(f"asset {key!r} is not an image this server can decode: {error}", loc=loc) from None
    if width * height > MAX_IMAGE_PIXELS:
        raise WireError(f"asset {key!r} is {width} x {height} pixels, over this server's limit of "
                        f"{MAX_IMAGE_PIXELS:,}", status=413, loc=loc)
    return width, height


def _decode(key: str, data: bytes) -> Image.Image:
    """An image's RGB pixels (its size already checked by `_size`)."""
    loc = ("body", "assets", key)
    try:
        with Image.open(io.BytesIO(data)) as image:
            return image.convert("RGB")
    except Image.DecompressionBombError as error:  # Pillow's own bound, past twice its default
        raise WireError(f"asset {key!r}: {error}; this server's limit is {MAX_IMAGE_PIXELS:,} pixels", status=413,
                        loc=loc) from None
    except Exception as error:  # Pillow's decoders raise many types: OSError, SyntaxError...
        raise WireError(f"asset {key!r} is not an image this server can decode: {error}", loc=loc) from None


def _reject_images(value, assets, loc) -> None:
    """Raise if a placeholder sits anywhere in value: where this is called, none may."""
    if not assets:
        return
    # A stack, not recursion: a body nested as deep as the JSON parser allows must not overflow here.
    pending = [(value, loc)]
    while pending:
        item, where = pending.pop()
        if isinstance(item, str):
            if item in assets or any(match in assets for match in REFERENCE_PATTERN.findall(item)):
                raise WireError(f"{'.'.join(map(str, where[1:]))} holds an image; {WHERE_IMAGES_GO}", loc=where)
        elif isinstance(item, Mapping):
            pending.extend((part, (*where, key)) for key, entry in item.items() for part in (key, entry))
        elif isinstance(item, list):
            pending.extend((entry, (*where, index)) for index, entry in enumerate(item))


def _text(value, loc) -> object:
    """Objects and arrays as their JSON text; anything else as it is, for the schema to judge."""
    return _json_text(value, loc) if isinstance(value, Mapping | list) else value


def _json_text(value, loc) -> str:
    try:
        return json.dumps(value, ensure_ascii=False)
    except (RecursionError, TypeError, ValueError) as error:
        raise WireError(f"{'.'.join(map(str, loc[1:]))} cannot be rendered as JSON text: {error}", loc=loc) from None


def _json_type(value) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number" if isinstance(value, int | float) else type(value).__name__)
