"""Reading raw files in the layouts public sources use: Parquet (with Hugging Face features),
JSON, and members of zip and tar archives."""

from __future__ import annotations

import json
import tarfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

BATCH_ROWS = 1024


def parquet_rows(path: Path, columns: list[str] | None = None) -> Iterator[dict]:
    """The rows of a Parquet file as dicts, a batch at a time (an image column stays a
    {"bytes", "path"} struct: nothing is decoded here)."""
    import pyarrow.parquet as pq

    with pq.ParquetFile(path) as handle:
        for batch in handle.iter_batches(batch_size=BATCH_ROWS, columns=columns):
            yield from batch.to_pylist()


def class_names(path: Path, column: str) -> list[str]:
    """The label names of a `ClassLabel` column, from the Hugging Face features stored in the
    Parquet schema (the Hub writes labels as integers and their names there).

    Raises:
        ValueError: the column is not a ClassLabel.
    """
    import pyarrow.parquet as pq
    from datasets import ClassLabel, Features

    features = Features.from_arrow_schema(pq.read_schema(path))
    feature = features.get(column)
    if not isinstance(feature, ClassLabel):
        raise ValueError(f"{path}: column {column!r} is not a ClassLabel in its Hugging Face features "
                         f"(found {type(feature).__name__})")
    return list(feature.names)


def image_bytes(cell) -> bytes | None:
    """The encoded bytes of a Hugging Face Image cell ({"bytes", "path"}), or None."""
    if cell is None:
        return None
    if isinstance(cell, dict):
        return cell.get("bytes")
    if isinstance(cell, bytes):
        return cell
    raise ValueError(f"an image cell is a {{bytes, path}} struct, got {type(cell).__name__}")


def zip_json(archive: Path, member: str):
    """A JSON member of a zip archive, decoded."""
    with zipfile.ZipFile(archive) as handle, handle.open(member) as stream:
        return json.load(stream)


def zip_members(archive: Path) -> list[str]:
    with zipfile.ZipFile(archive) as handle:
        return handle.namelist()


def tar_members(archive: Path, wanted) -> Iterator[tuple[str, bytes]]:
    """(name, bytes) of each regular member of a tar archive (any compression) for which
    `wanted(name)` holds, in archive order: one pass, as compressed archives allow."""
    with tarfile.open(archive, "r:*") as handle:
        for member in handle:
            if member.isfile() and wanted(member.name):
                stream = handle.extractfile(member)
                if stream is not None:
                    yield member.name, stream.read()
