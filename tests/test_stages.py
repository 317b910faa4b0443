"""Stage scripts: each runs alone with --help, takes paths only; the library never imports them."""

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import click
import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(path.stem for path in (ROOT / "stages").glob("*.py"))
FLAGS = {("train", "resume")}  # boolean switches that select behaviour, not hyperparameters


def _command(name) -> click.Command:
    spec = importlib.util.spec_from_file_location(f"stage_{name}", ROOT / "stages" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


@pytest.mark.parametrize("name", SCRIPTS)
def test_stage_runs_alone_with_help(name):
    result = subprocess.run([sys.executable, f"stages/{name}.py", "--help"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "Usage:" in result.stdout and "--help" in result.stdout


@pytest.mark.parametrize("name", SCRIPTS)
def test_stage_options_are_paths_only(name):
    for option in _command(name).params:
        if (name, option.name) in FLAGS:
            assert option.is_flag
            continue
        assert isinstance(option.type, click.Path), f"{name} --{option.name} is not a path"


def test_library_never_imports_stages_click_or_dvc():
    for path in (ROOT / "dohnuts").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            for name in names:
                assert name.split(".")[0] not in {"stages", "click", "dvc"}, f"{path.name} imports {name}"
        assert "params.yaml" not in path.read_text(), f"{path.name} names params.yaml"
