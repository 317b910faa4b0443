"""The package's folders are its layers: imports run one way, with no circle.

    cli -> pipeline -> serve -> measure -> data -> model -> {scoring, ops} -> foundations

The foundations (`config`, `io`, `schema`) import nothing else of dohnuts, `ops` imports
nothing outside itself, and only the stage scripts import `pipeline`.
"""

import ast
import sys

import pytest

from dohnuts.pipeline.sources import PACKAGE, ROOT, imports, module_path, modules

# Rank of each wing: an import may only go to a wing of lower rank, or stay inside its own.
# The benchmark stage drives the server, so pipeline sits above serve.
RANKS = {"config": 0, "io": 0, "schema": 0, "ops": 1, "scoring": 1, "model": 2, "data": 3, "measure": 4, "bench": 4.5,
         "serve": 5, "pipeline": 6, "cli": 7}
CLI = "cli.py"  # the console entry point: it alone may import click
FOREIGN = {"stages", "click", "dvc"}  # what the library never imports


def wing(name: str) -> str | None:
    """The wing of a module: its first component below dohnuts (None for dohnuts itself)."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else None


def upward_imports(graph: dict[str, frozenset[str]]) -> list[str]:
    """Every import that breaks the direction, as 'importer -> imported: why'."""
    broken = []
    for importer, imported in graph.items():
        source = wing(importer)
        for name in imported:
            target = wing(name)
            if source is None:  # the package's own __init__: the public API, Predictor only
                if name != "dohnuts.model.predict":
                    broken.append(f"{importer} -> {name}: dohnuts/__init__.py exposes Predictor only")
            elif target is None:
                broken.append(f"{importer} -> {name}: imports the top-level package")
            elif source == target:
                continue
            elif source == "ops":
                broken.append(f"{importer} -> {name}: ops imports nothing outside ops")
            elif RANKS[target] >= RANKS[source]:
                broken.append(f"{importer} -> {name}: {source} may not import {target}")
    return broken


def circles(graph: dict[str, frozenset[str]]) -> list[list[str]]:
    """Import cycles between modules, each once (depth-first search over the graph)."""
    found, state = [], {}

    def visit(node, path):
        state[node] = "open"
        for child in sorted(graph.get(node, ())):
            if state.get(child) == "open":
                found.append(path[path.index(child):] + [child])
            elif child not in state:
                visit(child, path + [child])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def package_graph() -> dict[str, frozenset[str]]:
    # A package importing its own modules (for re-export) is not an edge of the layering.
    return {name: frozenset(i for i in imports(module_path(name)) if not i.startswith(name + "."))
            for name in modules()}


def test_every_module_sits_in_a_known_wing():
    unknown = {wing(name) for name in modules()} - set(RANKS) - {None}
    assert not unknown, f"modules outside the known wings: {sorted(unknown)}; add the wing to RANKS and STYLE.md"


def test_imports_only_go_down_the_layers():
    assert upward_imports(package_graph()) == []


def test_no_module_imports_another_in_a_circle():
    assert circles(package_graph()) == []


def test_the_checks_catch_an_upward_import_and_a_circle():
    assert upward_imports({"dohnuts.ops.plan": frozenset({"dohnuts.config", "dohnuts.ops.kernels"})}) == [
        "dohnuts.ops.plan -> dohnuts.config: ops imports nothing outside ops"]
    assert upward_imports({"dohnuts.model.batch": frozenset({"dohnuts.data.records"})}) == [
        "dohnuts.model.batch -> dohnuts.data.records: model may not import data"]
    assert upward_imports({"dohnuts.config": frozenset({"dohnuts.io"})}) == [
        "dohnuts.config -> dohnuts.io: config may not import io"]
    assert circles({"a": frozenset({"b"}), "b": frozenset({"c"}), "c": frozenset({"a"})}) == [["a", "b", "c", "a"]]


def test_nothing_in_the_library_imports_pipeline_stages_click_or_dvc():
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            for name in names:
                allowed = {"click"} if path.relative_to(PACKAGE).as_posix() == CLI else set()
                assert name.split(".")[0] not in FOREIGN - allowed, f"{path.relative_to(ROOT)} imports {name}"
        if path.relative_to(PACKAGE).as_posix() != CLI:  # the entry point defaults to the project's params
            assert "params.yaml" not in path.read_text(), f"{path.relative_to(ROOT)} names params.yaml"
    importers = {name for name, imported in package_graph().items() if any(wing(i) == "pipeline" for i in imported)}
    assert {wing(name) for name in importers} <= {"pipeline", "cli"}


@pytest.mark.parametrize("path", sorted((ROOT / "stages").glob("*.py")), ids=lambda path: path.name)
def test_stage_scripts_are_modules_that_leave_sys_path_alone(path):
    source = path.read_text()
    assert "sys.path" not in source
    if path.name != "__init__.py":
        assert "from dohnuts.pipeline" in source


def test_no_top_level_module_is_named_after_the_standard_library():
    # dohnuts.io is imported only by its full or relative name, never bare; it is the one exception.
    top = {path.stem for path in PACKAGE.glob("*.py")} | {path.name for path in PACKAGE.iterdir() if path.is_dir()}
    assert top & set(sys.stdlib_module_names) <= {"io"}
