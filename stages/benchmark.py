"""Stage benchmark: latency of complete predict() calls, varied traffic, training, evaluation, serving."""

from pathlib import Path

import click

import dohnuts.cli  # noqa: F401 - the serving workload runs `python -m dohnuts.cli serve`: a dependency of this stage
from dohnuts.bench.stage import run
from dohnuts.config import read_params, section
from dohnuts.io import write_json
from stages import user_errors


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
@user_errors
def main(params_path, checkpoint, records, summary, plots):
    """Cold call, warm-up calls, then timed calls per workload; p50/p95/mean and decisions/s."""
    config = section(read_params(params_path), "benchmark")
    result, rows = run(config, Path(checkpoint), Path(records), echo=lambda line: click.echo(line, err=True))
    write_json(Path(summary), result)
    write_json(Path(plots), rows)


if __name__ == "__main__":
    main()
