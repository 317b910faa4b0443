"""Decision records on disk (Parquet + image files), partitions, sampling and row encoding."""

from __future__ import annotations

import hashlib
import io
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from PIL import Image

from ..io import atomic_directory, verify_manifest, write_bytes, write_manifest, write_parquet
from ..model.features import image_key
from ..model.template import EncodedImage, Row, Template
from ..schema import parse_request

PARTITIONS = ("train", "dev", "calibration", "test")
RECORDS = "records.parquet"


def stable_fraction(*parts) -> float:
    """A number in [0, 1) from a SHA-256 of the parts: the same on every machine and run."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def assign_partition(seed: int, group: str, state_id: str, fractions: dict) -> str:
    """Partition of a state by hashing its key: all questions of a state land together."""
    total = sum(fractions.values())
    point, edge = stable_fraction(seed, group, state_id) * total, 0.0
    for name in PARTITIONS:
        edge += fractions[name]
        if point < edge:
            return name
    return PARTITIONS[-1]


def write_partition(records: list[dict], images: dict[str, bytes], out: Path, partition: str) -> dict:
    """Write one partition folder atomically: records.parquet, images/*.png and a manifest.

    Returns:
        Row, state and per-group row counts.
    """
    table = pd.DataFrame.from_records(records)
    counts = {"rows": len(table), "states": int(table.state_id.nunique()) if len(table) else 0,
              "groups": {g: int(n) for g, n in table.group.value_counts().sort_index().items()} if len(table) else {}}
    with atomic_directory(out) as tmp:
        for name in sorted({record["image"] for record in records if record["image"]}):
            write_bytes(tmp / name, images[name])
        write_parquet(tmp / RECORDS, table)
        write_manifest(tmp, {"partition": partition, "counts": counts})
    return counts


def write_mixture(states, root: Path, seed: int, fractions: dict) -> dict:
    """Write synthetic states, one row per question, into one folder per partition under `root`.

    Each partition has its own folder so the pipeline graph shows which stage reads which.

    Returns:
        partition -> row, state and per-group row counts.
    """
    records: dict[str, list[dict]] = {name: [] for name in PARTITIONS}
    images: dict[str, bytes] = {}
    for state in states:
        value, image_name = state.state, None
        if isinstance(value, dict) and "image" in value:
            buffer = io.BytesIO()
            value["image"].save(buffer, format="PNG")
            data = buffer.getvalue()
            image_name = f"images/{hashlib.sha256(data).hexdigest()[:32]}.png"
            images[image_name] = data
            value = {key: item for key, item in value.items() if key != "image"}
        partition = assign_partition(seed, state.group, state.state_id, fractions)
        for qid, question in state.questions.items():
            records[partition].append({
                "group": state.group, "state_id": state.state_id, "partition": partition,
                "state": json.dumps(value, ensure_ascii=False), "image": image_name, "qid": qid,
                "question": json.dumps(question, ensure_ascii=False),
                "target": [float(x) for x in state.targets[qid]],
            })
    return {name: write_partition(records[name], images, Path(root) / name, name) for name in PARTITIONS}


def load_records(folder: Path) -> pd.DataFrame:
    """The rows of one partition folder (SHA-256 verified), in a stable order.

    Raises:
        IntegrityError: a file differs from the manifest; ValueError: no rows.
    """
    verify_manifest(folder, required=(RECORDS,))
    rows = pd.read_parquet(Path(folder) / RECORDS).reset_index(drop=True)
    if rows.empty:
        raise ValueError(f"{folder}/{RECORDS} has no rows: use more data.states_per_group")
    return rows


def hash_order(rows: pd.DataFrame, limit_per_group: int, seed: int = 0) -> pd.DataFrame:
    """Up to `limit_per_group` rows per group, chosen by hash order (fixed, seed-dependent)."""
    keys = [stable_fraction(seed, g, s, q) for g, s, q in zip(rows.group, rows.state_id, rows.qid)]
    ordered = rows.assign(_key=keys).sort_values(["group", "_key"])
    return ordered.groupby("group", sort=True).head(limit_per_group).drop(columns="_key").reset_index(drop=True)


@dataclass
class Example:
    """One record ready to encode: the request's state, one question, its target."""

    state: object
    question: dict
    qid: str
    target: list[float]


class RecordReader:
    """Turns record rows into examples, decoding each image file once."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self._images: dict[str, Image.Image] = {}

    def state(self, row) -> object:
        state = json.loads(row["state"])
        if row["image"] is not None and isinstance(row["image"], str):
            if row["image"] not in self._images:
                with Image.open(self.folder / row["image"]) as image:
                    self._images[row["image"]] = image.convert("RGB")
            state = {**state, "image": self._images[row["image"]]}
        return state

    def example(self, row) -> Example:
        return Example(self.state(row), json.loads(row["question"]), row["qid"], list(row["target"]))


def shuffled_choice(example: Example, rng: np.random.Generator) -> Example:
    """Shuffle a choice question's candidates together with its target (training only)."""
    question = example.question
    if question["type"] != "choice":
        return example
    order = rng.permutation(len(example.target))
    criteria = question["criteria"]
    if isinstance(criteria, dict):
        items = list(criteria.items())
        criteria = {items[i][0]: items[i][1] for i in order}
    else:
        criteria = [criteria[i] for i in order]
    return Example(example.state, {**question, "criteria": criteria}, example.qid,
                   [example.target[i] for i in order])


def encode_examples(template: Template, examples: list[Example], max_tokens: int,
                    images: list[EncodedImage] | None = None, seen: dict[str, int] | None = None):
    """Encode examples (one question each) into rows, images and a [B, K] target tensor.

    Identical images are encoded once, so their rows can share a prefix. Pass `images` and
    `seen` (image key -> index in `images`) to extend those of an earlier call: the rows then
    index the joint list, and an image already there is not preprocessed again.
    """
    rows: list[Row] = []
    images = [] if images is None else images
    seen = {} if seen is None else seen
    for example in examples:
        request = parse_request(example.state, {example.qid: example.question}, template.reserved)
        index = None
        if request.image is not None:
            key = image_key(request.image)
            if key not in seen:
                seen[key] = len(images)
                images.append(template.encode_image(request.image, key))
            index = seen[key]
        rows.extend(template.encode(request, max_tokens, index, images[index] if index is not None else None))
    width = max(len(row.markers) for row in rows)
    targets = torch.zeros((len(rows), width))
    for index, example in enumerate(examples):
        if len(example.target) != len(rows[index].markers):
            raise ValueError(f"row {example.qid!r}: {len(example.target)} target values for "
                             f"{len(rows[index].markers)} candidates")
        targets[index, : len(example.target)] = torch.tensor(example.target)
    return rows, images, targets


class GroupSampler:
    """Microbatches drawn by absolute index: one group uniformly, then rows with replacement.

    The generator is seeded by (seed, microbatch index), so a resumed run draws the same
    stream as an uninterrupted one.
    """

    def __init__(self, rows: pd.DataFrame, seed: int, rows_per_microbatch: int, group_cap: int):
        capped = hash_order(rows, group_cap, seed)
        self.groups = sorted(capped.group.unique())
        self.by_group = {group: capped[capped.group == group].reset_index(drop=True) for group in self.groups}
        self.seed = seed
        self.rows_per_microbatch = rows_per_microbatch

    def draw(self, index: int):
        """Returns (records DataFrame, numpy generator for per-row shuffles)."""
        rng = np.random.default_rng([self.seed, index])
        group = self.groups[int(rng.integers(len(self.groups)))]
        table = self.by_group[group]
        picks = rng.integers(len(table), size=self.rows_per_microbatch)
        return table.iloc[picks], rng
