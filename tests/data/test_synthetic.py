"""Tests for the synthetic decision mixture: determinism, target validity, coverage, balance."""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict

import pytest
from PIL import Image

from dohnuts.data.synthetic import GROUPS, SyntheticState, corpus, generate
from dohnuts.schema import parse_request

IMAGE_SIZE = 32
WORD = re.compile(r"\w+|[^\w\s]")


@pytest.fixture(scope="module")
def mixture() -> list[SyntheticState]:
    # Big enough for frequency checks, small enough to build in well under a second.
    return generate(seed=7, states_per_group=96, image_size=IMAGE_SIZE)


def _labels(question: dict) -> list[str]:
    """Candidate labels in target order, as the schema orders them."""
    if question["type"] == "noul":
        return ["false", "true"]
    if question["type"] == "score":
        return [str(level) for level in range(len(question["criteria"]))]
    return list(question["criteria"])


def _answer(state: SyntheticState, qid: str) -> str:
    target = state.targets[qid]
    return _labels(state.questions[qid])[max(range(len(target)), key=target.__getitem__)]


def _image(state: SyntheticState) -> Image.Image | None:
    return state.state.get("image") if isinstance(state.state, dict) else None


def _comparable(state: SyntheticState):
    """A state with its image replaced by (mode, size, bytes) so equality covers the pixels."""
    body = state.state
    if isinstance(body, dict):
        body = {k: (v.mode, v.size, v.tobytes()) if k == "image" else v for k, v in body.items()}
    return state.group, state.state_id, body, state.questions, state.targets


def _texts(state: SyntheticState) -> list[str]:
    texts = [state.state] if isinstance(state.state, str) else [
        f"{key} {value}" if isinstance(value, str) else key for key, value in state.state.items() if key != "image"
    ]
    for question in state.questions.values():
        texts.append(question["instructions"])
        criteria = question.get("criteria", [])
        texts += [*criteria, *criteria.values()] if isinstance(criteria, dict) else criteria
    return texts


def test_generate_is_deterministic_for_a_seed():
    first = generate(seed=11, states_per_group=12, image_size=24)
    second = generate(seed=11, states_per_group=12, image_size=24)
    assert len(first) == len(second) == 12 * len(GROUPS)
    assert [_comparable(s) for s in first] == [_comparable(s) for s in second]


def test_different_seeds_give_different_mixtures():
    a = generate(seed=1, states_per_group=12, image_size=24)
    b = generate(seed=2, states_per_group=12, image_size=24)
    for group in GROUPS:
        in_a = [_comparable(s) for s in a if s.group == group]
        in_b = [_comparable(s) for s in b if s.group == group]
        assert in_a != in_b, group


def test_state_ids_are_unique_and_name_their_group(mixture):
    ids = [s.state_id for s in mixture]
    assert len(set(ids)) == len(ids)
    assert all(re.fullmatch(rf"{s.group}-\d{{5}}", s.state_id) for s in mixture)


def test_targets_are_distributions_over_the_question_candidates(mixture):
    for s in mixture:
        assert 2 <= len(s.questions) <= 4, s.state_id
        assert s.targets.keys() == s.questions.keys(), s.state_id
        for qid, question in s.questions.items():
            target = s.targets[qid]
            assert len(target) == len(_labels(question)), (s.state_id, qid)
            assert all(p >= 0.0 for p in target), (s.state_id, qid)
            assert math.isclose(sum(target), 1.0, abs_tol=1e-9), (s.state_id, qid)


def test_every_state_passes_the_request_schema(mixture):
    for s in mixture:
        request = parse_request(s.state, s.questions)
        for question in request.questions:
            assert len(question.labels) == len(s.targets[question.qid]), (s.state_id, question.qid)


