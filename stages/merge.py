"""Stage merge: fold the selected LoRA adapter into the frozen base."""


from pathlib import Path

import click

from dohnuts.config import read_params, section
from dohnuts.pipeline.merge import merge
from stages import user_errors


@click.command()
@click.option("--params", "params_path", type=click.Path(exists=True, dir_okay=False), default="params.yaml",
              show_default=True, help="Parameters file.")
@click.option("--base", type=click.Path(exists=True, file_okay=False), default="runs/prepare/base", show_default=True)
@click.option("--adapter", type=click.Path(exists=True, file_okay=False), default="runs/select/adapter",
              show_default=True, help="Selected checkpoint folder.")
@click.option("--out", type=click.Path(file_okay=False), default="runs/merge/model", show_default=True,
              help="Merged model folder (backbone, head, tokenizer, processor, manifest).")
@user_errors
def main(params_path, base, adapter, out):
    """Write the merged model after checking its logits against the unmerged model's."""
    params = read_params(params_path)
    error = merge(Path(base), Path(adapter), section(params, "model"), section(params, "lora"), Path(out))
    click.echo(f"merged model written to {out} (max abs logit difference to unmerged: {error:.2e})")


if __name__ == "__main__":
    main()
