"""The benchmark stage: every workload family of `dohnuts.bench` on the deployable checkpoint or
a shape-only model, the raw records written as they come, the summary for DVC metrics."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

from ..config import BenchmarkConfig
from ..io import write_bytes
from ..runtime.predict import Predictor
from .evaluation import evaluation_throughput_record
from .protocol import PUBLISHED_P50_MS, run_workload, workloads
from .records import environment
from .serving import serving_record
from .shapes import shape_only_predictor
from .telemetry import measure_ceilings
from .training import TRAINING_LAYOUTS, multi_process_update_record, scaling, training_update_record
from .varied import varied_traffic_record


def benchmark(predictor, warmup: int, timed: int, progress=None, serving_requests: int = 0,
              serving_clients: tuple[int, ...] = (), shape: str | None = None,
              checkpoint: Path | None = None, varied_requests: int = 60,
              app_factory=None) -> tuple[list[dict], dict, list[dict]]:
    """Run every repeated workload (image workloads also with a cold image-feature cache), the
    varied-traffic workload (`varied_requests` requests of distinct layouts), evaluation
    throughput, the serving workload (`serving_requests` varied requests over loopback at each
    count of `serving_clients`; none when 0), then one training-update record (which injects
    fresh LoRA into the predictor's model, so it comes last), with one more per process count a
    machine of several GPUs offers (the model rebuilt from `shape` or `checkpoint` in each
    process). Ceilings are measured first, in the same process. `progress(records so far)`
    follows each record. `app_factory` builds the served app for the serving workload
    (`dohnuts.serve.app.create_app`, handed in by the stage script: bench and serve are peers).

    Returns:
        (raw records, summary for DVC metrics, plot rows: one per workload)
    """
    device = predictor.model.device
    ceilings = measure_ceilings(device)
    records = []
    for name, (state, questions) in workloads().items():
        variants = (False, True) if isinstance(state, dict) and "image" in state else (False,)
        for cache_miss in variants:
            record = run_workload(predictor, name, state, questions, warmup, timed, ceilings, cache_miss)
            records.append({**record, "environment": environment(predictor)})
            if progress is not None:
                progress(records)
    varied = {**varied_traffic_record(predictor, varied_requests), "environment": environment(predictor)}
    if progress is not None:
        progress([*records, varied])
    with tempfile.TemporaryDirectory() as scratch:
        throughput = {**evaluation_throughput_record(predictor.model, predictor.template, predictor.config.max_tokens,
                                                     Path(scratch)), "environment": environment(predictor)}
    extra = [varied, throughput]
    if progress is not None:
        progress(records + extra)
    serving = None
    if serving_requests:
        serving = {**serving_record(predictor, serving_requests, serving_clients, app_factory),
                   "environment": environment(predictor)}
        extra.append(serving)
        if progress is not None:
            progress(records + extra)
    environment_now = environment(predictor)
    # The varied-layout training record is about the training graphs, which only CUDA has.
    first, *varied_training = training_update_record(predictor.model, predictor.template, ceilings,
                                                     varied=TRAINING_LAYOUTS if device.type == "cuda" else 0)
    trainings = [first]
    # One record per process count the machine offers: 2 .. its GPUs, each its own torchrun.
    source = {"shape": shape} if shape else {"checkpoint": str(checkpoint)} if checkpoint else None
    if device.type == "cuda" and source is not None:
        trainings += [multi_process_update_record(source, count, ceilings)
                      for count in range(2, torch.cuda.device_count() + 1)]
    trainings = [{**record, "environment": environment_now} for record in scaling(trainings)]
    training = trainings[0]
    varied_training = [{**record, "environment": environment_now} for record in varied_training]
    extra += trainings + varied_training
    if progress is not None:
        progress(records + extra)
    keys = ("p50_ms", "p95_ms", "cold_ms", "decisions_per_second", "hugging_face_p50_ms")
    keys += ("max_abs_logit_difference_to_hugging_face", "timed_calls")
    summary = {
        "environment": environment(predictor), "ceilings": ceilings,
        "workloads": {record["workload"]: {**{key: record[key] for key in keys},
                                           "efficiency": record["roofline"]["efficiency"]["measured"],
                                           "efficiency_by_bound": record["roofline"]["efficiency_by_bound"]["measured"]}
                      for record in records},
        "varied_traffic": {
            "requests": varied["requests"], "hugging_face_p50_ms": varied["hugging_face_p50_ms"],
            **{name: {key: value for key, value in varied[name].items() if key != "samples_ms"}
               for name in ("first_sight", "second_pass")}},
        "training_update": {"p50_ms": training["p50_ms"], "tokens_per_second": training["tokens_per_second"],
                            "processes": training["processes"],
                            "scaling": {str(record["processes"]): record["scaling_efficiency"] for record in trainings},
                            "efficiency": training["roofline"]["efficiency"]["measured"],
                            "training_graphs": training["training_graphs"]},
        "training_update_varied": {key: varied_training[0][key] for key in (
            "updates", "p50_ms", "p95_ms", "mean_ms", "training_graphs")} if varied_training else {},
        "evaluation_rows_per_second": {name: throughput[f"{name}_rows_per_second"]
                                       for name in ("overlapped", "synchronous")},
        "serving": {f"clients_{level['clients']}": {key: level[key] for key in (
            "requests_per_second", "decisions_per_second", "p50_ms", "p99_ms", "mean_batch_requests", "failed",
            "lost")} for level in serving["levels"]} if serving else {},
        "published_p50_ms": PUBLISHED_P50_MS,
    }
    plots = [{"workload": record["workload"], "p50_ms": record["p50_ms"],
              "hugging_face_p50_ms": record["hugging_face_p50_ms"],
              "efficiency": record["roofline"]["efficiency"]["measured"]} for record in records]
    plots += [{"workload": f"varied_traffic_{name}", "p50_ms": varied[name]["p50_ms"],
               "hugging_face_p50_ms": varied["hugging_face_p50_ms"], "efficiency": None}
              for name in ("first_sight", "second_pass")]
    return records + extra, summary, plots

def describe(record: dict) -> str:
    """One progress line for a benchmark record."""
    if record["workload"] == "serving":
        return "serving                              " + "; ".join(
            f"{level['clients']} clients {level['decisions_per_second']:.1f} decisions/s p50 {level['p50_ms']:.1f} ms"
            f" batch {level['mean_batch_requests'] or 0:.1f} failed {level['failed']} lost {level['lost']}"
            for level in record["levels"])
    if record["workload"] == "varied_traffic":
        return "varied_traffic                       " + "; ".join(
            f"{name.replace('_', ' ')} p50 {record[name]['p50_ms']:.2f} p99 {record[name]['p99_ms']:.2f} ms "
            f"{record[name]['timed_calls']}" for name in ("first_sight", "second_pass")) + (
            f"; Hugging Face p50 {record['hugging_face_p50_ms']:.2f} ms")
    if record["workload"] == "training_update_varied":
        return (f"training_update_varied               p50 {record['p50_ms']:8.2f} ms  p95 {record['p95_ms']:.2f}  "
                f"mean {record['mean_ms']:.2f}  {record['updates']} layouts in {record['buckets']} buckets "
                f"{record['training_graphs']}")
    if "p50_ms" not in record or "roofline" not in record:
        return f"{record['workload']:36s} {json.dumps({k: v for k, v in record.items() if k != 'environment'})}"
    baseline = f"  Hugging Face {record['hugging_face_p50_ms']:8.2f} ms" if "hugging_face_p50_ms" in record else ""
    share = record["roofline"]["efficiency"]["measured"]
    share = f"  efficiency {share:.2e}" if share is not None else ""
    return f"{record['workload']:36s} p50 {record['p50_ms']:8.2f} ms{baseline}{share}"


def run(config: BenchmarkConfig, checkpoint: Path, records: Path, echo=print,
        app_factory=None) -> tuple[dict, list[dict]]:
    """The benchmark stage: the deployable checkpoint, or a random-weight model of the shape
    `config.shape` names (shape-only), through `benchmark`. The raw records are rewritten
    atomically to `records` after each one, so a killed run keeps what it finished; `echo`
    gets a progress line per record; `app_factory` as `benchmark` takes it.

    Returns:
        (summary for DVC metrics, plot rows)
    """
    if config.shape is not None:
        predictor = shape_only_predictor(config.shape)
        echo(f"shape-only: random weights of {config.shape}, not the checkpoint")
    else:
        predictor = Predictor.from_checkpoint(checkpoint)

    echoed = 0

    def progress(done):
        nonlocal echoed
        write_bytes(Path(records), "".join(json.dumps(record) + "\n" for record in done).encode())
        for record in done[echoed:]:  # a step may add several records (the two training records)
            echo(describe(record))
        echoed = len(done)

    _, summary, plots = benchmark(predictor, config.warmup, config.timed, progress=progress,
                                  serving_requests=config.serving_requests, serving_clients=config.serving_clients,
                                  shape=config.shape, checkpoint=None if config.shape else checkpoint,
                                  varied_requests=config.varied_requests, app_factory=app_factory)
    return summary, plots
