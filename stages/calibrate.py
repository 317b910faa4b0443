"""Stage calibrate: the calibrator and abstention thresholds on the calibration partition, after the merge."""


from pathlib import Path

import click

from dohnuts.config import read_params, section
from dohnuts.io import write_json
from dohnuts.pipeline.calibrate import calibrate
from dohnuts.runtime.distributed import relaunch
from stages import user_errors


@click.command()
@click.option("--params", "params_path", type=click.Path(exists=True, dir_okay=False), default="params.yaml",
              show_default=True, help="Parameters file.")
@click.option("--merged", type=click.Path(exists=True, file_okay=False), default="runs/merge/model", show_default=True)
@click.option("--data", type=click.Path(exists=True, file_okay=False), default="runs/prepare/calibration",
              show_default=True, help="The calibration partition folder.")
@click.option("--out", type=click.Path(file_okay=False), default="runs/calibrate/checkpoint", show_default=True,
              help="Deployable checkpoint folder (loads with dohnuts.Predictor.from_checkpoint).")
@click.option("--metrics", type=click.Path(dir_okay=False), default="runs/calibrate/metrics.json", show_default=True)
@user_errors
def main(params_path, merged, data, out, metrics):
    """Fit the calibrator (a family a question type, no group's ECE raised) and abstention
    thresholds; write the deployable checkpoint."""
    params = read_params(params_path)
    status = relaunch(section(params, "distributed").processes, "stages.calibrate")  # torchrun, one process per GPU
    if status is not None:
        raise SystemExit(status)
    result = calibrate(Path(merged), Path(data), section(params, "calibrate"), Path(out))
    if result is None:  # another process's share; rank 0 writes
        return
    write_json(Path(metrics), result)
    families = " ".join(f"{kind}={entry['kept']}" + (f" (chosen {entry['chosen']})" if entry["chosen"] != entry["kept"]
                                                      else "") for kind, entry in result["families"].items())
    click.echo(f"calibrator families {families}; macro ECE {result['macro_ece_raw']:.4f} raw -> "
               f"{result['macro_ece_calibrated']:.4f}, NLL {result['macro_nll_raw']:.4f} -> "
               f"{result['macro_nll_calibrated']:.4f}")


if __name__ == "__main__":
    main()
