"""The decision request schema: validation, candidate rendering and answers."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from PIL import Image

QUESTION_TYPES = ("choice", "noul", "score")
QUESTION_KEYS = frozenset({"type", "instructions", "criteria"})
MIN_CANDIDATES = 2
MAX_CANDIDATES = 255  # the wire format's bound on choice options (score levels: 10 there)
MAX_QUESTIONS = 256  # questions a request; beyond, one request would hold an engine for seconds
MAX_IMAGES = 8  # images a state may hold (`model.max_images`)
IMAGE_TEXT = "<image>"  # an image's place in `Request.state_text`
NOUL_DEFAULTS = {
    "false": "no, the statement does not hold",
    "true": "yes, the statement holds",
}


def _is_mapping(value) -> bool:
    """isinstance(value, Mapping), a dict tested first: an ABC check costs several times a
    type comparison, and a request makes a few a question."""
    return type(value) is dict or isinstance(value, Mapping)


def _is_list(value) -> bool:
    """A sequence other than a string (a list or tuple tested first, as in `_is_mapping`)."""
    kind = type(value)
    return kind is list or kind is tuple or (isinstance(value, Sequence) and not isinstance(value, str))


class Question(NamedTuple):
    """One validated question: its labels and the candidate texts shown to the model. (A named
    tuple, immutable like a frozen dataclass but made in a quarter of its time: a request
    makes one a question.)"""

    qid: str
    kind: str
    instructions: str
    labels: tuple[str, ...]
    candidates: tuple[str, ...]


@dataclass(frozen=True)
class Request:
    """A validated request: its state as text, the state's RGB images in the order its text
    places them, and its questions.

    `state_parts` is the state's JSON text split at its images (one more part than images):
    an image's place is between two parts. `state_text` is the state as one text, each image's
    place reading "<image>", and the top-level "image" key left out where it holds an image (the
    text of the "front" layout, which checkpoints from before several images took).
    """

    state_text: str
    images: tuple[Image.Image, ...]
    questions: tuple[Question, ...]
    state_parts: tuple[str, ...] = ()

    def __post_init__(self):
        if not self.state_parts:
            object.__setattr__(self, "state_parts", (self.state_text,))


def parse_request(state, questions, reserved: Sequence[str] = (), max_images: int = MAX_IMAGES) -> Request:
    """Validate a request and render its state and candidates.

    Args:
        state: a string, or a mapping or list rendered as JSON, which may hold PIL images as
            values at any depth (in mappings and lists).
        questions: a non-empty mapping qid -> {"type", "instructions", "criteria"}.
        reserved: special-token strings no text may contain; the first is the candidate
            marker.
        max_images: the most images the state may hold.

    Returns:
        The Request.

    Raises:
        TypeError, ValueError: with a message naming the offending field.
    """
    state_text, images, state_parts = _parse_state(state, max_images)
    if not _is_mapping(questions):
        raise TypeError(f"questions must be a mapping qid -> question, got {type(questions).__name__}")
    if not questions:
        raise ValueError("questions is empty: a request needs at least one question")
    if len(questions) > MAX_QUESTIONS:
        raise ValueError(f"the request has {len(questions)} questions, over the limit of {MAX_QUESTIONS} a request")
    parsed = tuple(_parse_question(qid, question) for qid, question in questions.items())
    texts = [state_text] + [text for question in parsed for text in (question.instructions, *question.candidates)]
    # One scan of all texts (no reserved token holds NUL, so none matches across a join);
    # only a hit looks for the field to name.
    joined = "\0".join(texts)
    if not any(token and token in joined for token in reserved):
        return Request(state_text, images, parsed, state_parts)
    _reject_reserved("state", state_text, reserved)
    for question in parsed:
        _reject_reserved(f"question {question.qid!r} instructions", question.instructions, reserved)
        for candidate in question.candidates:
            _reject_reserved(f"question {question.qid!r} candidate", candidate, reserved)
    return Request(state_text, images, parsed, state_parts)


class ImageText(tuple):
    """A text with images inside it: its texts and images in order, e.g. ("Before: ", image,
    " after: ", image). In a state it stands where a string would: as the whole state, its
    texts and the images' places in turn; as a value, a JSON string with each image's place
    inside its quotes. The wire format's placeholders inside a longer string become one."""

    __slots__ = ()

    def __new__(cls, items):
        items = tuple(items)
        wrong = [type(item).__name__ for item in items if not isinstance(item, str) and not _is_image(item)]
        if wrong or not any(_is_image(item) for item in items):
            raise TypeError(f"an ImageText holds texts and at least one PIL image, got {wrong or 'no image'}")
        return super().__new__(cls, items)

    @property
    def images(self) -> list:
        return [item for item in self if not isinstance(item, str)]


