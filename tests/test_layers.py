"""The package's wings are its layers: imports run one way, never sideways, with no circle.

    cli -> {pipeline | serve | bench} -> runtime -> data -> model -> inputs -> {scoring | ops} -> foundations

Wings in one layer are peers and do not import each other. The foundations (`config`, `io`,
`schema`) import nothing else of dohnuts, `ops` imports nothing outside itself, and only `cli`
imports `pipeline` (the stage scripts, outside the package, import it too).
"""

import ast
import sys

import pytest
from import_graph import PACKAGE, ROOT, graph, imported, module_name

from dohnuts.pipeline import sources

# Top to bottom; a module may import its own wing or a wing of a lower layer.
LAYERS = (("cli",), ("pipeline", "serve", "bench"), ("runtime",), ("data",), ("model",), ("inputs",),
          ("scoring", "ops"), ("config", "io", "schema"))
RANK = {wing: rank for rank, layer in enumerate(LAYERS) for wing in layer}
CLI = "cli.py"  # the console entry point: it alone may import click
FOREIGN = {"stages", "click", "dvc"}  # what the library never imports


def diagram() -> str:
    """The layer graph as the README and this module's docstring draw it."""
    return " -> ".join(layer[0] if len(layer) == 1 else "{" + " | ".join(layer) + "}" for layer in LAYERS[:-1]) + (
        " -> foundations")


def wing(name: str) -> str | None:
    """The wing of a module: its first component below dohnuts (None for dohnuts itself)."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else None


def broken_imports(imports: dict[str, set[str]]) -> list[str]:
    """Every import that breaks the layering, as 'importer -> imported: why'."""
    broken = []
    for importer, names in sorted(imports.items()):
        source = wing(importer)
        for name in sorted(names):
            target = wing(name)
            if source is None:  # the package's own __init__: the public API, Predictor only
                if name != "dohnuts.runtime.predict":
                    broken.append(f"{importer} -> {name}: dohnuts/__init__.py exposes Predictor only")
            elif target is None:
                broken.append(f"{importer} -> {name}: imports the top-level package")
            elif source == target:
                continue
            elif source == "ops":
                broken.append(f"{importer} -> {name}: ops imports nothing outside ops")
            elif RANK[target] == RANK[source]:
                broken.append(f"{importer} -> {name}: {source} and {target} are peers (a sideways import)")
            elif RANK[target] < RANK[source]:
                broken.append(f"{importer} -> {name}: {source} may not import {target} (an upward import)")
    return broken


def circles(imports: dict[str, set[str]]) -> list[list[str]]:
    """Import cycles between modules, each once (depth-first search over the graph)."""
    found, state = [], {}

    def visit(node, path):
        state[node] = "open"
        for child in sorted(imports.get(node, ())):
            if state.get(child) == "open":
                found.append(path[path.index(child):] + [child])
            elif child not in state:
                visit(child, path + [child])
        state[node] = "done"

    for node in sorted(imports):
        if node not in state:
            visit(node, [node])
    return found


def test_every_module_sits_in_a_known_wing():
    unknown = {wing(name) for name in graph()} - set(RANK) - {None}
    assert not unknown, f"modules outside the known wings: {sorted(unknown)}; add the wing to LAYERS and STYLE.md"


def test_imports_only_go_down_the_layers():
    assert broken_imports(graph()) == []


def test_no_module_imports_another_in_a_circle():
    assert circles(graph()) == []


def test_the_checks_catch_upward_and_sideways_imports_and_a_circle():
    assert broken_imports({"dohnuts.ops.plan": {"dohnuts.config", "dohnuts.ops.kernels"}}) == [
        "dohnuts.ops.plan -> dohnuts.config: ops imports nothing outside ops"]
    assert broken_imports({"dohnuts.inputs.batch": {"dohnuts.data.records"}}) == [
        "dohnuts.inputs.batch -> dohnuts.data.records: inputs may not import data (an upward import)"]
    assert broken_imports({"dohnuts.serve.app": {"dohnuts.bench.traffic", "dohnuts.runtime.predict"}}) == [
        "dohnuts.serve.app -> dohnuts.bench.traffic: serve and bench are peers (a sideways import)"]
    assert broken_imports({"dohnuts.config": {"dohnuts.io"}}) == [
        "dohnuts.config -> dohnuts.io: config and io are peers (a sideways import)"]
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]


def test_the_library_reader_agrees_with_the_tests_reader():
    # The resume fingerprint hashes what `pipeline.sources` says training runs.
    for path in sorted(PACKAGE.rglob("*.py")):
        assert set(sources.imports(path)) == imported(path), module_name(path)


def test_the_readme_and_this_module_draw_the_same_layers():
    assert diagram() in (ROOT / "README.md").read_text()
    assert diagram() in __doc__


def test_nothing_in_the_library_imports_stages_click_or_dvc_and_only_cli_imports_pipeline():
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
    importers = {name for name, names in graph().items() if any(wing(i) == "pipeline" for i in names)}
    assert {wing(name) for name in importers} <= {"pipeline", "cli"}


@pytest.mark.parametrize("path", sorted((ROOT / "stages").glob("*.py")), ids=lambda path: path.name)
def test_stage_scripts_are_modules_that_leave_sys_path_alone(path):
    source = path.read_text()
    assert "sys.path" not in source
    if path.name != "__init__.py":  # each calls its stage's function: a pipeline module or the bench's stage
        assert f"from dohnuts.pipeline.{path.stem} import" in source or (
            path.stem == "benchmark" and "from dohnuts.bench.stage import" in source)


def test_no_top_level_module_is_named_after_the_standard_library():
    # dohnuts.io is imported only by its full or relative name, never bare; it is the one exception.
    top = {path.stem for path in PACKAGE.glob("*.py")} | {path.name for path in PACKAGE.iterdir() if path.is_dir()}
    assert top & set(sys.stdlib_module_names) <= {"io"}
