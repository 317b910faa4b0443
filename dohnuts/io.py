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


def write_json_files(folder: Path, files: dict[str, object]) -> None:
    """Write each `name -> data` as `folder/name.json`, each atomically (plot data, for one)."""
    for name, data in files.items():
        write_json(Path(folder) / f"{name}.json", data)


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


def foreign_files(folder: Path, keep: tuple[str, ...] = ()) -> list[str]:
    """Files of an existing `folder` that dohnuts did not write: every file but its manifest,
    those the manifest lists and the top-level names in `keep`, hidden ones and those in hidden
    folders too. Empty when the folder is missing."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    present = sorted(str(path.relative_to(folder)) for path in folder.rglob("*")
                     if path.is_file() and path.name != MANIFEST and str(path.relative_to(folder)) not in keep)
    if (folder / MANIFEST).is_file():
        listed = set(read_json(folder / MANIFEST).get("files", {}))
        return [name for name in present if name not in listed]
    return present


def kept_files(folder: Path) -> tuple[str, ...]:
    """The top-level files of `folder` a published checkpoint keeps across a replacement and its
    verification: a README.md and hidden files (.gitattributes and the like)."""
    folder = Path(folder)
    if not folder.is_dir():
        return ()
    return tuple(sorted(path.name for path in folder.iterdir()
                        if path.is_file() and (path.name == "README.md" or path.name.startswith("."))))


@contextlib.contextmanager
def atomic_directory(path: Path, keep: tuple[str, ...] = ()):
    """Yield a temporary sibling folder; on success it replaces `path` whole, else it is removed.

    Nothing is deleted that dohnuts did not write: an existing `path` holding files its manifest
    does not list (`foreign_files`) is refused before anything is written, unless they are
    top-level files named in `keep`, which are copied into the new folder first.

    Raises:
        FileExistsError: `path` holds files dohnuts did not write.
    """
    path = Path(path)
    foreign = foreign_files(path, keep)
    if foreign:
        raise FileExistsError(f"{path} holds files dohnuts did not write ({', '.join(foreign[:5])}"
                              f"{', ...' if len(foreign) > 5 else ''}): refusing to replace it; "
                              f"move them away or choose another folder")
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}."))
    try:
        for name in keep:
            if (path / name).is_file():
                shutil.copy2(path / name, temporary / name)
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


def verify_manifest(folder: Path, required: tuple[str, ...] = (), complete: bool = False,
                    unread: tuple[str, ...] = ()) -> dict:
    """Check every file listed in `folder`'s manifest; return the manifest.

    Args:
        complete: also refuse a file the manifest does not list (a README.md and dotfiles
            aside), so nothing unverified sits beside what is loaded.
        unread: name suffixes of files the caller will not read (a server's front end and the
            weights): they must exist, but are not hashed.

    Raises:
        IntegrityError: the manifest or a required file is missing, a hash differs, or (with
            `complete`) a file is not listed.
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
        if unread and name.endswith(unread):
            continue
        actual = sha256_file(path)
        if actual != entry["sha256"]:
            raise IntegrityError(f"{path} has SHA-256 {actual}, manifest says {entry['sha256']}")
    unlisted = foreign_files(folder, kept_files(folder)) if complete else []
    if unlisted:
        raise IntegrityError(f"{folder} holds files its {MANIFEST} does not list: {', '.join(unlisted[:5])}")
    return manifest
