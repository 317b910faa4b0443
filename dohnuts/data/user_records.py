"""The user's decision records: JSONL (one request per line) or Parquet, validated into states.

A record is the request a user later sends to `predict`, plus labels:

    {"id": "t-0001", "group": "ticket_routing", "split": null,
     "state": {"message": "I was billed twice", "image": "images/t-0001.png"},
     "questions": {"team": {"type": "choice", "instructions": "...", "criteria": [...]}, ...},
     "labels": {"team": "billing", "refund": 0.9, "urgency": {"0": 0.0, "1": 0.3, "2": 0.7}},
     "photo": null}

`state` and `questions` go through `dohnuts.schema.parse_request`, as in `predict` (same
checks, same messages). A state holds images anywhere, as many as `model.max_images`: the value of
an "image" key, or any string that names an image (a path without spaces ending in .png, .jpg,
.jpeg, .gif, .webp, .bmp or .tif, relative to the records file, or a `data:image/...;base64,`
URL), decoded with Pillow: `{"before": "images/a.png", "after": ["images/b.png", "c.jpg"]}`.
A label is hard or soft: choice an option name or {option: probability}; noul true/false or
P(true); score a level index or {level index: probability}; soft labels sum to 1 over the
question's candidates. `group`
defaults to the file's name without extension, `id` to "file:line", `split` (a pinned
partition) to none, `photo` (the id of the photo an image shows, such as "coco:397133": states
showing one photo share a partition even when their files differ) to none. In Parquet, each
of state, questions and labels is a column of JSON text (or of native mappings); line numbers
are rows, from 1.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from PIL import Image, UnidentifiedImageError

from ..schema import MAX_IMAGES, parse_request
from .image_files import ImageFile, pil_state
from .isolation import PARTITIONS

SUFFIXES = (".jsonl", ".parquet")
KEYS = {"id", "group", "split", "state", "questions", "labels", "photo"}
SOFT_TOLERANCE = 1e-6


@dataclass(frozen=True)
class SourceState:
    """One validated state with its questions and target distributions, from any source.

    group, state_id: as written to the partitions; state: a string, or a mapping holding decoded
    PIL images (or `ImageFile`s) anywhere; questions: qid -> question as `predict` takes
    it; targets: qid -> probabilities in candidate order; split: a pinned partition or None;
    source: an id that joins states of one source record (isolation); where: "file:line";
    links: further ids that join states (isolation; a record's photo is "photo:<photo>");
    among: the partitions a hash may place it in (None: all; `dohnuts.data.isolation.Unit`).
    """

    group: str
    state_id: str
    state: object
    questions: dict
    targets: dict
    split: str | None = None
    source: str | None = None
    where: str = ""
    links: tuple[str, ...] = ()
    among: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Problem:
    """Why one record (or one of its questions) is invalid."""

    where: str  # file:line
    reason: str
    qid: str | None = None

    def __str__(self) -> str:
        return f"{self.where}: question {self.qid}: {self.reason}" if self.qid else f"{self.where}: {self.reason}"


class RecordsError(ValueError):
    """Invalid decision records: every problem, one line each (the first `shown`)."""

    def __init__(self, problems: list[Problem], shown: int = 50):
        self.problems = problems
        lines = [str(problem) for problem in problems[:shown]]
        more = f"\n... and {len(problems) - shown} more" if len(problems) > shown else ""
        super().__init__(f"{len(problems)} invalid records or labels (nothing was written; set "
                         f"data.skip_invalid: true to drop them instead):\n" + "\n".join(lines) + more)


def record_files(path: Path) -> list[Path]:
    """The records files of `path`: the file itself, or every *.jsonl and *.parquet under a
    folder (hidden files and folders left out), sorted.

    Raises:
        FileNotFoundError: nothing there, or no records file in the folder.
    """
    path = Path(path)
    if path.is_file():
        if path.suffix not in SUFFIXES:
            raise ValueError(f"{path}: decision records are {' or '.join(SUFFIXES)} files")
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"data.path {path} does not exist")
    files = sorted(file for file in path.rglob("*") if file.suffix in SUFFIXES and file.is_file()
                   and not any(part.startswith(".") for part in file.relative_to(path).parts))
    if not files:
        raise FileNotFoundError(f"data.path {path} holds no {' or '.join(SUFFIXES)} files")
    return files


def _lines(file: Path) -> Iterator[tuple[int, object]]:
    """(line number, decoded record or the Problem reason) of every non-empty line or row."""
    if file.suffix == ".parquet":
        table = pd.read_parquet(file)
        for index, row in enumerate(table.to_dict("records"), start=1):
            yield index, {key: _plain(value) for key, value in row.items() if not _missing(value)}
        return
    with open(file, encoding="utf-8-sig", errors="surrogateescape") as handle:  # a BOM first is dropped
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                line.encode("utf-8")
            except UnicodeEncodeError:
                yield number, "not UTF-8 text (a records file is UTF-8 JSON Lines)"
                continue
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError as error:
                yield number, f"not valid JSON ({error.msg} at column {error.colno})"
            except RecursionError:
                yield number, "nested too deep to read"


def _plain(value):
    """A Parquet cell as JSON would give it: a native list column's numpy arrays as lists, at
    any depth (a struct column's mappings are kept; their keys are the column's, every row's)."""
    if isinstance(value, np.ndarray):
        return [_plain(item) for item in value.tolist()]
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    return value


def _missing(value) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _json_field(value, name: str):
    """A Parquet cell may hold JSON text for a mapping field."""
    if isinstance(value, str) and name in ("questions", "labels"):
        return json.loads(value)
    if isinstance(value, str) and name == "state" and value[:1] in ('"', "{", "["):
        try:  # a mapping or list as JSON text; a text that merely starts so is a text
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def read_records(path: Path, reserved: tuple[str, ...] = (),
                 max_images: int = MAX_IMAGES) -> tuple[list[SourceState], list[Problem]]:
    """Every record of `path` validated: the valid states, and a Problem for each invalid
    record (a record with any problem is left out whole).

    Args:
        path: a records file or a folder of them (`record_files`).
        reserved: special-token strings no text may contain (the template's).
        max_images: the most images a state may hold (`model.max_images`).
    """
    states, problems = [], []
    seen_lines = 0
    for file in record_files(path):
        for number, record in _lines(file):
            seen_lines += 1
            where = f"{file}:{number}"
            try:
                found = validate_record(record, f"{file}:{number}", file.stem, reserved, file.parent, max_images)
            except RecursionError:
                found = [(None, "the record is nested too deep to read")]
            if isinstance(found, SourceState):
                states.append(found)
            else:
                problems.extend(Problem(where, reason, qid) for qid, reason in found)
    if not seen_lines:
        problems.append(Problem(str(path), "no records: every file is empty"))
    return states, problems


def validate_record(record, where: str, group: str, reserved: tuple[str, ...] = (), folder: Path | None = None,
                    max_images: int = MAX_IMAGES) -> SourceState | list[tuple[str | None, str]]:
    """A SourceState, or the (qid or None, reason) problems of one record.

    Args:
        record: a decoded record (a mapping with the keys of KEYS) or why it could not be decoded.
        where: "file:line" of the record, its default id.
        group: the group of a record that names none.
        reserved: special-token strings no text may contain.
        folder: where an image's path is relative to (None: images must be decoded already).
        max_images: the most images a state may hold.
    """
    if isinstance(record, str):
        return [(None, record)]
    if not isinstance(record, Mapping):
        return [(None, f"a record must be a JSON object, got {type(record).__name__}")]
    problems = []
    unknown = set(record) - KEYS
    if unknown:
        problems.append((None, f"unknown keys {sorted(unknown)}; a record has {sorted(KEYS)}"))
    try:
        record = {key: _json_field(value, key) for key, value in record.items()}
    except json.JSONDecodeError as error:
        return [(None, f"a Parquet cell is not valid JSON ({error.msg})")]
    for key in ("state", "questions", "labels"):
        if key not in record:
            problems.append((None, f"missing {key!r}"))
    split = record.get("split")
    if split is not None and split not in PARTITIONS:
        problems.append((None, f"split must be one of {PARTITIONS} or null, got {split!r}"))
    for key in ("id", "group", "photo"):
        if key in record and not (key == "photo" and record[key] is None) and not (
                isinstance(record[key], str) and record[key]):
            problems.append((None, f"{key} must be a non-empty string, got {record[key]!r}"))
    if "state" not in record or "questions" not in record:
        return problems
    # Every problem of the record is listed, not only the first: its image, its state, each
    # question, each label of the questions that are valid.
    state, image_problems = decoded_state(folder, record["state"])
    problems += [(None, problem) for problem in image_problems]
    questions, found = _questions(pil_state(state), record["questions"], reserved, max_images)
    problems += found
    if "labels" not in record:
        return problems
    labels = record["labels"]
    if not isinstance(labels, Mapping):
        return problems + [(None, f"labels must be a mapping qid -> label, got {type(labels).__name__}")]
    targets = {}
    for question in questions:
        if question.qid not in labels:
            problems.append((question.qid, "no label"))
            continue
        target = label_target(question, labels[question.qid])
        if isinstance(target, str):
            problems.append((question.qid, target))
        else:
            targets[question.qid] = target
    asked = set(record["questions"]) if isinstance(record["questions"], Mapping) else set()
    problems.extend((qid, "a label for a question that is not asked") for qid in labels if qid not in asked)
    if problems:
        return problems
    identifier = record.get("id", Path(where).name)
    return SourceState(group=record.get("group", group), state_id=identifier, state=state,
                       questions=dict(record["questions"]), targets=targets, split=split,
                       source=f"id:{identifier}", where=where,
                       links=(f"photo:{record['photo']}",) if record.get("photo") else ())


def _questions(state, questions, reserved: tuple[str, ...],
               max_images: int = MAX_IMAGES) -> tuple[list, list[tuple[str | None, str]]]:
    """(the valid questions, the problems of the state and of each invalid question): the state
    and each question checked as `parse_request` checks them, so every mistake is named."""
    try:
        return list(parse_request(state, questions, reserved, max_images).questions), []
    except (TypeError, ValueError) as error:
        if not isinstance(questions, Mapping) or not questions:
            return [], [(None, str(error))]
    problems = []
    try:
        parse_request(state, {"state": {"type": "noul"}}, reserved, max_images)
    except (TypeError, ValueError) as error:
        problems.append((None, str(error)))
    valid = []
    for qid, question in questions.items():
        try:
            valid += parse_request("", {qid: question}, reserved).questions
        except (TypeError, ValueError) as error:
            problems.append((None, str(error)))  # the schema's message names the question
    return valid, problems


IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".gif", ".webp", ".bmp", ".tif", ".tiff")


def names_an_image(text: str) -> bool:
    """Whether a string of a state stands for an image: a `data:image/` URL, or a path (no spaces)
    ending in an image suffix."""
    if text.startswith("data:image/"):
        return True
    return len(text) < 4096 and not any(space in text for space in " \t\n") and text.lower().endswith(IMAGE_SUFFIXES)


def decoded_state(folder: Path | None, state) -> tuple[object, list[str]]:
    """The state with its images decoded, and the problems of those that cannot be.

    An image is any value under an "image" key, or any string of the state (at any depth, or the
    whole state, which then reads as {"image": it}) that `names_an_image`: a path relative to
    `folder` (the records file's), or a data: URL; a PIL image or an `ImageFile` is kept. A
    value that cannot be decoded stays as it was written.

    Returns:
        (state, a problem for each image that cannot be decoded, named by its place: "state.image",
        "state.photos[1]")
    """
    problems: list[str] = []

    def visit(value, where: str, under_image: bool):
        if isinstance(value, ImageFile):
            return value
        if isinstance(value, Image.Image):
            return value.convert("RGB")
        if isinstance(value, str) and (under_image or names_an_image(value)):
            decoded, problem = _decoded_image(folder, value, where)
            if problem:
                problems.append(problem)
            return decoded if problem is None else value
        if under_image:
            problems.append(f"{where} must be a path relative to the records file or a data: URL, got {value!r}")
            return value
        if isinstance(value, Mapping):
            return {key: visit(item, f"{where}.{key}", key == "image") for key, item in value.items()}
        if isinstance(value, list):
            return [visit(item, f"{where}[{index}]", False) for index, item in enumerate(value)]
        return value

    if isinstance(state, str) and names_an_image(state):  # a state that is one image, as on the wire
        state = {"image": state}
    if not isinstance(state, Mapping | list):
        return state, []
    try:
        return visit(state, "state", False), problems
    except RecursionError:
        return state, ["state is nested too deep to read"]


def _decoded_image(folder: Path | None, value: str, where: str) -> tuple[Image.Image | None, str | None]:
    """(the image a path or data: URL names, None) or (None, why it cannot be decoded)."""
    if folder is None and not value.startswith("data:"):
        return None, f"{where} must be a path relative to the records file or a data: URL, got {value!r}"
    try:
        if value.startswith("data:"):
            header, _, payload = value.partition(",")
            if not header.startswith("data:image/") or ";base64" not in header:
                return None, f"{where} data URL must be data:image/...;base64,..."
            try:
                data = base64.b64decode("".join(payload.split()), validate=True)  # wrapped base64 too
            except (binascii.Error, ValueError) as error:
                return None, f"{where} data URL is not valid base64 ({error})"
        else:
            image_path = Path(folder) / value
            if not image_path.is_file():
                return None, f"{where}: no such file {value} (in {folder})"
            data = image_path.read_bytes()
        with Image.open(io.BytesIO(data)) as image:
            return image.convert("RGB"), None
    except Image.DecompressionBombError as error:
        return None, f"{where} {value[:60]} is too large an image to decode ({error})"
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as error:  # Pillow's decoders' errors
        return None, f"{where} {value[:60]} cannot be decoded as an image ({type(error).__name__}: {error})"


def label_target(question, label) -> list[float] | str:
    """The target distribution of a label in candidate order, or why the label is invalid.

    choice: an option name, or {option: probability}; noul: true/false or P(true); score: a
    level index, or {level index: probability}. Probabilities lie in [0, 1] and a soft label
    sums to 1 within 1e-6 over the question's candidates.
    """
    labels = list(question.labels)
    kind = question.kind
    if kind == "noul":
        if isinstance(label, bool):
            return [0.0, 1.0] if label else [1.0, 0.0]
        if isinstance(label, (int, float)) and 0.0 <= label <= 1.0:
            return [1.0 - float(label), float(label)]
        return f"a noul label is true, false or P(true) in [0, 1], got {label!r}"
    if isinstance(label, Mapping):
        keys = [str(key) for key in label]
        unknown = [key for key in keys if key not in labels]
        if unknown:
            what = "options" if kind == "choice" else "levels"
            return f"soft label names unknown {what} {unknown}; the {what} are {labels}"
        values = list(label.values())
        if any(isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0
               for value in values):
            return f"soft label probabilities must be numbers in [0, 1], got {dict(label)}"
        total = sum(values)
        if abs(total - 1.0) > SOFT_TOLERANCE:
            return f"soft label sums to {total:.6g}, not 1 (within {SOFT_TOLERANCE})"
        table = dict(zip(keys, (float(value) for value in values)))
        return [table.get(name, 0.0) for name in labels]
    if kind == "choice":
        if isinstance(label, (int, float)) and not isinstance(label, bool):
            label = str(label)  # numeric criteria items are labelled by their text
        if isinstance(label, str) and label in labels:
            return [1.0 if name == label else 0.0 for name in labels]
        return f"unknown option {label!r}; the options are {labels}"
    if isinstance(label, int) and not isinstance(label, bool) and 0 <= label < len(labels):
        return [1.0 if index == label else 0.0 for index in range(len(labels))]
    return f"a score label is a level index in 0..{len(labels) - 1} or {{level: probability}}, got {label!r}"
