"""The test stage scores what `Predictor` serves: batched requests equal each request alone."""

import pytest

from dohnuts import Predictor
from dohnuts.config import TestConfig
from dohnuts.data.records import RecordReader, load_records
from dohnuts.pipeline.test import test as run_test_stage
from dohnuts.runtime.evaluation import _requests, request_of


def test_test_stage_probabilities_equal_predict_on_each_request_alone(tiny, deployable):
    root, _ = deployable
    folder = tiny.partition("test")
    scored, metrics, diagrams = run_test_stage(root / "checkpoint", folder, TestConfig(batch_tokens=800))
    rows, reader = load_records(folder), RecordReader(folder)
    assert len(scored) == len(rows)
    predictor = Predictor.from_checkpoint(root / "checkpoint", device="cpu")
    served = {(s, q): p for s, q, p in zip(scored.state_id, scored.qid, scored.probabilities)}
    for records in _requests(rows):
        alone = predictor.predict(*request_of(reader, records))
        for qid, answer in alone["answers"].items():
            # float32 forward: batched rows differ from the request alone by summation order only.
            assert served[records.state_id, qid] == pytest.approx(list(answer["probabilities"].values()), abs=1e-5)
    assert metrics["temperatures"] == predictor.temperatures
    # Raw metrics score the same forward at temperature 1: they differ where a temperature is not 1.
    assert metrics["raw"]["macro"]["nll"] != metrics["calibrated"]["macro"]["nll"]
    for kind in ("choice", "noul", "score"):
        assert sum(row["rows"] for row in diagrams[f"{kind}_raw"]) == int((scored.kind == kind).sum())
