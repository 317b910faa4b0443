"""Text classification and decision sources on the Hub: MASSIVE, XNLI, BoolQ, AG News, emotion,
BANKING77, WikiQA, SMS spam and typed decisions (all Parquet, labels as ClassLabel names)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from .readers import class_names, parquet_rows
from .rows import Converted
from .sources import Source

SOFT_RENORMALISE = 1e-4  # a soft target within this of 1 is renormalised; further off, it is invalid


def _files(source: Source, found: dict[str, list[Path]]) -> Iterator[tuple[str | None, Path, str]]:
    """(official split, local path, the file's manifest path) of every raw file."""
    for file in source.files:
        for path in found[file.path]:
            yield file.split, path, file.path


def _classification(source, found, group_of, state_of, instructions: str, label: str = "label",
                    links_of=None) -> Iterator[Converted]:
    """One choice question over a file's ClassLabel names per row."""
    for split, path, name in _files(source, found):
        names = class_names(path, label)
        for index, row in enumerate(parquet_rows(path)):
            if row[label] is None or not 0 <= row[label] < len(names):
                continue  # unlabelled (-1 or null): nothing to learn or test
            record = {"id": f"{name}:{index}", "group": group_of(path, name), "state": state_of(row),
                      "questions": {"label": {"type": "choice", "instructions": instructions, "criteria": names}},
                      "labels": {"label": names[row[label]]}}
            yield Converted(record, split, links_of(row, split, index) if links_of else ())


def massive(source, found):
    """MASSIVE 1.1 (en-US, zh-CN): the intent of an utterance, 60 candidates; a translation
    joins its original (one SLURP id)."""
    return _classification(
        source, found, lambda path, name: f"massive_{name.split('/')[0]}", lambda row: row["utt"],
        "Which intent does the utterance express?", label="intent",
        links_of=lambda row, split, index: (f"massive:{row['id']}",))


def xnli(source, found):
    """XNLI (en, zh): the relation of a hypothesis to a premise; aligned translations share a
    row index, so they join."""
    return _classification(
        source, found, lambda path, name: f"xnli_{name.split('/')[0]}",
        lambda row: {"premise": row["premise"], "hypothesis": row["hypothesis"]},
        "How does the hypothesis relate to the premise?",
        links_of=lambda row, split, index: (f"xnli:{split}:{index}",))


def ag_news(source, found):
    return _classification(source, found, lambda path, name: "ag_news", lambda row: row["text"],
                           "Which section of a news site does this article belong in?")


def emotion(source, found):
    return _classification(source, found, lambda path, name: "emotion", lambda row: row["text"],
                           "Which emotion does the writer express?")


def banking77(source, found):
    return _classification(source, found, lambda path, name: "banking77", lambda row: row["text"],
                           "Which banking request does the customer make?")


def boolq(source, found) -> Iterator[Converted]:
    """BoolQ: does the passage answer the yes/no question with yes (noul)."""
    for split, path, name in _files(source, found):
        for index, row in enumerate(parquet_rows(path)):
            question = row["question"].strip()
            question = question[:1].upper() + question[1:] + ("" if question.endswith("?") else "?")
            record = {"id": f"{name}:{index}", "group": "boolq", "state": row["passage"],
                      "questions": {"answer": {"type": "noul", "instructions": question}},
                      "labels": {"answer": bool(row["answer"])}}
            yield Converted(record, split)


def wiki_qa(source, found) -> Iterator[Converted]:
    """WikiQA: does a Wikipedia sentence answer the question (noul); rows of one question, or
    of one article, join."""
    for split, path, name in _files(source, found):
        for index, row in enumerate(parquet_rows(path)):
            record = {"id": f"{name}:{index}", "group": "wikiqa",
                      "state": {"question": row["question"], "sentence": row["answer"]},
                      "questions": {"answers": {"type": "noul",
                                                "instructions": "Does the sentence answer the question?"}},
                      "labels": {"answers": int(row["label"]) == 1}}
            yield Converted(record, split, (f"wikiqa-question:{row['question_id']}",
                                            f"wikiqa-article:{row['document_title']}"))


def sms_spam(source, found) -> Iterator[Converted]:
    """The UCI SMS Spam Collection: is the message spam (noul)."""
    for split, path, name in _files(source, found):
        names = class_names(path, "label")
        for index, row in enumerate(parquet_rows(path)):
            record = {"id": f"{name}:{index}", "group": "sms_spam", "state": row["sms"].strip(),
                      "questions": {"spam": {"type": "noul", "instructions": "Is this message unsolicited spam?"}},
                      "labels": {"spam": names[row["label"]] == "spam"}}
            yield Converted(record, split)


def typed_decisions(source, found) -> Iterator[Converted]:
    """Typed decisions: each case's questions of all three types with soft targets (the
    source's probabilities, renormalised when they miss 1 by at most 1e-4)."""
    for split, path, _ in _files(source, found):
        for row in parquet_rows(path):
            questions, gold = json.loads(row["questions"]), json.loads(row["gold"])
            labels = {}
            for qid, question in questions.items():
                probabilities = {str(key): float(value) for key, value in gold[qid]["probabilities"].items()}
                total = sum(probabilities.values())
                if total > 0 and abs(total - 1.0) <= SOFT_RENORMALISE:
                    probabilities = {key: value / total for key, value in probabilities.items()}
                labels[qid] = probabilities.get("true", 0.0) if question["type"] == "noul" else probabilities
            record = {"id": row["id"], "group": "typed_decisions", "state": json.loads(row["state"]),
                      "questions": questions, "labels": labels}
            yield Converted(record, split)


CONVERTERS = {"massive": massive, "xnli": xnli, "boolq": boolq, "ag_news": ag_news, "emotion": emotion,
              "banking77": banking77, "wiki_qa": wiki_qa, "sms_spam": sms_spam, "typed_decisions": typed_decisions}