def _image_text_parts(value: ImageText, quoted: bool) -> list:
    """`_segments` of an ImageText: its texts (escaped as a JSON string's content when `quoted`,
    inside quotes) and its images in their places."""
    texts = [json.dumps(item, ensure_ascii=False)[1:-1] if quoted and isinstance(item, str) else item
             for item in value]
    return ['"', *texts, '"'] if quoted else texts


def _parse_state(state, max_images: int) -> tuple[str, tuple[Image.Image, ...], tuple[str, ...]]:
    """(state_text, images, state_parts) of `Request`."""
    if isinstance(state, str):
        return state, (), (state,)
    if isinstance(state, ImageText):
        images = state.images
        if len(images) > max_images:
            raise ValueError(f"the state holds {len(images)} images, over the limit of {max_images} a state "
                             f"(model.max_images)")
        return front_text(state), tuple(rgb(image) for image in images), tuple(_joined(_image_text_parts(state, False)))
    mapping = _is_mapping(state)
    if not mapping and not _is_list(state):
        raise TypeError(f"state must be a string, a mapping or a list, got {type(state).__name__}")
    for key in state if mapping else ():
        if not isinstance(key, str):
            raise TypeError(f"state keys must be strings, got {key!r}")
    images = _images_in(state)
    if len(images) > max_images:
        raise ValueError(f"the state holds {len(images)} images, over the limit of {max_images} a state "
                         f"(model.max_images)")
    try:
        if not images:
            text = json.dumps(state, ensure_ascii=False)
            return text, (), (text,)
        parts = _joined(_segments(state))
        text = front_text(state)
    except (TypeError, ValueError, RecursionError) as error:
        raise TypeError(f"state is not JSON-serialisable apart from its images: {error}") from None
    return text, tuple(rgb(image) for image in images), tuple(parts)


def rgb(image: Image.Image) -> Image.Image:
    """The image in RGB: itself when it already is (read, never written: a request's images are
    not changed), else its conversion. `convert("RGB")` copies even an RGB image, which for a
    512 x 512 picture cost more than hashing it, on every request that carried it."""
    return image if image.mode == "RGB" else image.convert("RGB")


def _is_image(value) -> bool:
    return isinstance(value, Image.Image)


def replaced_images(value, change, is_image=_is_image):
    """A copy of a state's mappings and lists with each image (`is_image`: a PIL image by default)
    replaced by `change(image)`, called in the order of the state's JSON text; other values as
    they are."""
    if is_image(value):
        return change(value)
    if isinstance(value, ImageText):  # a text again, each image's place as `change` writes it
        return "".join(item if isinstance(item, str) else str(change(item)) for item in value)
    if _is_mapping(value):
        return {key: replaced_images(item, change, is_image) for key, item in value.items()}
    if _is_list(value):
        return [replaced_images(item, change, is_image) for item in value]
    return value


def front_text(state, is_image=_is_image) -> str:
    """`Request.state_text` of a state: its JSON with each image's place reading "<image>" and a
    top-level "image" key left out where it holds an image."""
    if isinstance(state, str | ImageText):
        return replaced_images(state, lambda _: IMAGE_TEXT, is_image)
    if _is_mapping(state) and is_image(state.get("image")):
        state = {key: value for key, value in state.items() if key != "image"}
    return json.dumps(replaced_images(state, lambda _: IMAGE_TEXT, is_image), ensure_ascii=False)


