"""The test stage's audits: whether an answer depends on how, and with what, a question is asked.

Each audit asks a sample of the test partition's requests again, changed in one way that must
not change an answer, and compares the served probabilities label by label:
- order: every choice's options in another order (the template's hashed layout makes this 0);
- alternatives: one option other than the top one removed from each choice of three or more
  options; the others' probabilities, renormalised, should not move (the Luce choice axiom,
  independence of irrelevant alternatives; the hashed layout does not promise it);
- company: each question asked alone instead of with the request's other questions;
- batch: the request answered in the test stage's batches against the request alone.
The baseline of the first three is the request alone, so only the one change differs.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np

from ..data.records import RecordReader
from ..runtime.evaluation import StateRecords, request_of
from ..runtime.predict import Predictor

AUDITS = ("order", "alternatives", "company", "batch")


def sample(requests: list[StateRecords], count: int) -> list[StateRecords]:
    """Up to `count` requests taken in turn from each group (a request's first record's group),
    so a group with few states is audited as well as a large one; in partition order."""
    by_group: dict[str, list[StateRecords]] = {}
    for records in requests:
        by_group.setdefault(records.groups[0], []).append(records)
    chosen = []
    for records in itertools.chain.from_iterable(itertools.zip_longest(*by_group.values())):
        if records is not None and len(chosen) < count:
            chosen.append(records)
    order = {id(records): index for index, records in enumerate(requests)}
    return sorted(chosen, key=lambda records: order[id(records)])


def permuted(question: dict, rng: np.random.Generator) -> dict:
    """A choice question with its options in another order (a shuffle, turned by one where it
    came out as given); another question as it is."""
    options = _options(question)
    if options is None:
        return question
    order = rng.permutation(len(options))
    if (order == np.arange(len(options))).all():
        order = np.roll(order, 1)
    return _with_options(question, [options[index] for index in order])


def without_one(question: dict, probabilities: dict[str, float], rng: np.random.Generator) -> dict | None:
    """A choice question of three or more options with one option removed, drawn among those
    other than the most probable; None for any other question."""
    options = _options(question)
    if options is None or len(options) < 3:
        return None
    top = max(probabilities, key=probabilities.get)
    others = [index for index, (label, _) in enumerate(options) if label != top]
    dropped = others[int(rng.integers(len(others)))]
    return _with_options(question, [option for index, option in enumerate(options) if index != dropped])


def _options(question: dict) -> list[tuple[str, object]] | None:
    """A choice's options as (label, description or None for a list's item), or None."""
    if question.get("type") != "choice":
        return None
    criteria = question["criteria"]
    if isinstance(criteria, dict):
        return list(criteria.items())
    return [(str(item), item) for item in criteria]


def _with_options(question: dict, options: list[tuple[str, object]]) -> dict:
    criteria = question["criteria"]
    rebuilt = dict(options) if isinstance(criteria, dict) else [item for _, item in options]
    return {**question, "criteria": rebuilt}


def _change(before: dict[str, float], after: dict[str, float]) -> tuple[float, bool]:
    """The largest probability change over `after`'s labels, with `before` renormalised over
    them, and whether the most probable of them changed."""
    total = sum(before[label] for label in after)
    base = {label: before[label] / total for label in after}
    gap = max(abs(base[label] - after[label]) for label in after)
    return gap, max(base, key=base.get) != max(after, key=after.get)


def _probabilities(result: dict) -> dict[str, dict[str, float]]:
    return {qid: answer["probabilities"] for qid, answer in result["answers"].items()}


def changes(predictor: Predictor, reader: RecordReader, requests: list[StateRecords],
            batched: dict[tuple[str, str], dict[str, float]], seed: int = 0) -> Iterator[tuple[str, str, float, bool]]:
    """(audit, group, change, flipped) of each audited question, request by request.

    Args:
        batched: (state_id, qid) -> the probabilities the test stage served in its batches.
    """
    rng = np.random.default_rng(seed)
    for records in requests:
        state, questions = request_of(reader, records)
        groups = dict(zip(records.qids, records.groups))
        alone = _probabilities(predictor.predict(state, questions))
        for qid, probabilities in alone.items():
            yield ("batch", groups[qid], *_change(batched[records.state_id, qid], probabilities))
        shuffled = {qid: permuted(question, rng) for qid, question in questions.items()}
        # By identity: a mapping's options in another order compare equal to the original's.
        if any(shuffled[qid] is not question for qid, question in questions.items()):
            answered = _probabilities(predictor.predict(state, shuffled))
            for qid in (qid for qid in questions if shuffled[qid] is not questions[qid]):
                yield ("order", groups[qid], *_change(alone[qid], answered[qid]))
        reduced = {qid: without_one(question, alone[qid], rng) for qid, question in questions.items()}
        if any(question is not None for question in reduced.values()):
            answered = _probabilities(predictor.predict(
                state, {qid: reduced[qid] or question for qid, question in questions.items()}))
            for qid in (qid for qid, question in reduced.items() if question is not None):
                yield ("alternatives", groups[qid], *_change(alone[qid], answered[qid]))
        if len(questions) > 1:
            for qid, question in questions.items():
                answered = _probabilities(predictor.predict(state, {qid: question}))
                yield ("company", groups[qid], *_change(alone[qid], answered[qid]))


def summarise(found: list[tuple[str, str, float, bool]]) -> dict:
    """Per audit, per group and over all: questions audited, the largest change, the mean of the
    changes, and the share of questions whose most probable answer changed."""
    def summary(rows):
        gaps = np.array([row[2] for row in rows])
        return {"questions": len(rows), "max": float(gaps.max()), "mean": float(gaps.mean()),
                "flips": float(np.mean([row[3] for row in rows]))}

    out = {}
    for audit in AUDITS:
        rows = [row for row in found if row[0] == audit]
        groups = sorted({row[1] for row in rows})
        out[audit] = {"all": summary(rows) if rows else {"questions": 0},
                      "groups": {group: summary([row for row in rows if row[1] == group]) for group in groups}}
    return out
