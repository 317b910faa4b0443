"""Stage prepare: build or fetch the base model and generate the decision mixture."""


from pathlib import Path

import click

from dohnuts.config import read_params, section
from dohnuts.data.doctor import describe as describe_report
from dohnuts.io import read_json, write_json
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
              help="Row and state counts per partition and group, what isolation joined and dropped.")
@click.option("--doctor", type=click.Path(dir_okay=False), default="runs/prepare/doctor.json", show_default=True,
              help="The data doctor's report (also printed).")
@user_errors
def main(params_path, base_out, data_root, summary, doctor):
    """Validate the records, then write the base model and the partitioned decision mixture, each
    with a SHA-256 manifest, and the data doctor's report."""
    params = read_params(params_path)
    train = section(params, "train")
    result = prepare(section(params, "model"), section(params, "data"), train.max_tokens, Path(base_out),
                     Path(data_root), train.group_cap)
    write_json(Path(doctor), result.pop("doctor"))
    write_json(Path(summary), result)
    click.echo(describe_report(read_json(Path(doctor))))
    click.echo(describe(result))


if __name__ == "__main__":
    main()