def _images_in(state) -> list[Image.Image]:
    """The images a state holds at any depth, in the order its JSON text places them (a stack,
    not recursion: a state may be nested as deep as its JSON parser allows)."""
    found, pending = [], [state]
    while pending:
        item = pending.pop()
        if _is_image(item):
            found.append(item)
        elif type(item) is str:
            continue
        elif isinstance(item, ImageText):
            found.extend(item.images)
        elif _is_mapping(item):
            pending.extend(reversed(list(item.values())))
        elif _is_list(item):
            pending.extend(reversed(list(item)))
    return found


def _segments(value) -> list:
    """The JSON text of `value` (as json.dumps writes it, ensure_ascii off) as a list of texts
    and the images in their places."""
    if _is_image(value):
        return [value]
    if isinstance(value, ImageText):
        return _image_text_parts(value, True)
    if _is_mapping(value):
        out = ["{"]
        for index, (key, item) in enumerate(value.items()):
            # The key as json.dumps writes it, a number's or a boolean's as a string too.
            out.append((", " if index else "") + json.dumps({key: 0}, ensure_ascii=False)[1:-4] + ": ")
            out.extend(_segments(item))
        return [*out, "}"]
    if _is_list(value):
        out = ["["]
        for index, item in enumerate(value):
            if index:
                out.append(", ")
            out.extend(_segments(item))
        return [*out, "]"]
    return [json.dumps(value, ensure_ascii=False)]


def _joined(segments: list) -> list[str]:
    """The texts between the images of `_segments`' list (one more than its images)."""
    parts, current = [], []
    for segment in segments:
        if _is_image(segment):
            parts.append("".join(current))
            current = []
        else:
            current.append(segment)
    return [*parts, "".join(current)]


def _parse_question(qid, question) -> Question:
    if not isinstance(qid, str) or not qid:
        raise TypeError(f"question ids must be non-empty strings, got {qid!r}")
    if not _is_mapping(question):
        raise TypeError(f"question {qid!r} must be a mapping, got {type(question).__name__}")
    unknown = question.keys() - QUESTION_KEYS
    if unknown:
        raise ValueError(f"question {qid!r} has unknown keys {sorted(unknown)}")
    kind = question.get("type")
    if kind not in QUESTION_TYPES:
        raise ValueError(f"question {qid!r} has unknown type {kind!r}; expected one of {QUESTION_TYPES}")
    # Instructions may be left out (the wire format allows it): the candidates then carry the
    # question alone.
    instructions = _as_text(question.get("instructions", ""))
    if not isinstance(instructions, str):
        raise TypeError(f"question {qid!r} needs instructions as a string, an object or an array, got "
                        f"{instructions!r}")
    criteria = question.get("criteria")
    labels, candidates = _CANDIDATES[kind](qid, criteria)
    if not MIN_CANDIDATES <= len(labels) <= MAX_CANDIDATES:
        raise ValueError(
            f"question {qid!r} has {len(labels)} candidates; "
            f"between {MIN_CANDIDATES} and {MAX_CANDIDATES} are allowed"
        )
    return Question(qid, kind, instructions, tuple(labels), tuple(candidates))


def _choice(qid, criteria):
    if _is_mapping(criteria):
        labels, candidates = [], []
        for key, description in criteria.items():
            # A null description is the wire format's "the name alone describes it", as "" is.
            description = _as_text(description)
            if not isinstance(key, str) or not isinstance(description, (str, type(None))):
                raise TypeError(f"choice question {qid!r}: criteria mapping must be str -> a description (a "
                                f"string, an object or an array) or null, got {key!r}: {description!r}")
            labels.append(key)
            candidates.append(f"{key}: {description}" if description else key)
    elif _is_list(criteria):
        for item in criteria:
            if isinstance(item, bool) or not isinstance(item, (str, int, float)):
                raise TypeError(f"choice question {qid!r}: criteria items must be strings or numbers, got {item!r}")
        labels = [str(item) for item in criteria]
        candidates = list(labels)
    else:
        raise TypeError(f"choice question {qid!r} needs criteria as a list or a mapping, got {criteria!r}")
    if len(set(labels)) != len(labels):
        duplicates = sorted({label for label in labels if labels.count(label) > 1})
        raise ValueError(f"choice question {qid!r} has duplicate labels {duplicates}")
    return labels, candidates


