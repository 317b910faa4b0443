"""Stage benchmark: latency of complete predict() calls over the upstream-matched workloads."""

import os
import sys

# Stage scripts are named like stdlib modules (select, test): keep their folder off sys.path.
sys.path[:] = [entry for entry in sys.path if os.path.abspath(entry or ".") != os.path.dirname(os.path.abspath(__file__))]

import json
from pathlib import Path

import click

from dohnuts.benchmark import benchmark, workload_texts
from dohnuts.config import read_params, section
from dohnuts.io import write_bytes, write_json
from dohnuts.predict import Predictor
from dohnuts.shapes import shape_only_predictor


@click.command()
@click.option("--params", "params_path", type=click.Path(exists=True, dir_okay=False), default="params.yaml",
              show_default=True, help="Parameters file.")
@click.option("--checkpoint", type=click.Path(file_okay=False), default="runs/calibrate/checkpoint",
              show_default=True, help="Deployable checkpoint folder.")
@click.option("--records", type=click.Path(dir_okay=False), default="runs/benchmark/benchmarks/dohnuts.jsonl",
              show_default=True, help="Raw per-workload records with per-call samples (JSON lines).")
@click.option("--summary", type=click.Path(dir_okay=False), default="runs/benchmark/summary.json", show_default=True,
              help="DVC metrics: p50, decisions/s and efficiency per workload.")
@click.option("--plots", type=click.Path(dir_okay=False), default="runs/benchmark/plots.json", show_default=True,
              help="DVC plots data: latency and efficiency per workload.")
def main(params_path, checkpoint, records, summary, plots):
    """Cold call, warm-up calls, then timed calls per workload; p50/p95/mean and decisions/s."""
    config = section(read_params(params_path), "benchmark")
    if config.shape is not None:
        predictor = shape_only_predictor(config.shape, texts=workload_texts())
        click.echo(f"shape-only: random weights of {config.shape}, not the checkpoint")
    else:
        predictor = Predictor.from_checkpoint(checkpoint)

    def progress(done):
        # Records so far are kept (atomically rewritten), so a killed run loses nothing finished.
        write_bytes(Path(records), "".join(json.dumps(record) + "\n" for record in done).encode())
        last = done[-1]
        if "p50_ms" not in last:
            click.echo(f"{last['workload']:36s} {json.dumps({k: v for k, v in last.items() if k != 'environment'})}",
                       err=True)
            return
        baseline = f"  Hugging Face {last['hugging_face_p50_ms']:8.2f} ms" if "hugging_face_p50_ms" in last else ""
        share = last["roofline"]["efficiency"]["measured"]
        share = f"  efficiency {share:.2e}" if share is not None else ""
        click.echo(f"{last['workload']:36s} p50 {last['p50_ms']:8.2f} ms{baseline}{share}", err=True)

    _, result, rows = benchmark(predictor, config.warmup, config.timed, progress=progress)
    write_json(Path(summary), result)
    write_json(Path(plots), rows)


if __name__ == "__main__":
    main()
