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

from ..inputs.pixels import image_key
from ..inputs.template import EncodedImage, Row, Template
from ..io import atomic_directory, verify_manifest, write_bytes, write_manifest, write_parquet
from ..schema import parse_request, replaced_images
from .image_files import ImageFile, replaced, shown_text
from .isolation import PARTITIONS, Unit, assign, cross_partition, stable_fraction

RECORDS = "records.parquet"


def write_partition(records: list[dict], images: dict[str, bytes], out: Path, partition: str,
                    isolation: dict | None = None) -> dict:
    """Write one partition folder atomically: records.parquet, images/*.png and a manifest.

    Returns:
        Row, state and per-group row counts.
    """
    table = pd.DataFrame.from_records(records)
    counts = {"rows": len(table), "states": int(table.state_id.nunique()) if len(table) else 0,
              "groups": {g: int(n) for g, n in table.group.value_counts().sort_index().items()} if len(table) else {}}
    with atomic_directory(out) as tmp:
        for name in sorted({name for record in records for name in record["images"]}):
            write_bytes(tmp / name, images[name])
        write_parquet(tmp / RECORDS, table)
        write_manifest(tmp, {"partition": partition, "counts": counts, "isolation": isolation})
    return counts


def _encoded(state) -> tuple[object, str, tuple[str, ...], list[bytes], tuple[str, ...]]:
    """(the state with each image's file name in its place, the text isolation identifies it by,
    its images' file names and bytes, and their pixel digests), images in the order of the state's
    text (`image_files.shown_text`)."""
    value = state.state
    if isinstance(value, str):
        return value, value, (), [], ()
    names, datas, keys = [], [], []

    def stored(image) -> str:
        if isinstance(image, ImageFile):  # kept as the source's own bytes
            name, data, key = image.file_name, image.data, image.key
        else:
            buffer = io.BytesIO()
            image.save(buffer, format="PNG")
            data = buffer.getvalue()
            name, key = f"images/{hashlib.sha256(data).hexdigest()[:32]}.png", image_key(image)
        names.append(name)
        datas.append(data)
        keys.append(key)
        return name

    return replaced(value, stored), shown_text(value), tuple(names), datas, tuple(keys)


def partition_rows(states, seed: int, fractions: dict, exclude=None,
                   train_cap: int | None = None) -> tuple[dict, dict, dict]:
    """The rows of every partition, one per question, assigned by content
    (`dohnuts.data.isolation`): states sharing a normalised text, an image's pixels or a source
    id land in one partition, so no text or image sits in two. A row repeating an earlier one
    exactly (group, state, image, question and target) is dropped, and so is a row for which
    `exclude(state, qid, partition)` gives a reason (a token budget); beyond `train_cap` train
    rows of a group, the rest are dropped in hash order (`hash_order`, so training's own cap
    then keeps them all); every drop is counted.

    Returns:
        ({partition: rows}, {image file: its bytes}, the isolation report: what it joined and
        dropped, by reason, and the texts and images found in more than one partition's rows)
    """
    encoded = [_encoded(state) for state in states]
    units = [Unit(state.group, text, keys, getattr(state, "source", None), getattr(state, "split", None),
                  getattr(state, "links", ()), getattr(state, "among", None))
             for state, (_, text, _, _, keys) in zip(states, encoded)]
    placed, report = assign(units, seed, fractions)
    records: dict[str, list[dict]] = {name: [] for name in PARTITIONS}
    images: dict[str, bytes] = {}
    seen: set[tuple] = set()
    drops: dict[str, dict[str, int]] = {}
    shown = {}  # id of a written row -> the text isolation identified its state by
    for state, (value, identified, names, datas, keys), partition in zip(states, encoded, placed):
        if partition is None:
            continue
        text = json.dumps(value, ensure_ascii=False)
        for qid, question in state.questions.items():
            row = {"group": state.group, "state_id": state.state_id, "partition": partition, "state": text,
                   "images": list(names), "image_keys": list(keys), "qid": qid,
                   "question": json.dumps(question, ensure_ascii=False),
                   "target": [float(x) for x in state.targets[qid]]}
            identity = (state.group, text, keys, qid, row["question"], tuple(row["target"]))
            reason = "exact_duplicate_rows" if identity in seen else exclude and exclude(state, qid, partition)
            if reason:
                counts = drops.setdefault(reason, {})
                counts[state.group] = counts.get(state.group, 0) + 1
                continue
            seen.add(identity)
            records[partition].append(row)
            shown[id(row)] = identified
            images.update(zip(names, datas))
    if train_cap is not None:
        records["train"] = _capped(records["train"], seed, train_cap, drops.setdefault("train_cap", {}))
        if not drops["train_cap"]:
            del drops["train_cap"]
        used = {name for rows in records.values() for row in rows for name in row["images"]}
        images = {name: data for name, data in images.items() if name in used}
    for reason, counts in drops.items():
        report["drops"][reason] = dict(sorted(counts.items()))
    report["cross_partition"] = cross_partition((row["partition"], shown[id(row)], tuple(row["image_keys"]))
                                                for rows in records.values() for row in rows)
    return records, images, report


