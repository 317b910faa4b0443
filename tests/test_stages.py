"""Stage scripts: each runs as a module with --help and takes paths only."""

import importlib
import subprocess
import sys
from pathlib import Path

import click
import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(path.stem for path in (ROOT / "stages").glob("*.py") if path.stem != "__init__")
FLAGS = {("train", "resume")}  # boolean switches that select behaviour, not hyperparameters


def _command(name) -> click.Command:
    return importlib.import_module(f"stages.{name}").main


@pytest.mark.parametrize("name", SCRIPTS)
def test_stage_runs_alone_with_help(name):
    result = subprocess.run([sys.executable, "-m", f"stages.{name}", "--help"], cwd=ROOT,
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
