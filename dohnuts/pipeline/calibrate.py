"""The calibrate step: per-type temperatures on the calibration partition, after the merge."""

from __future__ import annotations

from pathlib import Path

from ..config import CalibrateConfig
from ..data.records import RecordReader, load_records
from ..io import atomic_directory, read_json
from ..runtime.checkpoint import load_merged, write_merged
from ..runtime.distributed import world
from ..runtime.evaluation import evaluate, padded, score_table
from ..scoring.calibration import calibrated_temperatures


def calibrate(merged: Path, data: Path, config: CalibrateConfig, out: Path) -> dict | None:
    """Fit one temperature per question type on the calibration partition with the merged model;
    write the deployable checkpoint to `out`. A type whose fit would not lower its row-mean NLL
    keeps 1.0 (`calibrated_temperatures`; its metrics say why). Returns the metrics dict (None
    on ranks other than 0, which only evaluate their share)."""
    place = world()
    model, template, model_config, _ = load_merged(merged, place.device)
    rows = load_records(data)
    table = evaluate(model, template, RecordReader(data), rows, config.batch_tokens, model_config.max_tokens,
                     desc="calibrate", place=place)
    if table is None:  # another rank's share: rank 0 fits and writes
        return None
    logits, mask, targets = padded(table)
    temperatures, per_type = calibrated_temperatures(
        logits, mask, targets, list(table.kind), min_rows=config.min_rows, lr=config.lr,
        iterations=config.iterations, bounds=(config.min_temperature, config.max_temperature))
    _, raw = score_table(table)
    _, calibrated = score_table(table, temperatures)
    resolved = {**read_json(Path(merged) / "dohnuts.json")["resolved"], "calibrate": vars(config)}
    with atomic_directory(out) as tmp:
        write_merged(tmp, model.backbone, model.head, template.tokenizer, template.image_processor,
                     model_config, resolved, temperatures)
    # The fit minimises the row-mean NLL of each type; the macro (group-mean) NLL may still rise.
    return {"temperatures": temperatures, "types": per_type,
            "macro_nll_raw": raw["macro"]["nll"], "macro_nll_calibrated": calibrated["macro"]["nll"]}