def test_mixture_covers_groups_text_and_image_states_and_all_question_types(mixture):
    assert len(GROUPS) >= 6
    assert all(isinstance(text, str) and text for text in GROUPS.values())
    assert {s.group for s in mixture} == set(GROUPS)
    images = [_image(s) for s in mixture if _image(s) is not None]
    assert images and any(_image(s) is None for s in mixture)
    assert all(image.mode == "RGB" and image.size == (IMAGE_SIZE, IMAGE_SIZE) for image in images)
    assert any(isinstance(s.state, str) for s in mixture)
    assert any(isinstance(s.state, dict) and set(s.state) - {"image"} and _image(s) for s in mixture)
    types = {q["type"] for s in mixture for q in s.questions.values()}
    assert types == {"choice", "noul", "score"}
    assert any(isinstance(q.get("criteria"), dict) for s in mixture for q in s.questions.values())


def test_some_targets_are_soft(mixture):
    soft = [t for s in mixture for t in s.targets.values() if sum(p > 0.0 for p in t) >= 2]
    assert soft, "expected at least one soft (non one-hot) target"
    assert all(max(t) < 1.0 and max(t) > 0.5 for t in soft)  # soft, yet the answer stays clear


def test_answers_are_roughly_balanced_within_each_question(mixture):
    answers = defaultdict(list)
    for s in mixture:
        for qid, question in s.questions.items():
            target = s.targets[qid]
            answers[(s.group, question["instructions"])].append((len(target), target.index(max(target))))
    checked = 0
    for key, rows in answers.items():
        if len(rows) < 40:
            continue
        k = rows[0][0]
        counts = Counter(index for _, index in rows)
        for index in range(k):
            share = counts[index] / len(rows)
            assert 0.6 / k <= share <= 1.4 / k, (key, index, share)
        checked += 1
    assert checked >= 14  # every constant question plus every ticket field


def test_answer_depends_on_the_state_not_the_question_text(mixture):
    answers = defaultdict(Counter)
    for s in mixture:
        for qid, question in s.questions.items():
            answers[question["instructions"]][_answer(s, qid)] += 1
    for instructions, counts in answers.items():
        total = sum(counts.values())
        assert len(counts) >= 2, instructions
        assert counts.most_common(1)[0][1] / total <= 0.6, (instructions, counts)


def test_images_are_flat_fills_on_white(mixture):
    for s in mixture:
        image = _image(s)
        if image is None:
            continue
        colours = {rgb: n for n, rgb in image.getcolors(maxcolors=16)}
        assert (255, 255, 255) in colours and len(colours) == 2, (s.state_id, colours)


def test_count_images_fill_as_many_quadrants_as_the_target_level(mixture):
    half = IMAGE_SIZE // 2
    for s in (s for s in mixture if s.group == "image_count"):
        image = _image(s)
        filled = sum(
            image.getpixel((x * half + half // 2, y * half + half // 2)) != (255, 255, 255)
            for x in (0, 1) for y in (0, 1)
        )
        assert filled == int(_answer(s, "count")) + 1, s.state_id


def test_colour_squares_span_at_least_half_the_canvas(mixture):
    for s in (s for s in mixture if s.group == "image_color"):
        left, top, right, bottom = Image.eval(_image(s).convert("L"), lambda v: 255 - v).getbbox()
        assert right - left >= IMAGE_SIZE // 2 and bottom - top >= IMAGE_SIZE // 2, s.state_id


def test_corpus_covers_every_word_the_generator_emits(mixture):
    vocabulary = {word for phrase in corpus(0) for word in WORD.findall(phrase)}
    emitted = {word for s in mixture for text in _texts(s) for word in WORD.findall(text)}
    # Reference numbers are digits, which the corpus holds one by one.
    assert {word for word in emitted - vocabulary if not word.isdigit()} == set()
    template = {"State", "question", "Options", "choice", "noul", "score", "level", "false", "true"}
    assert template | set("0123456789") <= vocabulary


def test_corpus_is_deterministic_and_has_no_duplicates():
    first = corpus(3)
    assert first == corpus(3)
    assert len(first) == len(set(first))
    assert all(isinstance(phrase, str) and phrase for phrase in first)


def test_generate_rejects_bad_sizes():
    assert generate(seed=0, states_per_group=0) == []
    with pytest.raises(ValueError):
        generate(seed=0, states_per_group=-1)
    with pytest.raises(ValueError):
        generate(seed=0, states_per_group=1, image_size=4)
