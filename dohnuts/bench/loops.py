"""Whole loops measured apart from the stage: evaluation's passes step by step, the training
update with and without training graphs, and the stage's own records without serving."""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from ..config import EVALUATION_BATCH_TOKENS
from ..data import synthetic
from ..data.records import RecordReader, load_records, write_mixture
from ..io import write_bytes, write_json
from ..runtime.evaluation import EvaluationBatches, evaluate, plan_batches
from .evaluation import synchronous_evaluation
from .host import SHAPE, require_cuda, timed_samples
from .shapes import shape_only_predictor
from .stage import benchmark, describe
from .telemetry import measure_ceilings
from .training import training_update_record


def evaluation_profile() -> None:
    """Where evaluation's time goes on the GPU.

        python benchmarks/run.py evaluation_profile > evaluation-profile.txt

    On the shape-only Qwen3.5-0.8B model (random weights, bf16, the real tokenizer) and the
    benchmark's evaluation set (`evaluation_throughput_record`'s: 204 rows, 96 images), it times
    the plan, each batch's host build, its copy and its forward alone, then whole passes of
    `evaluate` with its batches built in the loop (no worker process, the default for 2 batches) and
    by 1 and 2 worker processes, and the plain loop (the plan made beforehand), each pass with the
    image-feature cache emptied first (p50 of 3 after one untimed pass). Every timing is
    bracketed by device synchronisations.
    """
    require_cuda()
    predictor = shape_only_predictor(SHAPE, graphs=False)
    model, template = predictor.model, predictor.template
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        write_mixture(synthetic.generate(seed=0, states_per_group=12), root, 0,
                      {"train": 0.0, "dev": 0.0, "calibration": 0.0, "test": 1.0})
        rows, reader = load_records(root / "test"), RecordReader(root / "test")
        build = EvaluationBatches(template, reader, predictor.config.max_tokens)
        plan = plan_batches(rows, EVALUATION_BATCH_TOKENS, template)
        samples = timed_samples(lambda: plan_batches(rows, EVALUATION_BATCH_TOKENS, template), 5)
        print(f"plan_batches (host) p50 {statistics.median(samples):8.2f} ms", flush=True)
        pictured = int((rows.images.map(len) > 0).sum())
        print(f"{len(rows)} rows, {len(plan)} batches, {pictured} rows with images", flush=True)
        for index, tables in enumerate(plan):
            item = build(tables)
            moved = item.batch.to(model.device)
            with torch.no_grad():
                model(moved)

            def forward(moved=moved):
                model.image_cache.clear()
                with torch.no_grad():
                    model(moved)

            for label, call in (("build (host)", lambda tables=tables: build(tables)),
                                ("copy to the device", lambda item=item: item.batch.to(model.device)),
                                ("forward, images encoded", forward)):
                samples = timed_samples(call, 5)
                print(f"batch {index} ({sum(len(t) for t in tables)} rows, {item.batch.computed_tokens} tokens) "
                      f"{label:26s} p50 {statistics.median(samples):8.2f} ms", flush=True)
        passes = {f"evaluate, {workers} worker processes" if workers else "evaluate, built in the loop":
                  (lambda workers=workers: evaluate(model, template, reader, rows, EVALUATION_BATCH_TOKENS,
                                                    predictor.config.max_tokens, desc="profile", workers=workers))
                  for workers in (0, 1, 2)}
        passes["plain loop"] = lambda: synchronous_evaluation(model, build, plan)
        for label, run in passes.items():
            seconds = []
            for attempt in range(4):
                model.image_cache.clear()
                torch.cuda.synchronize()
                start = time.perf_counter()
                run()
                torch.cuda.synchronize()
                if attempt:
                    seconds.append(time.perf_counter() - start)
            best = statistics.median(seconds)
            print(f"{label:40s} p50 {best * 1000:8.1f} ms  {len(rows) / best:7.1f} rows/s  "
                  f"({', '.join(f'{s * 1000:.0f}' for s in seconds)} ms)", flush=True)


