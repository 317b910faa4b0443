"""Publishing a verified checkpoint as the parent of later runs."""

from __future__ import annotations

import shutil
from pathlib import Path

from ..io import atomic_directory, kept_files, verify_manifest
from ..runtime.checkpoint import ADAPTER


def publish(source: Path, target: Path) -> None:
    """Copy a checkpoint folder after verifying it, replacing `target` atomically. A README.md
    and hidden files at the top of `target` are kept (`io.kept_files`); any other file there,
    in hidden folders too, must be a published checkpoint's (listed in its manifest), or
    nothing is written.

    Raises:
        IntegrityError: the source does not verify; FileExistsError: `target` holds other files.
    """
    verify_manifest(source, required=(ADAPTER,), complete=True)
    with atomic_directory(target, keep=kept_files(target)) as tmp:
        shutil.copytree(source, tmp, dirs_exist_ok=True)
