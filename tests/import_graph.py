"""The tests' own reader of the dohnuts import graph, from source (no module is executed).

The layering and DVC tests hold the library to it, so they do not trust the library's reader
(`dohnuts.pipeline.sources`, which the resume fingerprint uses); a test compares the two.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "dohnuts"


def module_name(path: Path) -> str:
    """dohnuts/a/b.py -> dohnuts.a.b; dohnuts/a/__init__.py -> dohnuts.a."""
    parts = path.resolve().relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_file(name: str) -> Path | None:
    """The file of dohnuts module `name`, or None when there is no such module."""
    base = ROOT.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def imported(path: Path) -> set[str]:
    """The dohnuts modules a file imports anywhere in it (`from a import b` is a.b when b is a
    module, else a), relative imports resolved."""
    here = module_name(path) if PACKAGE in path.resolve().parents else ""
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.partition(".")[0] == "dohnuts"}
        elif isinstance(node, ast.ImportFrom):
            source = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(anchor + ([node.module] if node.module else []))
            if source.partition(".")[0] != "dohnuts":
                continue
            found |= {f"{source}.{alias.name}" if module_file(f"{source}.{alias.name}") else source
                      for alias in node.names}
    return found


def graph() -> dict[str, set[str]]:
    """Every dohnuts module -> the dohnuts modules it imports (a package's imports of its own
    modules, for re-export, left out)."""
    return {module_name(path): {name for name in imported(path) if not name.startswith(module_name(path) + ".")}
            for path in sorted(PACKAGE.rglob("*.py"))}
