"""Image questions on the Hub: A-OKVQA, ScienceQA (its image subset) and VQAv2 (yes/no).

Images stay the bytes the Parquet stores. A-OKVQA and VQAv2 both show COCO photos (one id
space across the 2014 and 2017 releases), so a photo links its rows across the two groups
even where the two files' bytes differ.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

from .readers import image_bytes, parquet_rows, tar_members
from .rows import Converted


def _choice(question: str, choices: list[str], answer: int) -> tuple[dict, dict] | None:
    """(questions, labels) of a multiple-choice row, or None when its choices repeat or its
    answer is missing (nothing to learn from)."""
    choices = [str(choice) for choice in choices]
    if len(set(choices)) != len(choices) or answer is None or not 0 <= answer < len(choices):
        return None
    return {"answer": {"type": "choice", "instructions": question, "criteria": choices}}, {"answer": choices[answer]}


def _coco_ids(source, found) -> dict[str, int]:
    """question_id -> COCO image_id from the A-OKVQA annotation release (its JSON lists)."""
    ids = {}
    for file in source.files:
        if file.path.endswith(".tar.gz"):
            for path in found[file.path]:
                for _, data in tar_members(path, lambda name: name.endswith(".json") and "aokvqa_v1p0_" in name):
                    ids.update({row["question_id"]: int(row["image_id"]) for row in json.loads(data)})
    return ids


def aokvqa(source, found) -> Iterator[Converted]:
    """A-OKVQA: the multiple-choice question about a COCO photo (the official test split has no
    answers, so the validation split is the test partition, as upstream)."""
    coco = _coco_ids(source, found)
    for file in source.files:
        if not file.path.endswith(".parquet"):
            continue
        for path in found[file.path]:
            for row in parquet_rows(path):
                data = image_bytes(row.get("image"))
                chosen = _choice(row["question"], row["choices"], row.get("correct_choice_idx"))
                if data is None or chosen is None:
                    continue
                image_id = row.get("image_id", coco.get(row["question_id"]))
                record = {"id": row["question_id"], "group": "aokvqa", "state": {},
                          "questions": chosen[0], "labels": chosen[1]}
                links = () if image_id is None else (f"photo:coco:{int(image_id)}",)
                yield Converted(record, file.split, links, data)


def scienceqa(source, found) -> Iterator[Converted]:
    """ScienceQA, the questions with an image: its hint (the text context) is the state."""
    for file in source.files:
        for path in found[file.path]:
            for index, row in enumerate(parquet_rows(path)):
                data = image_bytes(row.get("image"))
                chosen = _choice(row["question"], row["choices"], row.get("answer"))
                if data is None or chosen is None:
                    continue
                hint = (row.get("hint") or "").strip()
                record = {"id": f"{file.path}:{index}", "group": "scienceqa",
                          "state": {"context": hint} if hint else {}, "questions": chosen[0], "labels": chosen[1]}
                yield Converted(record, file.split, (), data)


def vqav2(source, found) -> Iterator[Converted]:
    """VQAv2, the yes/no questions: P(true) is the share of "yes" among the annotators' yes and
    no answers (a soft target); a photo's questions link."""
    for file in source.files:
        for path in found[file.path]:
            for row in parquet_rows(path):
                if row.get("answer_type") != "yes/no":
                    continue
                answers = row.get("answers") or []
                if isinstance(answers, dict):  # a Sequence of structs reads as a struct of lists
                    answers = answers.get("answer") or []
                votes = [(answer.get("answer") if isinstance(answer, dict) else answer) for answer in answers]
                votes = [str(vote).strip().casefold() for vote in votes if vote is not None]
                yes, no = votes.count("yes"), votes.count("no")
                data = image_bytes(row.get("image"))
                if yes + no == 0 or data is None:
                    continue
                record = {"id": str(row["question_id"]), "group": "vqav2_yesno", "state": {},
                          "questions": {"answer": {"type": "noul", "instructions": row["question"]}},
                          "labels": {"answer": yes / (yes + no)}}
                yield Converted(record, file.split, (f"photo:coco:{int(row['image_id'])}",), data)


CONVERTERS = {"aokvqa": aokvqa, "scienceqa": scienceqa, "vqav2": vqav2}
