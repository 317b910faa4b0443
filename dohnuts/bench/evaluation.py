"""Evaluation throughput: the overlapped loader path against a synchronous loop, rows per second."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from ..config import EVALUATION_BATCH_TOKENS
from ..data import synthetic
from ..data.loader import workers_for
from ..data.records import RecordReader, load_records, write_mixture
from ..runtime.evaluation import EvaluationBatches, evaluate, plan_batches, result_rows
from .telemetry import synchronize


@torch.no_grad()
def synchronous_evaluation(model, build, plan) -> list[dict]:
    """The plain loop the loader replaces: build a batch, copy it, run it, wait for its logits."""
    results = []
    for tables in plan:
        item = build(tables)
        results.extend(result_rows(model(item.batch.to(model.device)).cpu(), item.meta))
    return results

def evaluation_throughput_record(model, template, max_tokens: int, root: Path, states_per_group: int = 12,
                                 batch_tokens: int = EVALUATION_BATCH_TOKENS, passes: int = 3) -> dict:
    """Rows per second of evaluation on a generated image-and-text partition: `evaluate` (loader
    workers, prefetch, overlapped results) against `synchronous_evaluation`, each the median of
    `passes` timed passes (a pass is a fraction of a second on the H200: one alone varied by a
    fifth), the two paths alternating pass by pass so that drift reaches both alike. The
    image-feature cache is emptied before each timed pass, so both encode every image; each path
    runs once untimed first (kernel autotuning, allocator warm-up)."""
    if passes < 1:
        raise ValueError(f"evaluation_throughput_record: passes must be at least 1, got {passes}")
    states = synthetic.generate(seed=0, states_per_group=states_per_group)
    write_mixture(states, root, 0, {"train": 0.0, "dev": 0.0, "calibration": 0.0, "test": 1.0})
    folder = root / "test"
    rows, reader = load_records(folder), RecordReader(folder)
    build = EvaluationBatches(template, reader, max_tokens)
    plan = plan_batches(rows, batch_tokens, template)
    device = model.device
    paths = {"overlapped": lambda: evaluate(model, template, reader, rows, batch_tokens, max_tokens,
                                            desc="overlapped"),
             "synchronous": lambda: synchronous_evaluation(model, build, plan)}
    samples = {name: [] for name in paths}
    for run in paths.values():
        run()
    for _ in range(passes):
        for name, run in paths.items():
            model.image_cache.clear()
            synchronize(device)
            start = time.perf_counter()
            run()
            synchronize(device)
            samples[name].append(time.perf_counter() - start)
    model.image_cache.clear()
    seconds = {name: statistics.median(values) for name, values in samples.items()}
    record = {"workload": "evaluation_throughput", "rows": len(rows), "batches": len(plan),
              "batch_tokens": batch_tokens, "images": int(rows.images.map(len).sum()),
              "loader_workers": workers_for(device, len(plan)), "passes": passes}
    for name, value in seconds.items():
        record[f"{name}_seconds"] = value
        record[f"{name}_seconds_samples"] = samples[name]
        record[f"{name}_rows_per_second"] = len(rows) / value
    record["speedup"] = seconds["synchronous"] / seconds["overlapped"]
    return record
