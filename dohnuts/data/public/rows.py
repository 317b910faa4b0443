"""The row every public converter yields."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class LazyImage:
    """An image read only for the rows kept (`load` returns the file's bytes); rows showing one
    image share its `key` (unique within the source), so it is decoded once."""

    key: str
    load: Callable[[], bytes]


@dataclass(frozen=True)
class Converted:
    """One converted source row. record: id, group, state, questions and labels in the
    decision-record format (`dohnuts.data.user_records`), the state without its image; split:
    the official split of its file (train, dev, test) or None; links: ids that join it to other
    records ("photo:coco:397133"); image: the image file's bytes, a LazyImage, or None."""

    record: dict
    split: str | None = None
    links: tuple[str, ...] = ()
    image: bytes | LazyImage | None = None
