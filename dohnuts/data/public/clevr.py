"""CLEVR v1.0: questions about rendered scenes, three groups by the program's last function.

`query_color|shape|size|material` -> clevr_attribute (a choice over that attribute's values),
`count` -> clevr_count (a score over 0..10), `exist` -> clevr_exist (noul); the other families
are left out. The official test split has no answers, so the validation split is the test
partition (as upstream). Images are read from the release zip only for the rows kept.
"""

from __future__ import annotations

import json
import zipfile
from collections.abc import Iterator

from .rows import Converted, LazyImage

ATTRIBUTES = {
    "query_color": ["gray", "red", "blue", "green", "brown", "purple", "cyan", "yellow"],
    "query_shape": ["cube", "sphere", "cylinder"],
    "query_size": ["small", "large"],
    "query_material": ["rubber", "metal"],
}
COUNTS = [str(count) for count in range(11)]
SPLITS = {"train": "train", "val": "test"}


def _function(step: dict) -> str:
    return step.get("function", step.get("type", ""))


def _question(row: dict) -> tuple[str, dict, object] | None:
    """(group, questions, labels) of a CLEVR question, or None for a family left out."""
    family = _function(row["program"][-1]) if row.get("program") else ""
    answer = str(row.get("answer", ""))
    if family in ATTRIBUTES and answer in ATTRIBUTES[family]:
        return ("clevr_attribute", {"answer": {"type": "choice", "instructions": row["question"],
                                               "criteria": ATTRIBUTES[family]}}, {"answer": answer})
    if family == "count" and answer in COUNTS:
        return ("clevr_count", {"answer": {"type": "score", "instructions": row["question"], "criteria": COUNTS}},
                {"answer": int(answer)})
    if family == "exist" and answer in ("yes", "no"):
        return "clevr_exist", {"answer": {"type": "noul", "instructions": row["question"]}}, {"answer": answer == "yes"}
    return None


def clevr(source, found) -> Iterator[Converted]:
    (path,) = found[source.files[0].path]
    archive = zipfile.ZipFile(path)  # kept open: the rows' LazyImages read from it after this generator
    names = set(archive.namelist())
    for split, partition in SPLITS.items():
        member = next((name for name in names if name.endswith(f"questions/CLEVR_{split}_questions.json")), None)
        if member is None:
            raise ValueError(f"{path}: no questions/CLEVR_{split}_questions.json in the archive")
        root = member[: -len(f"questions/CLEVR_{split}_questions.json")]
        with archive.open(member) as stream:
            questions = json.load(stream)["questions"]
        for index, row in enumerate(questions):
            found_question = _question(row)
            if found_question is None:
                continue
            group, asked, labels = found_question
            image = f"{root}images/{split}/{row['image_filename']}"
            record = {"id": f"{split}:{row.get('question_index', index)}", "group": group, "state": {},
                      "questions": asked, "labels": labels}
            yield Converted(record, partition, (), LazyImage(image, _reader(archive, image)))


def _reader(archive: zipfile.ZipFile, member: str):
    return lambda: archive.read(member)


CONVERTERS = {"clevr": clevr}
