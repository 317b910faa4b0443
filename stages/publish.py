"""Not a pipeline stage: copy a finished run's selected checkpoint to the parent folder.

`dvc exp run --set-param init=checkpoint` then trains from it (the folder is a declared
dependency of train).
"""


from pathlib import Path

import click

from dohnuts.pipeline.publish import publish
from stages import user_errors


@click.command()
@click.option("--source", type=click.Path(exists=True, file_okay=False), default="runs/select/adapter",
              show_default=True, help="A checkpoint folder written by train or select.")
@click.option("--target", type=click.Path(file_okay=False), default="data/parent", show_default=True,
              help="The parent checkpoint folder train reads when init is 'checkpoint'.")
@user_errors
def main(source, target):
    """Verify the source's SHA-256 manifest and copy it to the target."""
    publish(Path(source), Path(target))
    click.echo(f"published {source} -> {target}")


if __name__ == "__main__":
    main()