def _noul(qid, criteria):
    descriptions = dict(NOUL_DEFAULTS)
    if criteria is not None:
        if not _is_mapping(criteria):
            raise TypeError(f'noul question {qid!r}: criteria must be a mapping with "false"/"true", got {criteria!r}')
        unknown = set(criteria) - set(NOUL_DEFAULTS)
        if unknown:
            raise ValueError(f"noul question {qid!r}: criteria keys must be 'false'/'true', got {sorted(unknown)}")
        for key, description in criteria.items():
            if description is None:  # null: the side keeps its default description
                continue
            description = _as_text(description)
            if not isinstance(description, str):
                raise TypeError(f"noul question {qid!r}: criteria[{key!r}] must be a string, an object, an array "
                                f"or null")
            descriptions[key] = description
    labels = ["false", "true"]
    return labels, [f"{label}: {descriptions[label]}" for label in labels]


def _score(qid, criteria):
    if not _is_list(criteria):
        raise TypeError(f"score question {qid!r} needs criteria as an ordered list of level descriptions, "
                        f"got {criteria!r}")
    criteria = [_as_text(item) for item in criteria]
    for item in criteria:
        if not isinstance(item, str):
            raise TypeError(f"score question {qid!r}: level descriptions must be strings, objects or arrays, "
                            f"got {item!r}")
    labels = [str(level) for level in range(len(criteria))]
    return labels, [f"level {level}: {text}" for level, text in enumerate(criteria)]


def _as_text(value):
    """An object or array as its JSON text (the wire format: instructions and descriptions may
    be either, rendered as JSON); anything else as it is, for the caller to judge.

    Raises:
        TypeError: an object or array that is not JSON (an image, a set, nested too deep).
    """
    if not (_is_mapping(value) or (_is_list(value) and not isinstance(value, ImageText))):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError) as error:
        raise TypeError(f"an object or array in a question must be JSON: {error}") from None


_CANDIDATES = {"choice": _choice, "noul": _noul, "score": _score}  # each type's (labels, candidate texts)


def _reject_reserved(where: str, text: str, reserved: Sequence[str]) -> None:
    for position, token in enumerate(reserved):
        if token and token in text:
            what = "the reserved candidate marker" if position == 0 else "the reserved special token"
            raise ValueError(f"{where} contains {what} {token!r}")


def answer(question: Question, probabilities: Sequence[float], confidence: float | None = None) -> dict:
    """The answer to one question from its calibrated candidate probabilities.

    Args:
        question: the validated question.
        probabilities: [K] probabilities in candidate order.
        confidence: of a choice or score question, 1 - entropy / log K of `probabilities` when
            already computed (`Predictor` does it for a batch's rows at once); computed here
            when None.

    Returns:
        choice: {"type", "choice", "probabilities", "confidence"}; noul: {"type", "noul",
        "probabilities", "confidence"}; score: {"type", "score", "probabilities", "confidence"}.
    """
    p = [float(value) for value in probabilities]
    table = dict(zip(question.labels, p))
    if question.kind == "noul":
        return {"type": "noul", "noul": table["true"], "probabilities": table, "confidence": max(p)}
    if confidence is None:
        entropy = -sum(value * math.log(value) for value in p if value > 0)
        confidence = 1.0 - entropy / math.log(len(p))
    if question.kind == "choice":
        return {"type": "choice", "choice": question.labels[p.index(max(p))], "probabilities": table,
                "confidence": confidence}
    expected = sum(level * value for level, value in enumerate(p))
    return {"type": "score", "score": expected, "probabilities": table, "confidence": confidence}
