"""Publishing a verified checkpoint as the parent of later runs."""

from __future__ import annotations

import shutil
from pathlib import Path

from ..io import atomic_directory, verify_manifest
from ..model.adapters import ADAPTER


def publish(source: Path, target: Path) -> None:
    """Copy a checkpoint folder after verifying it; keep files already in `target` that the
    checkpoint does not have (such as a README), replace the rest atomically."""
    verify_manifest(source, required=(ADAPTER,))
    keep = [path for path in Path(target).glob("*") if path.name.startswith(".") or path.name == "README.md"]
    with atomic_directory(target) as tmp:
        for path in keep:
            shutil.copy2(path, tmp / path.name)
        shutil.copytree(source, tmp, dirs_exist_ok=True)
