"""The whole DVC pipeline on a smoke-sized params file, then an init-from-checkpoint experiment."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from dohnuts import Predictor

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _smoke_params() -> dict:
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["data"].update(states_per_group=16, allow_untested_groups=True)  # 16 states: a group may miss test
    params["model"]["image_pixels"] = 64 * 64
    params["train"].update(steps=4, eval_every=2)
    params["select"]["dev_rows_per_group"] = 16
    params["benchmark"].update(warmup=1, timed=2, varied_requests=6, serving_requests=8, serving_rates=[4],
                               serving_clients=[1, 2], serving_seconds=2, serving_warmup_seconds=0.5,
                               serving_workers=1, serving_client_processes=1)
    return params


def _run(project: Path, *command: str, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(project), "DVC_NO_ANALYTICS": "1"}
    bin_dir = str(Path(sys.executable).parent)  # dvc and python of this environment
    env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
    result = subprocess.run(command, cwd=project, env=env, capture_output=True, text=True, timeout=1800)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(command)} failed ({result.returncode}):\n{result.stdout[-3000:]}\n"
                             f"{result.stderr[-3000:]}")
    return result


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    project = tmp_path_factory.mktemp("pipeline") / "project"
    project.mkdir()
    for name in ("dohnuts", "stages", "data", "examples"):
        shutil.copytree(ROOT / name, project / name, ignore=shutil.ignore_patterns("__pycache__", "*.safetensors",
                                                                                    "manifest.json", "config.json"))
    shutil.copy(ROOT / "dvc.yaml", project)
    (project / "params.yaml").write_text(yaml.safe_dump(_smoke_params(), sort_keys=False))
    _run(project, "git", "init", "-q")
    _run(project, "git", "config", "user.email", "ci@dohnuts.invalid")
    _run(project, "git", "config", "user.name", "ci")
    _run(project, "dvc", "init", "-q")
    _run(project, "dvc", "config", "core.autostage", "true")
    _run(project, "git", "add", "-A")
    _run(project, "git", "commit", "-qm", "smoke project")
    _run(project, "dvc", "repro")
    return project


def test_repro_produces_every_stage_output_and_then_is_up_to_date(project):
    for path in ("runs/prepare/summary.json", "runs/train/log.csv", "runs/select/metrics.json",
                 "runs/merge/model/manifest.json", "runs/calibrate/checkpoint/calibration.json",
                 "runs/test/predictions.parquet", "runs/test/metrics.json",
                 "runs/benchmark/benchmarks/dohnuts.jsonl", "runs/benchmark/summary.json"):
        assert (project / path).is_file(), path
    prepared = json.loads((project / "runs/prepare/summary.json").read_text())
    assert prepared["isolation"]["cross_partition"] == {"texts": 0, "images": 0}
    assert all(prepared["partitions"][name]["rows"] > 0 for name in ("train", "dev", "calibration", "test"))
    metrics = json.loads((project / "runs/test/metrics.json").read_text())
    assert set(metrics["calibrated"]["groups"]) == set(metrics["raw"]["groups"])
    assert set(metrics["calibrated"]["groups"]) == set(prepared["partitions"]["test"]["groups"])
    assert len(metrics["calibrated"]["groups"]) >= 4
    summary = json.loads((project / "runs/benchmark/summary.json").read_text())
    assert set(summary["workloads"]) >= {"distinct_text_50q", "vision_protocol_image_1q",
                                         "vision_protocol_image_1q_cache_miss"}
    assert summary["ceilings"]["method"].startswith("CPU-measured")
    records = [json.loads(line) for line in
               (project / "runs/benchmark/benchmarks/dohnuts.jsonl").read_text().splitlines()]
    timed = [record for record in records if "p50_ms" in record]
    assert {record["workload"] for record in timed} == set(summary["workloads"]) | {"training_update"}
    for record in timed:  # every timed record carries its useful work, bounds and efficiency
        roofline = record["roofline"]
        assert roofline["work"]["flops"]["total"] > 0 and roofline["work"]["bytes"]["total"] > 0
        bound = roofline["bounds"]["measured"]
        assert bound["max_seconds"] <= bound["critical_path_seconds"] <= bound["sum_seconds"]
        assert 0 < roofline["efficiency"]["measured"] == bound["t_lower_seconds"] / (record["p50_ms"] / 1000)
        assert "absent" in roofline["efficiency"]["datasheet"]  # no datasheet for this CPU
    hit, miss = (next(r for r in records if r["workload"] == name)
                 for name in ("vision_protocol_image_1q", "vision_protocol_image_1q_cache_miss"))
    assert miss["roofline"]["work"]["flops"]["vision"] > 0 == hit["roofline"]["work"]["flops"]["vision"]
    serving = next(record for record in records if record["workload"] == "serving")  # dohnuts serve, its own processes
    assert [(level["mode"], level["offered_requests_per_second"], level["clients"]) for level in serving["levels"]] == [
        ("open", 4.0, None), ("closed", None, 1), ("closed", None, 2)]
    for level in serving["levels"]:  # every request answered, none refused or lost
        assert level["sent"] > 0 and level["answered"] == level["sent"] == level["statuses"]["200"]
        assert level["no_answer"] == 0 and level["decisions_per_second"] > 0
        assert level["server"]["eager_share"] == 1.0  # the CPU: no graphs
    assert serving["levels"][1]["server"]["mean_batch_requests"] == 1.0  # one client: one request an invocation
    assert summary["serving"]["levels"]["closed_2_clients"]["no_answer"] == 0
    assert summary["serving"]["ceiling"]["decisions_per_second"] > 0
    varied = next(record for record in records if record["workload"] == "varied_traffic")
    assert varied["requests"] == 6 and summary["varied_traffic"]["first_sight"]["timed_calls"]["eager"] == 6
    throughput = next(record for record in records if record["workload"] == "evaluation_throughput")
    assert throughput["overlapped_rows_per_second"] > 0 and throughput["synchronous_rows_per_second"] > 0
    for path in ("overlapped", "synchronous"):  # the median of the passes' samples
        samples = throughput[f"{path}_seconds_samples"]
        assert len(samples) == throughput["passes"] == 3 and throughput[f"{path}_seconds"] == sorted(samples)[1]
    plots = json.loads((project / "runs/benchmark/plots.json").read_text())
    assert {row["workload"] for row in plots} == set(summary["workloads"]) | {
        "varied_traffic_first_sight", "varied_traffic_second_pass"}
    curve = json.loads((project / "runs/select/curve/curve.json").read_text())
    selected = json.loads((project / "runs/select/curve/selected.json").read_text())
    assert [point["step"] for point in curve] == [0, 2, 4] and selected[0] in curve
    predictions = pd.read_parquet(project / "runs/test/predictions.parquet")
    for kind in ("choice", "noul", "score"):
        for variant in ("raw", "calibrated"):
            bins = json.loads((project / f"runs/test/reliability/{kind}_{variant}.json").read_text())
            assert sum(row["rows"] for row in bins) == int((predictions.kind == kind).sum())
            assert all(0 <= row["accuracy"] <= 1 and 0 < row["confidence"] <= 1 for row in bins)
    shown = json.loads(_run(project, "dvc", "plots", "show", "--json").stdout)["data"]
    assert {"selection", "reliability_choice", "reliability_noul", "reliability_score"} <= set(shown)
    points = shown["selection"][0]["content"]["data"]["values"]
    drawn = {(float(point["step"]), float(point["macro_accuracy"])) for point in points}
    assert drawn == {(float(point["step"]), float(point["macro_accuracy"])) for point in curve}
    again = _run(project, "dvc", "repro")
    assert "Data and pipelines are up to date" in again.stdout


def test_the_deployable_checkpoint_loads_with_predictor_alone(project):
    predictor = Predictor.from_checkpoint(project / "runs/calibrate/checkpoint", device="cpu")
    result = predictor.predict({"customer": "Mina"}, {
        "who": {"type": "choice", "instructions": "Who is the customer?", "criteria": ["Mina", "Sam"]},
        "ok": {"type": "noul", "instructions": "Is a customer named?"},
        "size": {"type": "score", "instructions": "How big?", "criteria": ["small", "medium", "large"]},
    })
    answers = result["answers"]
    assert answers["who"]["choice"] in {"Mina", "Sam"}
    assert sum(answers["who"]["probabilities"].values()) == pytest.approx(1.0)
    assert 0.0 <= answers["ok"]["noul"] <= 1.0
    assert 0.0 <= answers["size"]["score"] <= 2.0
    assert result["usage"]["images"] == 0 and result["usage"]["input_tokens"] > 0


def test_init_from_checkpoint_experiment_needs_a_published_parent(project):
    _run(project, "git", "add", "-A")
    _run(project, "git", "commit", "-qm", "first run")
    refused = _run(project, "dvc", "exp", "run", "--set-param", "init=checkpoint", check=False)
    assert refused.returncode != 0
    assert "holds no adapter.safetensors" in refused.stdout + refused.stderr

    _run(project, "python", "-m", "stages.publish", "--source", "runs/select/adapter", "--target", "data/parent")
    assert (project / "data/parent/adapter.safetensors").is_file() and (project / "data/parent/README.md").is_file()
    _run(project, "dvc", "exp", "run", "--set-param", "init=checkpoint")
    child = json.loads((project / "runs/train/checkpoints/step-000000/config.json").read_text())
    assert child["init"] == "checkpoint"

    params = _run(project, "dvc", "params", "diff").stdout
    assert "init" in params and "checkpoint" in params
    metrics = _run(project, "dvc", "metrics", "diff", "--all").stdout
    assert "runs/test/metrics.json" in metrics and "calibrated.macro.accuracy" in metrics


def test_own_records_run_through_the_pipeline_and_are_a_declared_dependency(project):
    _run(project, "git", "add", "-A")
    _run(project, "git", "commit", "-qm", "before the records experiment")
    _run(project, "dvc", "exp", "run", "--set-param", "init=base", "--set-param", "data.source=records",
         "--set-param", "data.path=examples/support")
    doctor = json.loads((project / "runs/prepare/doctor.json").read_text())
    assert doctor["records"] == 168 and doctor["problem_count"] == 0
    assert set(doctor["groups"]) == {"product_photos", "ticket_routing"}
    metrics = json.loads((project / "runs/test/metrics.json").read_text())
    # The photos share one caption (the images tell them apart) and two team options have a null
    # description: both groups are tested, and asked in another order, no choice moves.
    assert set(metrics["calibrated"]["groups"]) == {"product_photos", "ticket_routing"}
    assert metrics["calibrated"]["groups"]["product_photos"]["rows"] > 0
    order = metrics["audits"]["order"]
    assert set(order["groups"]) == {"product_photos", "ticket_routing"} and order["all"]["max"] < 1e-6
    assert "runs/test/metrics.json" in _run(project, "dvc", "metrics", "diff").stdout
    assert "Data and pipelines are up to date" in _run(project, "dvc", "status").stdout
    records = project / "examples/support/ticket_routing.jsonl"
    records.write_text(records.read_text() + records.read_text().splitlines()[0].replace("t-0000", "t-9999") + "\n")
    status = _run(project, "dvc", "status", "prepare").stdout
    assert "changed deps" in status and "examples/support" in status
