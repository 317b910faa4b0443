"""ScreenQA: questions about app screenshots (RICO), answered by a region of the screen.

The annotations (google-research-datasets/screen_qa, `answers_and_bboxes`) name the answering
UI element by its index in the screen's view hierarchy (depth-first, pre-order); the RICO
archive holds each screen's screenshot and view hierarchy. Candidates are the visible leaf
elements inside the screen, each as its box in [0, 1] coordinates (duplicate boxes once).
`screenqa_choice` picks the answering region among them; `screenqa_noul` asks of the answering
region and of one other (chosen by hash) whether it answers. The state is the screenshot alone.
Questions whose raters disagree, name no single element, or whose screen offers fewer than 2 or
more than 128 candidates are left out. The screens used are extracted once from the archive,
next to it.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from ..isolation import stable_fraction
from .readers import tar_members
from .rows import Converted, LazyImage

MAX_CANDIDATES = 128


def candidates(hierarchy: dict) -> dict[int, tuple[float, float, float, float]]:
    """Depth-first index -> normalised box of every visible leaf inside the screen."""
    root = (hierarchy.get("activity") or {}).get("root") or {}
    bounds = root.get("bounds") or [0, 0, 0, 0]
    width, height = bounds[2] - bounds[0], bounds[3] - bounds[1]
    found, seen, index = {}, set(), 0
    stack = [root]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        own, index = index, index + 1
        children = [child for child in node.get("children") or [] if isinstance(child, dict)]
        stack.extend(reversed(children))
        box = node.get("bounds")
        if children or node.get("visibility", "visible") != "visible" or not box or len(box) != 4:
            continue
        left, top, right, bottom = box
        if width <= 0 or height <= 0 or not (0 <= left < right <= width and 0 <= top < bottom <= height):
            continue
        normal = (round(left / width, 3), round(top / height, 3), round(right / width, 3), round(bottom / height, 3))
        if normal not in seen:
            seen.add(normal)
            found[own] = normal
    return found


def box_text(box) -> str:
    return "box [left, top, right, bottom] = [" + ", ".join(f"{value:.3f}" for value in box) + "]"


def _answer(row: dict) -> int | None:
    """The view-hierarchy index every rater chose, when each chose exactly one element."""
    chosen = set()
    for rater in row.get("ground_truth") or []:
        elements = rater.get("ui_elements") or []
        if len(elements) != 1:
            return None
        chosen.add(elements[0].get("vh_index"))
    return chosen.pop() if len(chosen) == 1 else None


def _extracted(archive: Path, screens: set[str]) -> Path:
    """A folder holding `<id>.jpg` and `<id>.json` of the screens, extracted once from the RICO
    archive (into a temporary folder, renamed when complete)."""
    target = archive.with_name(archive.name + ".screens")
    marker = target / ".complete"
    if marker.is_file() and set(json.loads(marker.read_text())) >= screens:
        return target
    temporary = archive.with_name(f".{archive.name}.screens.partial")
    shutil.rmtree(temporary, ignore_errors=True)
    temporary.mkdir(parents=True)
    for name, data in tar_members(archive, lambda member: Path(member).stem in screens
                                  and member.endswith((".jpg", ".json"))):
        (temporary / Path(name).name).write_bytes(data)
    (temporary / ".complete").write_text(json.dumps(sorted(screens)))
    if target.exists():
        shutil.rmtree(target)
    os.replace(temporary, target)
    return target


def screenqa(source, found) -> Iterator[Converted]:
    annotations = {}
    for file in source.files:
        if file.path.endswith(".json"):
            (path,) = found[file.path]
            annotations[file.split] = json.loads(path.read_text(encoding="utf-8"))
    archive = next(path for file in source.files if file.path.endswith(".tar.gz") for path in found[file.path])
    screens = {str(row["image_id"]) for rows in annotations.values() for row in rows}
    folder = _extracted(archive, screens)
    regions: dict[str, dict] = {}
    for split, rows in annotations.items():
        for index, row in enumerate(rows):
            screen = str(row["image_id"])
            hierarchy_file, image_file = folder / f"{screen}.json", folder / f"{screen}.jpg"
            if not (hierarchy_file.is_file() and image_file.is_file()):
                continue
            if screen not in regions:
                regions[screen] = candidates(json.loads(hierarchy_file.read_text(encoding="utf-8")))
            boxes, answer = regions[screen], _answer(row)
            if answer not in boxes or not 2 <= len(boxes) <= MAX_CANDIDATES:
                continue
            image = LazyImage(screen, _reader(image_file))
            identifier = f"{split}:{index}"
            criteria = {f"r{key}": box_text(box) for key, box in boxes.items()}
            record = {"id": identifier, "group": "screenqa_choice", "state": {},
                      "questions": {"region": {"type": "choice", "instructions": row["question"],
                                               "criteria": criteria}},
                      "labels": {"region": f"r{answer}"}}
            links = (f"rico:{screen}",)
            yield Converted(record, split, links, image)
            others = sorted(key for key in boxes if key != answer)
            negative = others[int(stable_fraction("screenqa", identifier) * len(others))]
            for key, truth in ((answer, True), (negative, False)):
                # The region goes in the question, not the state: one box recurs on many screens,
                # and a state text shared across screens would join them all into one partition.
                instructions = f"Does the region {box_text(boxes[key])} answer the question: {row['question']}"
                record = {"id": f"{identifier}:r{key}", "group": "screenqa_noul", "state": {},
                          "questions": {"answers": {"type": "noul", "instructions": instructions}},
                          "labels": {"answers": truth}}
                yield Converted(record, split, links, image)


def _reader(path: Path):
    return lambda: path.read_bytes()


CONVERTERS = {"screenqa": screenqa}
