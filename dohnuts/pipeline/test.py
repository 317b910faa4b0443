"""The test step: raw and calibrated metrics of the deployable checkpoint on the test partition."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from ..config import TestConfig
from ..data.records import RecordReader, load_records
from ..model.predict import Predictor
from .evaluate import evaluate, score_table


def test(checkpoint: Path, data: Path, config: TestConfig) -> tuple[pd.DataFrame, dict]:
    """Raw and calibrated metrics on the test partition with the deployable checkpoint.

    Returns:
        (per-example predictions, metrics dict)
    """
    predictor = Predictor.from_checkpoint(checkpoint)
    rows = load_records(data)
    table = evaluate(predictor.model, predictor.template, RecordReader(data), rows, config.batch_rows,
                     predictor.config.max_tokens, desc="test")
    _, raw = score_table(table)
    scored, calibrated = score_table(table, predictor.temperatures)
    return scored, {
        "calibrated": calibrated, "raw": raw, "temperatures": predictor.temperatures}
