"""The calibrate step: the calibrator and abstention thresholds on the calibration partition,
after the merge."""

from __future__ import annotations

from pathlib import Path

from ..config import CalibrateConfig
from ..data.records import RecordReader, load_records
from ..io import atomic_directory, read_json
from ..runtime.checkpoint import load_merged, write_merged
from ..runtime.distributed import world
from ..runtime.evaluation import evaluate, padded, score_table
from ..scoring.calibrator import Fit, Rows, fit_calibrator


def calibrate(merged: Path, data: Path, config: CalibrateConfig, out: Path) -> dict | None:
    """Fit the calibrator on the calibration partition with the merged model (each question
    type's family by cross-validation over states, guarded so that no group of at least
    `min_rows` rows gets a higher ECE than raw, and abstention thresholds at `config.risks`:
    `scoring.calibrator.fit_calibrator`); write the deployable checkpoint to `out`. Returns the
    metrics dict (None on ranks other than 0, which only evaluate their share)."""
    place = world()
    model, template, model_config, _ = load_merged(merged, place.device)
    records = load_records(data)
    table = evaluate(model, template, RecordReader(data), records, config.batch_tokens, model_config.max_tokens,
                     desc="calibrate", place=place)
    if table is None:  # another rank's share: rank 0 fits and writes
        return None
    logits, mask, targets = padded(table)
    rows = Rows.of(logits.numpy(), mask.numpy(), targets.numpy(), list(table.kind), list(table.group),
                   list(table.state_id), config.folds)
    fit = Fit(config.min_rows, config.lr, config.iterations, (config.min_temperature, config.max_temperature))
    calibrator, report = fit_calibrator(rows, config.folds, fit, config.risks, config.delta)
    _, raw = score_table(table)
    _, calibrated = score_table(table, calibrator)
    resolved = {**read_json(Path(merged) / "dohnuts.json")["resolved"], "calibrate": vars(config)}
    with atomic_directory(out) as tmp:
        write_merged(tmp, model.backbone, model.head, template.tokenizer, template.image_processor,
                     model_config, resolved, calibrator)
    return {**report, "macro_nll_raw": raw["macro"]["nll"], "macro_nll_calibrated": calibrated["macro"]["nll"],
            "macro_ece_raw": raw["macro"]["ece"], "macro_ece_calibrated": calibrated["macro"]["ece"]}
