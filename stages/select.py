"""Stage select: pick the checkpoint with the best dev macro accuracy (step 0 included)."""


from pathlib import Path

import click

from dohnuts.config import read_params, section
from dohnuts.io import write_json
from dohnuts.pipeline.select import select
from dohnuts.runtime.distributed import relaunch
from stages import user_errors


@click.command()
@click.option("--params", "params_path", type=click.Path(exists=True, dir_okay=False), default="params.yaml",
              show_default=True, help="Parameters file.")
@click.option("--checkpoints", type=click.Path(exists=True, file_okay=False), default="runs/train/checkpoints",
              show_default=True, help="Folder of step-* checkpoints from train.")
@click.option("--base", type=click.Path(exists=True, file_okay=False), default="runs/prepare/base", show_default=True)
@click.option("--data", type=click.Path(exists=True, file_okay=False), default="runs/prepare/dev", show_default=True,
              help="The dev partition folder.")
@click.option("--adapter-out", type=click.Path(file_okay=False), default="runs/select/adapter", show_default=True,
              help="Folder for the selected checkpoint.")
@click.option("--table-out", type=click.Path(dir_okay=False), default="runs/select/selection.parquet",
              show_default=True, help="Selection table: dev accuracy of every checkpoint.")
@click.option("--curve-out", type=click.Path(file_okay=False), default="runs/select/curve", show_default=True,
              help="Plot data: dev macro accuracy per checkpoint step, and the selected step.")
@click.option("--metrics", type=click.Path(dir_okay=False), default="runs/select/metrics.json", show_default=True)
@user_errors
def main(params_path, checkpoints, base, data, adapter_out, table_out, curve_out, metrics):
    """Evaluate every checkpoint on the dev partition; ties go to the earliest."""
    params = read_params(params_path)
    status = relaunch(section(params, "distributed").processes, "stages.select")  # torchrun, one process per GPU
    if status is not None:
        raise SystemExit(status)
    result = select(Path(checkpoints), Path(base), Path(data), section(params, "model"), section(params, "lora"),
                    section(params, "select"), Path(adapter_out), Path(table_out), Path(curve_out))
    if result is None:  # another process's share; rank 0 writes
        return
    write_json(Path(metrics), result)
    click.echo(f"selected step {result['selected_step']} (dev macro accuracy {result['dev_macro_accuracy']:.4f})")


if __name__ == "__main__":
    main()
