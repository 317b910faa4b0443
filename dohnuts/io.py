"""Atomic writes and SHA-256 manifests for everything a later stage trusts."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import tempfile
from pathlib import Path

MANIFEST = "manifest.json"


class IntegrityError(ValueError):
    """A file does not match the SHA-256 its manifest recorded, or the manifest is missing."""


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_json(path: Path, data) -> None:
    """Write JSON atomically (temporary file in the same folder, then rename)."""
    write_bytes(path, (json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode())


def write_bytes(path: Path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(handle, "wb") as stream:
            stream.write(data)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise


def write_parquet(path: Path, table) -> None:
    """Write a pandas DataFrame as Parquet atomically."""
    buffer = io.BytesIO()
    table.to_parquet(buffer, index=False)
    write_bytes(path, buffer.getvalue())


def read_json(path: Path):
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


@contextlib.contextmanager
def atomic_directory(path: Path):
    """Yield a temporary sibling folder; on success it replaces `path` whole, else it is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}."))
    try:
        yield temporary
        if path.exists():
            old = path.with_name(f".{path.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
            os.replace(temporary, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(temporary, path)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise


def write_manifest(folder: Path, extra: dict | None = None) -> dict:
    """Record the SHA-256 and size of every file under `folder` (the manifest excluded)."""
    folder = Path(folder)
    files = {
        str(path.relative_to(folder)): {"sha256": sha256_file(path), "bytes": path.stat().st_size}
        for path in sorted(folder.rglob("*"))
        if path.is_file() and path.name != MANIFEST
    }
    manifest = {"files": files, **(extra or {})}
    write_json(folder / MANIFEST, manifest)
    return manifest


def verify_manifest(folder: Path, required: tuple[str, ...] = ()) -> dict:
    """Check every file listed in `folder`'s manifest; return the manifest.

    Raises:
        IntegrityError: the manifest or a required file is missing, or a hash differs.
    """
    folder = Path(folder)
    if not (folder / MANIFEST).is_file():
        raise IntegrityError(f"{folder} has no {MANIFEST}: not a checkpoint written by dohnuts")
    manifest = read_json(folder / MANIFEST)
    for name in required:
        if name not in manifest.get("files", {}):
            raise IntegrityError(f"{folder}/{MANIFEST} does not list required file {name!r}")
    for name, entry in manifest.get("files", {}).items():
        path = folder / name
        if not path.is_file():
            raise IntegrityError(f"{path} is listed in the manifest but missing")
        actual = sha256_file(path)
        if actual != entry["sha256"]:
            raise IntegrityError(f"{path} has SHA-256 {actual}, manifest says {entry['sha256']}")
    return manifest
