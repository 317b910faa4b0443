"""The public mixture: every selected source converted into validated decision states.

A converter (one per source, in the family modules) reads the source's raw files in their own
layout and yields `Converted` rows: a decision record as the user-records format has it (so the
same validation applies), the official split of the file it came from, the links that join it
to other records, and its image as the file's bytes. Official dev and test splits are pinned;
the rest is hashed, among the partitions the source does not pin, so calibration is always its
own partition. Before validation each group's hashed rows are pre-sampled in a fixed hash order
(`pool`), so tens of thousands of images never sit in memory at once; the training cap itself
is applied after isolation (`dohnuts.data.records.partition_rows`).
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from pathlib import Path

from ..image_files import ImageFile
from ..isolation import PARTITIONS, stable_fraction
from ..user_records import Problem, SourceState, validate_record
from . import clevr, documents, mail, screens, text, vision
from . import sources as catalogue
from .rows import Converted, LazyImage
from .sources import Source

Converter = Callable[[Source, dict[str, list[Path]]], Iterable[Converted]]


def converters() -> dict[str, Converter]:
    """Source name -> converter, from every family module."""
    table: dict[str, Converter] = {}
    for family in (text, documents, mail, vision, clevr, screens):
        table.update(family.CONVERTERS)
    return table


def select(groups: Iterable[str] | None) -> dict[str, Source]:
    """The sources that yield `groups` (all when None).

    Raises:
        ValueError: a group no source yields.
    """
    sources = catalogue.manifest()
    if groups is None:
        return sources
    wanted = set(groups)
    known = {group for source in sources.values() for group in source.groups}
    if wanted - known:
        raise ValueError(f"data.groups: no public source yields {sorted(wanted - known)}; the groups are "
                         f"{sorted(known)}")
    return {name: source for name, source in sources.items() if wanted & set(source.groups)}


def public_states(cache, seed: int, pool: int, groups: Iterable[str] | None = None,
                  reserved: tuple[str, ...] = (), table: dict[str, Converter] | None = None,
                  ) -> tuple[list[SourceState], list[Problem], dict]:
    """The validated states of the selected public sources.

    Args:
        cache: the cache root (`sources.cache_folders`), None for the Hugging Face defaults.
        seed: the partition seed (the pre-sampling order depends on it).
        pool: hashed rows kept per group before isolation, in hash order (0: all).
        groups: the groups to build (None: all 26).
        reserved: special-token strings no text may contain.
        table: source name -> converter (the family modules' by default).

    Returns:
        (states, problems of invalid converted rows, report: per source its origin, license and
        file digests, per group rows read and kept)

    Raises:
        MissingSources: raw files not in the local cache (all of them named), before reading any.
        SourceIntegrityError: a raw file differs from its pinned SHA-256.
    """
    sources = select(groups)
    wanted = None if groups is None else set(groups)
    found = catalogue.check_present(sources, cache)
    table = converters() if table is None else table
    states, problems, report = [], [], {"sources": {}, "groups": {}}
    for name, source in sources.items():
        digests = catalogue.verify(source, found[name])
        report["sources"][name] = {"hub": source.hub, "revision": source.revision, "license": source.license,
                                   "files": digests, "unpinned": sorted(file.path for file in source.files
                                                                        if file.sha256 is None)}
        rows = (row for row in table[name](source, found[name]) if wanted is None or row.record["group"] in wanted)
        kept, read = _pooled(rows, seed, pool)
        images: dict[str, ImageFile | str] = {}
        for row in kept:
            found_state = _validated(row, name, source, reserved, images)
            if isinstance(found_state, SourceState):
                states.append(found_state)
            else:
                problems.extend(found_state)
        for group, count in sorted(read.items()):
            report["groups"][group] = {"source": name, "rows_read": count,
                                       "rows_kept": sum(1 for state in states if state.group == group)}
    return states, problems, report


def _pooled(rows: Iterator[Converted], seed: int, pool: int) -> tuple[list[Converted], Counter]:
    """Every pinned row, and of each group's hashed rows the `pool` first in hash order."""
    kept, heaps, read = [], {}, Counter()
    for row in rows:
        group = row.record["group"]
        read[group] += 1
        if row.split in ("dev", "test") or pool <= 0:
            kept.append(row)
            continue
        heap = heaps.setdefault(group, [])
        entry = (-stable_fraction(seed, "pool", group, row.record["id"]), read[group], row)
        if len(heap) < pool:
            heapq.heappush(heap, entry)
        elif entry[0] > heap[0][0]:
            heapq.heapreplace(heap, entry)
    for heap in heaps.values():
        kept.extend(entry[2] for entry in sorted(heap, key=lambda entry: (-entry[0], entry[1])))
    return kept, read


def _image(image: bytes | LazyImage, images: dict) -> ImageFile:
    """The ImageFile of a row's image, decoded once per LazyImage key.

    Raises:
        ValueError: not an image Pillow can decode (the reason is remembered for the key).
    """
    if isinstance(image, bytes):
        return ImageFile.from_bytes(image)
    if image.key not in images:
        try:
            images[image.key] = ImageFile.from_bytes(image.load())
        except (ValueError, KeyError, OSError) as error:
            images[image.key] = f"{image.key}: {error}"
    found = images[image.key]
    if isinstance(found, str):
        raise ValueError(found)
    return found


def _validated(row: Converted, name: str, source: Source, reserved, images: dict) -> SourceState | list[Problem]:
    """The row as a SourceState (validated as a user record is), or its problems."""
    record = dict(row.record)
    where = f"{name}:{record.get('id')}"
    if row.image is not None:
        try:
            record["state"] = {**record["state"], "image": _image(row.image, images)}
        except ValueError as error:
            return [Problem(where, f"image: {error}")]
    found = validate_record(record, where, record.get("group", name), reserved)
    if not isinstance(found, SourceState):
        return [Problem(where, reason, qid) for qid, reason in found]
    pinned = row.split if row.split in ("dev", "test") else None
    among = None
    if row.split == "train" and source.pinned_splits():
        among = tuple(partition for partition in PARTITIONS if partition not in source.pinned_splits())
    return replace(found, split=pinned, among=among, links=row.links, source=f"{name}:{record['id']}")
