"""Stage benchmark: latency of complete predict() calls over the upstream-matched workloads."""

import os
import sys

# Stage scripts are named like stdlib modules (select, test): keep their folder off sys.path.
sys.path[:] = [entry for entry in sys.path if os.path.abspath(entry or ".") != os.path.dirname(os.path.abspath(__file__))]

import json
from pathlib import Path

import click

from dohnuts.benchmark import benchmark
from dohnuts.config import read_params, section
from dohnuts.io import write_bytes, write_json
from dohnuts.predict import Predictor


@click.command()
@click.option("--params", "params_path", type=click.Path(exists=True, dir_okay=False), default="params.yaml",
              show_default=True, help="Parameters file.")
@click.option("--checkpoint", type=click.Path(exists=True, file_okay=False), default="runs/calibrate/checkpoint",
              show_default=True, help="Deployable checkpoint folder.")
@click.option("--records", type=click.Path(dir_okay=False), default="runs/benchmark/benchmarks/dohnuts.jsonl",
              show_default=True, help="Raw per-workload records with per-call samples (JSON lines).")
@click.option("--summary", type=click.Path(dir_okay=False), default="runs/benchmark/summary.json", show_default=True)
def main(params_path, checkpoint, records, summary):
    """Cold call, warm-up calls, then timed calls per workload; p50/p95/mean and decisions/s."""
    config = section(read_params(params_path), "benchmark")
    predictor = Predictor.from_checkpoint(checkpoint)
    raw, result = benchmark(predictor, config.warmup, config.timed, progress=lambda name: click.echo(f"  {name}"))
    write_bytes(Path(records), "".join(json.dumps(record) + "\n" for record in raw).encode())
    write_json(Path(summary), result)
    for name, row in result["workloads"].items():
        click.echo(f"{name:28s} p50 {row['p50_ms']:8.2f} ms  {row['decisions_per_second']:9.1f} decisions/s")


if __name__ == "__main__":
    main()
