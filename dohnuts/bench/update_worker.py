"""One process of the benchmark's training update on several processes (started by torchrun).

    python -m torch.distributed.run --standalone --nproc-per-node N -m dohnuts.bench.update_worker JSON

JSON: {"checkpoint": folder, or "shape": name, "microbatches", "rows", "timed", "ceilings" (measured
here when absent), "output"}. Rank 0 writes the record to "output". Run without torchrun it is one
process, so the same worker times the update with and without the launcher.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..io import write_json
from ..runtime.distributed import world
from ..runtime.predict import Predictor
from .shapes import shape_only_predictor
from .telemetry import measure_ceilings


def main(settings: dict) -> None:
    place = world()
    if settings.get("shape"):
        predictor = shape_only_predictor(settings["shape"], place.device, graphs=False)  # it only trains
    else:
        predictor = Predictor.from_checkpoint(Path(settings["checkpoint"]), place.device, graphs=False)
    from .training import training_update_record

    ceilings = settings.get("ceilings") or measure_ceilings(place.device)
    record = training_update_record(predictor.model, predictor.template, ceilings,
                                    settings["microbatches"], settings["rows"], settings["timed"], place)[0]
    if place.main:
        write_json(Path(settings["output"]), record)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
