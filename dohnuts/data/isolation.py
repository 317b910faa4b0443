"""Partitions by content: states that share a text, an image or a source id land in one partition.

A held-out metric means something only if no row of it was seen in training. Hashing a state's
index does not ensure that: two states with the same text (or the same pixels, or the same
source record) could land on both sides. Here every state is a node. States are joined
(union-find, across all groups) by what identifies them: a normalised state text (beside an
image, only a text of at least IDENTIFYING characters: a shared caption over different images
joins nothing, a shared document with different photos still joins them), the SHA-256 of their
decoded pixels, a source id, or a link (an id that a source knows ties records together: the
photo of a collection, such as a COCO image two sources store with different bytes, or one
utterance in two languages). Each joined component then goes whole into one partition, chosen
by a salted hash of its content. States pinned to a partition (a source's official split) win:
a component takes the pinned partition of highest priority (test > dev > calibration > train),
and a member pinned elsewhere is dropped, counted by reason.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from collections import Counter
from dataclasses import dataclass

PARTITIONS = ("train", "dev", "calibration", "test")
PRIORITY = ("test", "dev", "calibration", "train")  # a joined component keeps the first present
# The normalised characters from which a text beside an image identifies its state on its own
# (about 40 words): a caption or a form's label is shorter, a document longer.
IDENTIFYING = 256
_SPACE = re.compile(r"\s+")


def normalise_text(text: str | None) -> str | None:
    """The form under which two state texts count as the same: Unicode NFKC, case folded,
    whitespace runs collapsed to one space. None for a text with nothing in it ("", or the
    "{}" of a state that holds only an image), which joins nothing."""
    if text is None:
        return None
    normal = _SPACE.sub(" ", unicodedata.normalize("NFKC", text).casefold()).strip()
    return None if normal in ("", "{}") else normal


def identifying_text(text: str | None, has_image: bool) -> str | None:
    """The normalised text a state is joined by, or None: any text of a state without an image,
    a text of at least IDENTIFYING characters beside one."""
    normal = normalise_text(text)
    if normal is None or (has_image and len(normal) < IDENTIFYING):
        return None
    return normal


def stable_fraction(*parts) -> float:
    """A number in [0, 1) from a SHA-256 of the parts: the same on every machine and run."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def hashed_partition(seed: int, key: str, fractions: dict, among: tuple[str, ...] = PARTITIONS) -> str:
    """The partition of `key` by a salted hash, in proportion to `fractions`, among the
    partitions `among` (all of them by default)."""
    names = [name for name in PARTITIONS if name in among]
    total = sum(fractions[name] for name in names)
    point, edge = stable_fraction(seed, key) * total, 0.0
    for name in names:
        edge += fractions[name]
        if point < edge:
            return name
    return names[-1]


@dataclass(frozen=True)
class Unit:
    """One state to place. text: its rendered text (normalised here); images: the BLAKE3 digest of each
    of its images' decoded pixels (`dohnuts.inputs.pixels.image_key`); source: an id shared by
    states of one source record (None: none); split: a pinned partition (None: by hash); links: further ids
    that join states ("photo:coco:397133", "massive:1021"); among: the
    partitions a hash may choose (None: all; a source whose official dev and test splits are
    pinned hashes its training rows among train and calibration only)."""

    group: str
    text: str | None
    images: tuple[str, ...] = ()
    source: str | None = None
    split: str | None = None
    links: tuple[str, ...] = ()
    among: tuple[str, ...] | None = None

    def __post_init__(self):
        if self.split is not None and self.split not in PARTITIONS:
            raise ValueError(f"split must be one of {PARTITIONS} or null, got {self.split!r}")
        if self.among is not None and not ({"train", "calibration"} <= set(self.among) <= set(PARTITIONS)):
            raise ValueError(f"among must hold train and calibration, within {PARTITIONS}, got {self.among!r}")

    def join_keys(self) -> list[tuple[str, str]]:
        """What this state is joined by."""
        found = []
        text = identifying_text(self.text, bool(self.images))
        if text is not None:
            found.append(("text", text))
        found.extend(("image", image) for image in self.images)
        if self.source is not None:
            found.append(("source", self.source))
        found.extend(("link", link) for link in self.links)
        return found

    def content(self) -> str:
        """A digest of the state's content (not of its position in the source)."""
        parts = [normalise_text(self.text) or "", *(self.images or ("",)), self.source or "", *self.links]
        return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def components(units: list[Unit]) -> list[int]:
    """The component of every unit (the index of its representative): units sharing any key are
    joined, transitively."""
    parent = list(range(len(units)))

    def root(index: int) -> int:
        while parent[index] != index:
            parent[index] = parent[parent[index]]
            index = parent[index]
        return index

    owner: dict[tuple[str, str], int] = {}
    for index, unit in enumerate(units):
        for key in unit.join_keys():
            if key in owner:
                a, b = root(owner[key]), root(index)
                if a != b:
                    parent[max(a, b)] = min(a, b)
            else:
                owner[key] = index
    return [root(index) for index in range(len(units))]


def assign(units: list[Unit], seed: int, fractions: dict) -> tuple[list[str | None], dict]:
    """The partition of every unit (None: dropped) and a report of what isolation did.

    A component's partition is its highest-priority pinned split, else a salted hash of the
    smallest content digest among its members (so it does not depend on the order of states),
    among the partitions every member allows.

    Returns:
        (partitions, {"states", "components", "joined_states" (states sharing a component with
        another), "drops": {reason: {group: count}}})
    """
    roots = components(units)
    members: dict[int, list[int]] = {}
    for index, root in enumerate(roots):
        members.setdefault(root, []).append(index)
    partitions: list[str | None] = [None] * len(units)
    drops: dict[str, Counter] = {}
    for indices in members.values():
        pinned = {units[i].split for i in indices if units[i].split is not None}
        if pinned:
            chosen = next(name for name in PRIORITY if name in pinned)
        else:
            among = [name for name in PARTITIONS
                     if all(units[i].among is None or name in units[i].among for i in indices)]
            chosen = hashed_partition(seed, min(units[i].content() for i in indices), fractions, tuple(among))
        for i in indices:
            if units[i].split is not None and units[i].split != chosen:
                drops.setdefault("pinned_split_conflict", Counter())[units[i].group] += 1
            else:
                partitions[i] = chosen
    report = {"states": len(units), "components": len(members),
              "joined_states": sum(len(indices) for indices in members.values() if len(indices) > 1),
              "drops": {reason: dict(sorted(counts.items())) for reason, counts in sorted(drops.items())}}
    return partitions, report


def cross_partition(rows) -> dict:
    """How many identifying state texts (`identifying_text`) and image pixel digests occur in
    more than one partition of written rows, given as (partition, the state's text as `Unit`
    takes it, its images' digests): 0 and 0 when isolation held."""
    texts: dict[str, set] = {}
    images: dict[str, set] = {}
    for partition, state, keys in rows:
        text = identifying_text(state, bool(keys))
        if text is not None:
            texts.setdefault(text, set()).add(partition)
        for key in keys:
            images.setdefault(key, set()).add(partition)
    return {"texts": sum(len(seen) > 1 for seen in texts.values()),
            "images": sum(len(seen) > 1 for seen in images.values())}
