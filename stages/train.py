"""Stage train: LoRA + head training with the RLCD + cross-entropy objective."""


import logging
from pathlib import Path

import click

from dohnuts.config import init_mode, read_params, section
from dohnuts.pipeline.train import TrainRun, train
from dohnuts.runtime.distributed import relaunch
from stages import user_errors


@click.command()
@click.option("--params", "params_path", type=click.Path(exists=True, dir_okay=False), default="params.yaml",
              show_default=True, help="Parameters file.")
@click.option("--base", type=click.Path(exists=True, file_okay=False), default="runs/prepare/base", show_default=True,
              help="Base model folder from prepare.")
@click.option("--data", type=click.Path(exists=True, file_okay=False), default="runs/prepare/train", show_default=True,
              help="The train partition folder.")
@click.option("--parent", type=click.Path(file_okay=False), default="data/parent", show_default=True,
              help="Parent checkpoint folder, used when params init is 'checkpoint'.")
@click.option("--out", type=click.Path(file_okay=False), default="runs/train", show_default=True,
              help="Output folder: checkpoints/, state/, log.csv.")
@click.option("--resume/--no-resume", default=False, show_default=True,
              help="Continue from the saved state in --out when it belongs to this configuration.")
@user_errors
def main(params_path, base, data, parent, out, resume):
    """Train; write checkpoints at step 0, every train.eval_every updates and at the end."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    params = read_params(params_path)
    status = relaunch(section(params, "distributed").processes, "stages.train")  # torchrun, one process per GPU
    if status is not None:
        raise SystemExit(status)
    run = TrainRun(
        model=section(params, "model"), lora=section(params, "lora"), train=section(params, "train"),
        seed=int(params.get("seed", 0)), base=Path(base), data=Path(data), out=Path(out),
        parent=Path(parent) if init_mode(params) == "checkpoint" else None,
    )
    trainer = train(run, resume=resume)
    if trainer.place.main:
        click.echo(f"trained to update {trainer.update}; checkpoints in {out}/checkpoints")


if __name__ == "__main__":
    main()