def _capped(rows: list[dict], seed: int, cap: int, dropped: dict) -> list[dict]:
    """Up to `cap` rows per group, the first in the hash order of `hash_order`."""
    keyed = sorted((stable_fraction(seed, row["group"], row["state_id"], row["qid"]), index)
                   for index, row in enumerate(rows))
    kept, taken = set(), {}
    for _, index in keyed:
        group = rows[index]["group"]
        if taken.get(group, 0) < cap:
            taken[group] = taken.get(group, 0) + 1
            kept.add(index)
        else:
            dropped[group] = dropped.get(group, 0) + 1
    return [row for index, row in enumerate(rows) if index in kept]


def write_mixture(states, root: Path, seed: int, fractions: dict, exclude=None) -> dict:
    """Write states, one row per question, into one folder per partition under `root`
    (`partition_rows` assigns them). Each partition has its own folder so the pipeline graph
    shows which stage reads which; every partition's manifest carries the isolation report.

    Returns:
        {"partitions": {partition: row, state and per-group row counts}, "isolation": the
        isolation report of `partition_rows`}
    """
    records, images, report = partition_rows(states, seed, fractions, exclude)
    counts = {name: write_partition(records[name], images, Path(root) / name, name, report) for name in PARTITIONS}
    return {"partitions": counts, "isolation": report}


def load_records(folder: Path) -> pd.DataFrame:
    """The rows of one partition folder (SHA-256 verified), in a stable order.

    Raises:
        IntegrityError: a file differs from the manifest; ValueError: no rows.
    """
    verify_manifest(folder, required=(RECORDS,))
    rows = pd.read_parquet(Path(folder) / RECORDS).reset_index(drop=True)
    if "images" not in rows.columns:
        raise ValueError(f"{folder}/{RECORDS} was written before states held several images (it has no images "
                         f"column): run the prepare stage again")
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
        """The state of a row (a mapping with "state" and "images"), each image decoded in the
        place its file name holds."""
        state = json.loads(row["state"])
        names = set(row["images"] if row["images"] is not None else ())
        if not names:
            return state
        for name in names - self._images.keys():
            with Image.open(self.folder / name) as image:
                self._images[name] = image.convert("RGB")
        return with_images(state, names, self._images)

    def example(self, row) -> Example:
        return Example(self.state(row), json.loads(row["question"]), row["qid"], list(row["target"]))


def with_images(value, names: set[str], decoded: dict):
    """A copy of a stored state with each string that names one of its image files replaced by
    the decoded image (`_encoded` wrote the names in the images' places)."""
    return replaced_images(value, decoded.__getitem__, lambda item: isinstance(item, str) and item in names)


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
        request = parse_request(example.state, {example.qid: example.question}, template.reserved,
                                template.max_images)
        indices = template.encode_images(request, images, seen)
        rows.extend(template.encode(request, max_tokens, indices, images))
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
