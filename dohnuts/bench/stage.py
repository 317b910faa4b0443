"""The benchmark stage: every workload family of `dohnuts.bench` on the deployable checkpoint or
a shape-only model, the raw records written as they come, the summary for DVC metrics."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

from ..config import BenchmarkConfig
from ..data.image_files import state_images
from ..io import write_bytes
from ..runtime.predict import Predictor
from .evaluation import evaluation_throughput_record
from .load import describe_level
from .long_context import long_context_record
from .protocol import PUBLISHED_P50_MS, run_workload, workloads
from .records import environment, mix_ceiling
from .serving import ServingPlan, serving_record
from .shapes import shape_only_predictor, write_shape_checkpoint
from .telemetry import measure_ceilings
from .traffic import serving_mix
from .training import TRAINING_LAYOUTS, multi_process_update_record, scaling, training_update_record
from .varied import real_traffic_record, varied_traffic_record


def benchmark(predictor, warmup: int, timed: int, progress=None, serving: ServingPlan | None = None,
              shape: str | None = None, checkpoint: Path | None = None,
              varied_requests: int = 60, real_traffic_requests: int = 0,
              long_context: tuple[int, ...] = ()) -> tuple[list[dict], dict, list[dict]]:
    """Run every repeated workload (image workloads also with a cold image-feature cache), the
    varied-traffic workload (`varied_requests` requests of distinct layouts), the real-traffic
    workload (`real_traffic_requests`, none when 0), on CUDA the long-context one (a request of
    about each of `long_context` tokens), evaluation
    throughput, the serving workload (`serving`: `dohnuts serve` on `checkpoint`, or on a
    deployable folder of the `shape` written for it, in processes of its own; none when None),
    then one training-update record (which injects fresh LoRA into the predictor's model, so it
    comes last), with one more per process count a machine of several GPUs offers (the model
    rebuilt from `shape` or `checkpoint` in each process). Ceilings are measured first, in the
    same process. `progress(records so far)` follows each record.

    Returns:
        (raw records, summary for DVC metrics, plot rows: one per workload)
    """
    device = predictor.model.device
    ceilings = measure_ceilings(device)
    records = []
    for name, (state, questions) in workloads().items():
        variants = (False, True) if state_images(state) else (False,)  # an image state: its cache miss too
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
    if real_traffic_requests:
        extra.append({**real_traffic_record(predictor, real_traffic_requests), "environment": environment(predictor)})
    if long_context and device.type == "cuda":
        extra.append({**long_context_record(predictor, long_context), "environment": environment(predictor)})
    if progress is not None:
        progress(records + extra)
    if serving is not None:
        serving = {**served(predictor, serving, ceilings, shape, checkpoint), "environment": environment(predictor)}
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
        "serving": serving_summary(serving) if serving else {},
        "real_traffic": next(({**{key: record[key] for key in ("requests", "image_requests", "hugging_face_p50_ms",
                                                               "hugging_face_p99_ms", "hugging_face_max_ms")},
                               **{key: value for key, value in record["first_sight"].items() if key != "samples_ms"}}
                              for record in extra if record["workload"] == "real_traffic"), {}),
        "long_context": next((record["requests"] for record in extra if record["workload"] == "long_context"), []),
        "published_p50_ms": PUBLISHED_P50_MS,
    }
    plots = [{"workload": record["workload"], "p50_ms": record["p50_ms"],
              "hugging_face_p50_ms": record["hugging_face_p50_ms"],
              "efficiency": record["roofline"]["efficiency"]["measured"]} for record in records]
    plots += [{"workload": f"varied_traffic_{name}", "p50_ms": varied[name]["p50_ms"],
               "hugging_face_p50_ms": varied["hugging_face_p50_ms"], "efficiency": None}
              for name in ("first_sight", "second_pass")]
    return records + extra, summary, plots


def served(predictor, plan: ServingPlan, ceilings: dict, shape: str | None, checkpoint: Path | None) -> dict:
    """The serving record (`serving.serving_record`) on `checkpoint`, or on a deployable folder of
    `shape` written for it, with the roofline ceiling of the same mix beside it."""
    ceiling = mix_ceiling(predictor, serving_mix(plan.requests), ceilings)
    if shape is None:
        return {**serving_record(checkpoint, plan), "ceiling": ceiling}
    with tempfile.TemporaryDirectory() as scratch:
        folder = write_shape_checkpoint(shape, Path(scratch) / "checkpoint")
        return {**serving_record(folder, plan), "ceiling": ceiling, "shape_only": shape}


def serving_summary(record: dict) -> dict:
    """The serving record's headline figures for DVC metrics: each level's, and the rates held."""
    keys = ("offered_requests_per_second", "achieved_requests_per_second", "decisions_per_second", "p50_ms",
            "p99_ms", "no_answer", "statuses")
    levels = {}
    for level in record["levels"]:
        name = (f"open_{level['offered_requests_per_second']:g}_per_second" if level["mode"] == "open"
                else f"closed_{level['clients']}_clients")
        levels[name] = {**{key: level[key] for key in keys}, **{
            key: level.get("server", {}).get(key) for key in ("mean_batch_requests", "eager_share",
                                                              "device_busy_share")}}
    return {"levels": levels, "held": record["held"], "ceiling": record["ceiling"]}


def describe(record: dict) -> str:
    """One progress line for a benchmark record."""
    if record["workload"] == "serving":
        return "serving                              " + "; ".join(map(describe_level, record["levels"]))
    if record["workload"] == "varied_traffic":
        return "varied_traffic                       " + "; ".join(
            f"{name.replace('_', ' ')} p50 {record[name]['p50_ms']:.2f} p99 {record[name]['p99_ms']:.2f} ms "
            f"{record[name]['timed_calls']}" for name in ("first_sight", "second_pass")) + (
            f"; Hugging Face p50 {record['hugging_face_p50_ms']:.2f} ms")
    if record["workload"] == "real_traffic":
        part = record["first_sight"]
        return (f"real_traffic                         first sight p50 {part['p50_ms']:.2f} p99 {part['p99_ms']:.2f} "
                f"max {part['max_ms']:.2f} ms {part['timed_calls']}; Hugging Face p50 "
                f"{record['hugging_face_p50_ms']:.2f} max {record['hugging_face_max_ms']:.2f} ms")
    if record["workload"] == "long_context":
        return "long_context                         " + "; ".join(
            f"{request['target_tokens']} tokens refused" if "refused" in request else
            f"{request['computed_tokens']} tokens {request['first_sight_ms']:.1f} ms first, "
            f"{request['second_ms']:.1f} again" for request in record["requests"])
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


def serving_plan(config: BenchmarkConfig) -> ServingPlan | None:
    """The serving workload the params ask for, or None (`serving_requests: 0`)."""
    if not config.serving_requests:
        return None
    return ServingPlan(config.serving_requests, config.serving_rates, config.serving_clients, config.serving_seconds,
                       config.serving_warmup_seconds, config.serving_workers, config.serving_client_processes,
                       config.serving_client_cpus)


def run(config: BenchmarkConfig, checkpoint: Path, records: Path, echo=print) -> tuple[dict, list[dict]]:
    """The benchmark stage: the deployable checkpoint, or a random-weight model of the shape
    `config.shape` names (shape-only), through `benchmark`. The raw records are rewritten
    atomically to `records` after each one, so a killed run keeps what it finished; `echo`
    gets a progress line per record.

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
                                  serving=serving_plan(config), shape=config.shape,
                                  checkpoint=None if config.shape else checkpoint,
                                  varied_requests=config.varied_requests,
                                  real_traffic_requests=config.real_traffic_requests,
                                  long_context=config.long_context)
    return summary, plots
