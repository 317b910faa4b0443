"""Stage test: raw and calibrated metrics of the deployable checkpoint on the test partition."""


from pathlib import Path

import click

from dohnuts.config import read_params, section
from dohnuts.io import write_json, write_json_files, write_parquet
from dohnuts.pipeline.test import test
from dohnuts.runtime.distributed import relaunch
from stages import user_errors


@click.command()
@click.option("--params", "params_path", type=click.Path(exists=True, dir_okay=False), default="params.yaml",
              show_default=True, help="Parameters file.")
@click.option("--checkpoint", type=click.Path(exists=True, file_okay=False), default="runs/calibrate/checkpoint",
              show_default=True, help="Deployable checkpoint folder.")
@click.option("--data", type=click.Path(exists=True, file_okay=False), default="runs/prepare/test", show_default=True,
              help="The test partition folder.")
@click.option("--predictions", type=click.Path(dir_okay=False), default="runs/test/predictions.parquet",
              show_default=True, help="Per-example predictions.")
@click.option("--metrics", type=click.Path(dir_okay=False), default="runs/test/metrics.json", show_default=True)
@click.option("--reliability", type=click.Path(file_okay=False), default="runs/test/reliability", show_default=True,
              help="Plot data: reliability diagrams per question type, raw and calibrated.")
@user_errors
def main(params_path, checkpoint, data, predictions, metrics, reliability):
    """Accuracy, soft accuracy, NLL, Brier, ECE, RPS and MAE per group and macro."""
    params = read_params(params_path)
    status = relaunch(section(params, "distributed").processes, "stages.test")  # torchrun, one process per GPU
    if status is not None:
        raise SystemExit(status)
    outputs = test(Path(checkpoint), Path(data), section(params, "test"))
    if outputs is None:  # another process's share; rank 0 writes
        return
    table, result, diagrams = outputs
    write_parquet(Path(predictions), table)
    write_json_files(Path(reliability), diagrams)
    write_json(Path(metrics), result)
    macro = result["calibrated"]["macro"]
    click.echo(f"test macro accuracy {macro['accuracy']:.4f} (chance {macro['chance']:.4f}), nll {macro['nll']:.4f}")


if __name__ == "__main__":
    main()
