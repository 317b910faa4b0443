"""Training and evaluation on two processes (gloo on the CPU, spawned by torchrun) against one."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file

from dohnuts.runtime.checkpoint import ADAPTER

WORKER = Path(__file__).with_name("distributed_worker.py")
ROOT = Path(__file__).resolve().parents[2]


def _launch(processes: int, job: str, timeout: float = 600, **settings) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes),
               str(WORKER), job, json.dumps({key: str(value) if isinstance(value, Path) else value
                                             for key, value in settings.items()})]
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "HOME": str(ROOT)}
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, check=False)


def _train(tiny, out, processes, **settings):
    result = _launch(processes, "train", base=tiny.base, data=tiny.partition("train"), out=out,
                     result=out.parent / f"{out.name}.json", steps=4, **settings)
    return result


@pytest.fixture(scope="module")
def runs(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("distributed")
    one, two = _train(tiny, root / "one", 1), _train(tiny, root / "two", 2)
    assert one.returncode == 0, one.stderr[-3000:]
    assert two.returncode == 0, two.stderr[-3000:]
    return root


def test_two_processes_learn_what_one_process_learns(runs):
    one, two = (json.loads((runs / f"{name}.json").read_text()) for name in ("one", "two"))
    assert one["processes"] == 1 and two["processes"] == 2
    for first, second in zip(one["log"], two["log"]):  # the same microbatches, the same noise, each step
        for key in ("loss", "reward", "cross_entropy", "accuracy", "grad_norm"):
            assert second[key] == pytest.approx(first[key], rel=1e-4, abs=1e-6), key
    for step in (0, 2, 4):
        a = load_file(str(runs / "one" / "checkpoints" / f"step-{step:06d}" / ADAPTER))
        b = load_file(str(runs / "two" / "checkpoints" / f"step-{step:06d}" / ADAPTER))
        assert a.keys() == b.keys()
        # float32: the two processes pack their microbatches apart, so sums run in another order.
        worst = max((a[key] - b[key]).abs().max().item() for key in a)
        assert worst <= 2e-5, f"step {step}: {worst}"


def test_sharded_selection_and_test_equal_one_process(tiny, runs, deployable, tmp_path):
    tables = {}
    for processes in (1, 2):
        out = tmp_path / f"select-{processes}"
        result = _launch(processes, "select", checkpoints=runs / "two" / "checkpoints", base=tiny.base,
                         data=tiny.partition("dev"), out=out, result=tmp_path / f"select-{processes}.json")
        assert result.returncode == 0, result.stderr[-3000:]
        tables[processes] = pd.read_parquet(out / "selection.parquet")
    pd.testing.assert_frame_equal(tables[1], tables[2])  # identical, not merely close
    assert json.loads((tmp_path / "select-1.json").read_text()) == json.loads((tmp_path / "select-2.json").read_text())
    root, _ = deployable
    tests = {}
    for processes in (1, 2):
        result = _launch(processes, "test", checkpoint=root / "checkpoint", data=tiny.partition("test"),
                         result=tmp_path / f"test-{processes}.json")
        assert result.returncode == 0, result.stderr[-3000:]
        tests[processes] = json.loads((tmp_path / f"test-{processes}.json").read_text())
    # The audits measure how far an answer moves with its company, batch or order: float noise of
    # 1e-7 that each rank's batches shape. Everything else is identical: the same rows in the same
    # order, the same metrics.
    audits = [_leaves(tests[processes]["metrics"].pop("audits")) for processes in (1, 2)]
    assert tests[1] == tests[2]
    assert audits[0].keys() == audits[1].keys() and audits[0] == pytest.approx(audits[1], abs=1e-6)


def _leaves(tree, path="") -> dict:
    """{path: value} of every leaf of nested dicts and lists (None kept as it is)."""
    if isinstance(tree, (dict, list)):
        children = tree.items() if isinstance(tree, dict) else enumerate(tree)
        return {key: value for name, child in children for key, value in _leaves(child, f"{path}/{name}").items()}
    return {path: tree}


def test_a_killed_two_process_run_stops_every_rank_and_resumes(tiny, runs, tmp_path):
    out = tmp_path / "killed"
    started = time.monotonic()
    killed = _train(tiny, out, 2, die_at=3, timeout=300)
    assert killed.returncode != 0 and time.monotonic() - started < 300  # an error, not a hang
    assert "exitcode" in killed.stderr or "failed" in killed.stderr.lower()
    assert (out / "checkpoints" / "step-000002").is_dir() and not (out / "checkpoints" / "step-000004").exists()
    resumed = _train(tiny, out, 2, resume=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    expected = load_file(str(runs / "two" / "checkpoints" / "step-000004" / ADAPTER))
    actual = load_file(str(out / "checkpoints" / "step-000004" / ADAPTER))
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], rtol=0, atol=1e-6, msg=key)
    log = json.loads((tmp_path / "killed.json").read_text())["log"]
    assert [row["step"] for row in log] == [1, 2, 3, 4]


def test_the_benchmark_times_an_update_on_two_processes(deployable):
    from dohnuts.bench.telemetry import measure_ceilings
    from dohnuts.bench.training import multi_process_update_record, scaling

    root, _ = deployable
    ceilings = measure_ceilings("cpu", matrix_size=64, copy_bytes=2**20, repeats=2)
    two = multi_process_update_record({"checkpoint": str(root / "checkpoint")}, 2, ceilings, microbatches=2, rows=4,
                                      timed=2)
    assert two["processes"] == 2 and two["microbatches"] == 2 and two["tokens_per_second"] > 0
    one = {**two, "processes": 1, "tokens_per_second": two["tokens_per_second"] / 2}  # as if twice as slow alone
    assert scaling([one, two])[1]["scaling_efficiency"] == pytest.approx(1.0)