# Each mode of `training_graphs`: the capture threshold it sets (None: the runtime's own).
TRAINING_MODES = {"eager": 10**9, "graphs": None}


def training_graphs(varied: int = 16, modes: tuple[str, ...] = ("eager", "graphs")) -> None:
    """The training update with and without training graphs, in one process.

        python benchmarks/run.py training_graphs --varied 16 --modes eager graphs > training-graphs.txt

    On shape-only Qwen3.5-0.8B models (random weights, bf16, the real tokenizer), each with fresh
    LoRA, the benchmark's `training_update_record`: first with every update eager (the training
    graphs' capture put out of reach), then as the runtime runs it (a training bucket's second
    batch captures its graphs, later ones replay them), each with `varied` more updates of
    distinct layouts. `modes` picks either or both. Every timing is bracketed by device
    synchronisations.

    Raises:
        ValueError: a mode other than "eager" and "graphs".
    """
    unknown = sorted(set(modes) - set(TRAINING_MODES))
    if unknown:
        raise ValueError(f"unknown training_graphs modes {unknown}; known: {list(TRAINING_MODES)}")
    require_cuda()
    device = torch.device("cuda")
    ceilings = measure_ceilings(device)
    for label, capture_at in TRAINING_MODES.items():
        if label not in modes:
            continue
        predictor = shape_only_predictor(SHAPE, device, graphs=False)
        if capture_at is not None:
            predictor.model.training_graphs.capture_at = capture_at
        torch.cuda.reset_peak_memory_stats(device)
        records = training_update_record(predictor.model, predictor.template, ceilings, varied=varied)
        peak = torch.cuda.max_memory_allocated(device) / 2**30
        repeated = records[0]
        samples = [round(x, 1) for x in repeated["samples_ms"]]
        print(f"{label}: update p50 {repeated['p50_ms']:.1f} ms, samples {samples}, "
              f"cold {repeated['cold_ms']:.0f} ms, computed tokens {repeated['computed_tokens']}, "
              f"graphs {repeated['training_graphs']}, peak allocated {peak:.1f} GiB", flush=True)
        for record in records[1:]:
            print(f"{label}: {record['updates']} varied layouts ({record['buckets']} buckets): p50 "
                  f"{record['p50_ms']:.1f} ms, p95 {record['p95_ms']:.1f}, mean {record['mean_ms']:.1f}, "
                  f"graphs {record['training_graphs']}", flush=True)
            print(json.dumps({key: record[key] for key in ("computed_tokens", "samples_ms")}), flush=True)
        del predictor, records
        torch.cuda.empty_cache()


def stage_records(out: str, warmup: int = 3, timed: int = 20, varied_requests: int = 60) -> None:
    """The benchmark stage's records without its serving workload.

        python benchmarks/run.py stage_records --out FOLDER

    On a machine that lacks the serve extra's dependencies (the H200 test machine has no
    opentelemetry, which the fastapi 0.165 wheel imports), `stages.benchmark` stops at the serving
    workload. This runs the stage's own `benchmark` loop on the shape-only Qwen3.5-0.8B predictor
    with the stage's default protocol (3 warm-up and 20 timed calls, 60 varied requests) and no
    serving workload, writing the raw records to FOLDER/records.jsonl after each one (with a
    progress line for each new record) and the summary to FOLDER/summary.json.
    """
    folder = Path(out)
    predictor = shape_only_predictor(SHAPE)
    print(f"shape-only: random weights of {SHAPE}, not the checkpoint", flush=True)
    echoed = 0

    def progress(done):
        nonlocal echoed
        write_bytes(folder / "records.jsonl", "".join(json.dumps(record) + "\n" for record in done).encode())
        for record in done[echoed:]:  # a step may add several records (the two training records)
            print(describe(record), flush=True)
        echoed = len(done)

    _, summary, _ = benchmark(predictor, warmup, timed, progress=progress, shape=SHAPE,
                              varied_requests=varied_requests)
    write_json(folder / "summary.json", summary)
