"""Publishing a verified checkpoint as the parent of later runs."""

from __future__ import annotations

import shutil
from pathlib import Path

from ..io import atomic_directory, verify_manifest
from ..runtime.checkpoint import ADAPTER


def publish(source: Path, target: Path) -> None:
    """Copy a checkpoint folder after verifying it, replacing `target` atomically. A README.md
    and dotfiles in `target` are kept; any other file there must be a published checkpoint's
    (listed in its manifest), or nothing is written.

    Raises:
        IntegrityError: the source does not verify; FileExistsError: `target` holds other files.
    """
    verify_manifest(source, required=(ADAPTER,), complete=True)
    keep = [path for path in Path(target).glob("*") if path.name.startswith(".") or path.name == "README.md"]
    with atomic_directory(target, ignore=("README.md",)) as tmp:
        for path in keep:
            shutil.copy2(path, tmp / path.name)
        shutil.copytree(source, tmp, dirs_exist_ok=True)
