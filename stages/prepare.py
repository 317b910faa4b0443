"""Stage prepare: build or fetch the base model and generate the decision mixture."""


from pathlib import Path

import click

from dohnuts.config import read_params, section
from dohnuts.io import write_json
from dohnuts.pipeline.prepare import describe, prepare
from stages import user_errors


@click.command()
@click.option("--params", "params_path", type=click.Path(exists=True, dir_okay=False), default="params.yaml",
              show_default=True, help="Parameters file.")
@click.option("--base-out", type=click.Path(file_okay=False), default="runs/prepare/base", show_default=True,
              help="Folder for the base model (Hugging Face format).")
@click.option("--data-root", type=click.Path(file_okay=False), default="runs/prepare", show_default=True,
              help="Root of the partition folders train/, dev/, calibration/, test/.")
@click.option("--summary", type=click.Path(dir_okay=False), default="runs/prepare/summary.json", show_default=True,
              help="Row and state counts per partition and group.")
@user_errors
def main(params_path, base_out, data_root, summary):
    """Write the base model and the partitioned decision mixture, each with a SHA-256 manifest."""
    params = read_params(params_path)
    result = prepare(section(params, "model"), section(params, "data"), Path(base_out), Path(data_root))
    write_json(Path(summary), result)
    click.echo(describe(result))


if __name__ == "__main__":
    main()
