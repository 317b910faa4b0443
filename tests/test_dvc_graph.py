"""The pipeline definition enforces the science and declares everything each stage uses."""

import re
import shlex
from pathlib import Path

import pytest
import yaml

from dohnuts.pipeline.sources import closure, relative_file

ROOT = Path(__file__).resolve().parents[1]
DEFINITION = yaml.safe_load((ROOT / "dvc.yaml").read_text())
PIPELINE = DEFINITION["stages"]
STAGES = list(PIPELINE)


def _paths(entries):
    return {next(iter(entry)) if isinstance(entry, dict) else entry for entry in entries or []}


def _outs(stage):
    spec = PIPELINE[stage]
    return _paths(spec.get("outs")) | _paths(spec.get("metrics")) | _paths(spec.get("plots"))


def _consumers(path):
    """Stages with a dependency on `path` or on anything inside it."""
    return {name for name, spec in PIPELINE.items()
            if any(dep == path or dep.startswith(path + "/") for dep in spec.get("deps", []))}


def _upstream(stage, seen=None):
    """Every stage `stage` depends on, directly or not."""
    seen = set() if seen is None else seen
    for dep in PIPELINE[stage].get("deps", []):
        for producer in STAGES:
            if any(dep == out or dep.startswith(out + "/") for out in _outs(producer)) and producer not in seen:
                seen.add(producer)
                _upstream(producer, seen)
    return seen


def test_each_partition_feeds_only_its_stage():
    assert _consumers("runs/prepare/train") == {"train"}
    assert _consumers("runs/prepare/dev") == {"select"}
    assert _consumers("runs/prepare/calibration") == {"calibrate"}
    assert _consumers("runs/prepare/test") == {"test"}


def test_calibration_comes_after_the_merge_and_nothing_reads_test_or_benchmark_results():
    assert {"merge", "select", "train", "prepare"} <= _upstream("calibrate")
    for stage in ("test", "benchmark"):
        for out in _outs(stage):
            assert not _consumers(out), f"{out} of {stage} feeds {_consumers(out)}"
    assert "calibrate" not in _upstream("select") and "test" not in _upstream("calibrate")


def test_graph_is_acyclic():
    for stage in STAGES:
        assert stage not in _upstream(stage)


@pytest.mark.parametrize("stage", STAGES)
def test_every_path_a_command_passes_is_a_declared_dependency_or_output(stage):
    spec = PIPELINE[stage]
    words = shlex.split(spec["cmd"])
    assert words[:3] == ["python", "-m", f"stages.{stage}"]
    declared = set(spec.get("deps", [])) | _outs(stage)
    passed = {words[i + 1] for i, word in enumerate(words) if word.startswith("--") and i + 1 < len(words)
              and not words[i + 1].startswith("--")}
    prefix_ok = {path for path in passed if path in declared or any(path.startswith(d + "/") for d in declared)}
    # An output root (prepare's partitions) is declared by its children.
    roots = {path for path in passed if any(d.startswith(path + "/") for d in declared)}
    assert passed == prefix_ok | roots, f"undeclared paths: {passed - prefix_ok - roots}"


@pytest.mark.parametrize("stage", STAGES)
def test_each_stage_lists_exactly_the_dohnuts_modules_it_uses(stage):
    declared = {dep for dep in PIPELINE[stage]["deps"] if dep.startswith("dohnuts/")}
    assert declared == {relative_file(name) for name in closure(ROOT / "stages" / f"{stage}.py")}
    assert {"stages/__init__.py", f"stages/{stage}.py"} <= set(PIPELINE[stage]["deps"])


@pytest.mark.parametrize("stage", STAGES)
def test_each_stage_lists_exactly_the_params_it_reads(stage):
    source = (ROOT / "stages" / f"{stage}.py").read_text()
    used = set(re.findall(r'section\([^,]+, "(\w+)"\)', source))
    used |= {"init"} if "init_mode(" in source else set()
    used |= {"seed"} if 'params.get("seed"' in source else set()
    # A stage may declare one key of a section it reads for one value (prepare: train.max_tokens).
    assert {name.split(".")[0] for name in PIPELINE[stage].get("params", [])} == used


def test_every_plot_reads_files_a_stage_writes_and_nothing_reads_the_plot_data():
    files = {path for plot in DEFINITION["plots"] for spec in plot.values() for path in spec["y"]}
    outputs = {out: stage for stage in STAGES for out in _outs(stage)}
    for path in files:
        assert any(path == out or path.startswith(out + "/") for out in outputs), f"{path} is no stage's output"
    for stage in STAGES:
        for out in _paths(PIPELINE[stage].get("plots")):
            assert not _consumers(out), f"{out} of {stage} feeds {_consumers(out)}"
