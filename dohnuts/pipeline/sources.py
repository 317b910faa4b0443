"""The import graph of the dohnuts package, read from its source (no module is executed).

Every `import` and `from ... import`, at module level or inside a function, resolved to dotted
dohnuts module names. The resume fingerprint of `train` hashes the modules it executes; the
layering test and the DVC-dependency test read the same graph.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]  # the dohnuts folder
ROOT = PACKAGE.parent


def module_path(name: str) -> Path:
    """dohnuts.a.b -> dohnuts/a/b.py, or dohnuts/a/b/__init__.py for a package."""
    base = ROOT.joinpath(*name.split("."))
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def module_name(path: Path) -> str:
    """dohnuts/a/b.py -> dohnuts.a.b; dohnuts/a/__init__.py -> dohnuts.a."""
    parts = Path(path).resolve().relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> list[str]:
    """Every module and package of dohnuts."""
    return sorted(module_name(path) for path in PACKAGE.rglob("*.py"))


def _exists(name: str) -> bool:
    return module_path(name).is_file()


def _nodes(tree: ast.Module, lazy: bool):
    """Every node of a module; without `lazy`, not those of a module-level `__getattr__`
    (PEP 562: it imports only when the attribute is first read)."""
    for top in tree.body:
        if not lazy and isinstance(top, ast.FunctionDef) and top.name == "__getattr__":
            continue
        yield from ast.walk(top)


@cache
def imports(path: Path, lazy: bool = True) -> frozenset[str]:
    """The dohnuts modules a file imports, by full dotted name (`from a import b` counts a.b
    when b is a module, else a); `lazy`: also those a module-level `__getattr__` imports."""
    path = Path(path).resolve()
    here = module_name(path) if PACKAGE in path.parents else None
    package = None
    if here is not None:
        package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found = set()
    for node in _nodes(ast.parse(path.read_text()), lazy):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.split(".")[0] == "dohnuts")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                source = ".".join(anchor + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != "dohnuts":
                continue
            for alias in node.names:
                child = f"{source}.{alias.name}"
                found.add(child if _exists(child) else source)
    return frozenset(found)


def loaded(name: str) -> list[str]:
    """The modules importing `name` executes: its packages' __init__ files, then itself."""
    parts = name.split(".")
    return [".".join(parts[:end]) for end in range(1, len(parts) + 1)]


def closure(path: Path) -> set[str]:
    """Every dohnuts module (packages' __init__ included) that running `path` executes (lazy
    attributes are not followed: `dohnuts.Predictor` is only loaded where it is read)."""
    todo, seen = list(imports(path, lazy=False)), set()
    while todo:
        for name in loaded(todo.pop()):
            if name not in seen:
                seen.add(name)
                todo.extend(imports(module_path(name), lazy=False))
    return seen


def relative_file(name: str) -> str:
    """A module's file relative to the folder holding dohnuts (the repository root), as dvc.yaml
    names it."""
    return module_path(name).relative_to(ROOT).as_posix()


def executed_by(module: str) -> list[str]:
    """The dohnuts modules running `module` executes, itself included, sorted."""
    return sorted(closure(module_path(module)) | set(loaded(module)))
