"""Small raw files in each public source's own layout, written where the local cache keeps them."""

from __future__ import annotations

import io
import json
from pathlib import Path

from PIL import Image

from dohnuts.data.public.sources import RawFile, Source, cache_folders

FAKE_COMMIT = "0123456789abcdef0123456789abcdef01234567"


def local_path(cache: Path, source: Source, file: RawFile, name: str | None = None) -> Path:
    """Where `file` of `source` sits in the cache rooted at `cache` (for a Hub file, inside the
    snapshot of its revision; a branch revision gets a ref to a made-up commit, as
    huggingface_hub writes it). `name` replaces a pattern with one concrete shard name."""
    hub, files = cache_folders(cache)
    if file.url is not None:
        path = files / source.name / file.path
    else:
        repo = hub / ("datasets--" + source.hub.replace("/", "--"))
        revision = source.revision or "main"
        commit = revision if len(revision) == 40 and all(c in "0123456789abcdef" for c in revision) else FAKE_COMMIT
        if commit != revision:
            (repo / "refs" / revision).parent.mkdir(parents=True, exist_ok=True)
            (repo / "refs" / revision).write_text(commit)
        path = repo / "snapshots" / commit / (name or file.path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def write_hf_parquet(path: Path, columns: dict, features: dict) -> None:
    """A Parquet file as the Hub's converter writes it: Hugging Face features in the schema
    metadata (label names of ClassLabel columns, Image structs {bytes, path})."""
    from datasets import Dataset, Features

    Dataset.from_dict(columns, features=Features(features)).to_parquet(str(path))


def png(colour, size=(32, 24)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, format="PNG")
    return buffer.getvalue()


def jpeg(colour, size=(40, 30), quality=90) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue()


def write_json(path: Path, data) -> None:
    path.write_text(json.dumps(data))
