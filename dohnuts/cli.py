"""The `dohnuts` command: the data doctor.

The one module of the library that imports click: a console entry point, like the stage
scripts, above every wing.
"""

from __future__ import annotations

from pathlib import Path

import click

from .config import read_params, section
from .data.doctor import describe, examine
from .io import write_json


@click.group()
def main():
    """Dohnuts: small multimodal decision models."""


@main.command()
@click.argument("path", type=click.Path(exists=True))
@click.option("--params", "params_path", type=click.Path(dir_okay=False), default="params.yaml", show_default=True,
              help="Parameters file for the partition seed and shares, the marker and the token budgets "
                   "(the defaults when it does not exist).")
@click.option("--base", type=click.Path(exists=True, file_okay=False), default=None,
              help="A base or checkpoint folder whose tokenizer measures token lengths (runs/prepare/base).")
@click.option("--report", type=click.Path(dir_okay=False), default=None, help="Also write the report as JSON.")
def doctor(path, params_path, base, report):
    """Check the decision records at PATH (a JSONL or Parquet file, or a folder of them) and
    report everything that would spoil a run. Exits 1 when a record is invalid."""
    params = read_params(params_path) if Path(params_path).is_file() else {}
    try:
        result = examine(Path(path), section(params, "model"), section(params, "data"),
                         section(params, "train").max_tokens, Path(base) if base else None)
    except (ValueError, FileNotFoundError) as error:
        raise click.ClickException(str(error)) from None
    if report:
        write_json(Path(report), result)
    click.echo(describe(result))
    if result["problem_count"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
