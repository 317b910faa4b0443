"""Not a pipeline stage: copy a finished run's selected checkpoint to the parent folder.

`dvc exp run --set-param init=checkpoint` then trains from it (the folder is a declared
dependency of train).
"""


from pathlib import Path

import click

from dohnuts.io import IntegrityError
from dohnuts.pipeline.publish import publish


@click.command()
@click.option("--source", type=click.Path(exists=True, file_okay=False), default="runs/select/adapter",
              show_default=True, help="A checkpoint folder written by train or select.")
@click.option("--target", type=click.Path(file_okay=False), default="data/parent", show_default=True,
              help="The parent checkpoint folder train reads when init is 'checkpoint'.")
def main(source, target):
    """Verify the source's SHA-256 manifest and copy it to the target."""
    try:
        publish(Path(source), Path(target))
    except IntegrityError as error:
        raise click.ClickException(str(error)) from None
    click.echo(f"published {source} -> {target}")


if __name__ == "__main__":
    main()
