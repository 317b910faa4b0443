"""The test stage scores what `Predictor` serves (batched requests equal each request alone) and
audits whether an answer depends on the options' order, an irrelevant option, company or batch."""

import json

import numpy as np
import pytest

from dohnuts import Predictor
from dohnuts.config import TestConfig
from dohnuts.data.records import RecordReader, load_records
from dohnuts.pipeline.audits import AUDITS, changes, permuted, sample, summarise, without_one
from dohnuts.pipeline.test import test as run_test_stage
from dohnuts.runtime.evaluation import StateRecords, request_of, state_records


def test_test_stage_probabilities_equal_predict_on_each_request_alone(tiny, deployable):
    root, _ = deployable
    folder = tiny.partition("test")
    scored, metrics, diagrams = run_test_stage(root / "checkpoint", folder, TestConfig(batch_tokens=800))
    rows, reader = load_records(folder), RecordReader(folder)
    assert len(scored) == len(rows)
    predictor = Predictor.from_checkpoint(root / "checkpoint", device="cpu")
    served = {(s, q): p for s, q, p in zip(scored.state_id, scored.qid, scored.probabilities)}
    for records in state_records(rows):
        alone = predictor.predict(*request_of(reader, records))
        for qid, answer in alone["answers"].items():
            # float32 forward: batched rows differ from the request alone by summation order only.
            assert served[records.state_id, qid] == pytest.approx(list(answer["probabilities"].values()), abs=1e-5)
    assert metrics["calibrator"] == predictor.calibrator.to_json()
    for risk, report in metrics["abstention"].items():  # every fitted risk, each group's coverage and error
        assert float(risk) in predictor.calibrator.risks and set(report["groups"]) == set(scored.group)
        assert 0.0 <= report["all"]["coverage"] <= 1.0 and report["all"]["questions"] == len(scored)
    assert set(metrics["abstention"]) == {repr(risk) for risk in predictor.calibrator.risks}
    assert diagrams["risk_coverage_choice"] and diagrams["risk_coverage_choice"][-1]["coverage"] == 1.0
    # Raw metrics score the same forward uncalibrated: they differ where the calibrator kept a family
    # for some type, and are the calibrated ones where its guard stepped every type down to none.
    if predictor.calibrator.cells:
        assert metrics["raw"]["macro"]["nll"] != metrics["calibrated"]["macro"]["nll"]
    else:
        # the same probabilities, summed in another order: equal to a few ulps (1.3853218212825855
        # against 1.385321821282586 in one CI run)
        assert metrics["raw"]["macro"]["nll"] == pytest.approx(metrics["calibrated"]["macro"]["nll"], rel=1e-12)
    for kind in ("choice", "noul", "score"):
        assert sum(row["rows"] for row in diagrams[f"{kind}_raw"]) == int((scored.kind == kind).sum())

    audits = metrics["audits"]
    assert set(audits) == set(AUDITS)
    groups = set(scored.group)
    for name in ("order", "company", "batch"):
        assert audits[name]["all"]["questions"] > 0
        assert set(audits[name]["groups"]) <= groups
    # The hashed layout renders the same tokens in any order: the order audit is 0 to float noise.
    assert audits["order"]["all"]["max"] < 1e-6 and audits["order"]["all"]["flips"] == 0
    assert audits["batch"]["all"]["max"] < 1e-5  # summation order only, as above
    assert "max" in audits["alternatives"]["all"] and "max" in audits["company"]["all"]


def test_the_order_audit_sees_a_layout_that_keeps_the_given_order(tiny, deployable):
    """The audit is not 0 by construction: the same checkpoint rendering options as given moves."""
    root, _ = deployable
    folder = tiny.partition("test")
    rows, reader = load_records(folder), RecordReader(folder)
    predictor = Predictor.from_checkpoint(root / "checkpoint", device="cpu")
    requests = sample(state_records(rows), 40)
    batched = {}
    for records in requests:
        for qid, answer in predictor.predict(*request_of(reader, records))["answers"].items():
            batched[records.state_id, qid] = answer["probabilities"]
    hashed = summarise(list(changes(predictor, reader, requests, batched)))["order"]["all"]
    predictor.template.order_salt = None  # the given order
    given = summarise(list(changes(predictor, reader, requests, batched)))
    assert hashed["questions"] == given["order"]["all"]["questions"] > 0
    choices = sum(question["type"] == "choice"
                  for records in requests for question in records.request_questions().values())
    assert hashed["questions"] == choices  # every choice, its options a list or a mapping
    assert hashed["max"] < 1e-6 < 1e-3 < given["order"]["all"]["max"]
    assert given["batch"]["all"]["max"] > 1e-3  # `batched` came from the hashed layout


def test_audit_variants_change_only_what_they_audit():
    rng = np.random.default_rng(0)
    mapping = {"type": "choice", "instructions": "Which?", "criteria": {"a": "x", "b": None, "c": "z"}}
    listed = {"type": "choice", "criteria": [3, "b", 1.5]}
    for question in (mapping, listed):
        for _ in range(5):
            moved = permuted(question, rng)
            assert {**moved, "criteria": 0} == {**question, "criteria": 0}
            before, after = (list(getattr(q["criteria"], "items", q["criteria"].__iter__)()) for q in (question, moved))
            assert after != before and sorted(map(str, after)) == sorted(map(str, before))
    assert permuted({"type": "score", "criteria": ["lo", "hi"]}, rng)["criteria"] == ["lo", "hi"]
    probabilities = {"a": 0.1, "b": 0.7, "c": 0.2}
    for _ in range(10):
        fewer = without_one(mapping, probabilities, rng)["criteria"]
        assert len(fewer) == 2 and "b" in fewer and fewer["b"] is None
    assert without_one({"type": "choice", "criteria": ["a", "b"]}, {"a": 0.5, "b": 0.5}, rng) is None
    assert without_one({"type": "noul"}, {"false": 0.5, "true": 0.5}, rng) is None


def test_audit_sample_takes_groups_in_turn_and_summary_counts_flips():
    class Records:
        def __init__(self, group):
            self.groups = (group,)

    requests = [Records("big") for _ in range(10)] + [Records("small")]
    chosen = sample(requests, 4)
    assert [records.groups[0] for records in chosen] == ["big"] * 3 + ["small"]
    assert chosen[:3] == requests[:3]
    found = [("order", "g", 0.0, False), ("order", "g", 0.2, True), ("order", "h", 0.1, False)]
    summary = summarise(found)
    assert summary["order"]["all"] == {"questions": 3, "max": 0.2, "mean": pytest.approx(0.1), "flips": 1 / 3}
    assert summary["order"]["groups"]["h"]["max"] == 0.1 and summary["company"]["all"] == {"questions": 0}


def test_the_order_audit_asks_choices_whose_options_are_a_mapping():
    """A mapping's options in another order compare equal to the original as dicts: the audit
    must still ask them again (a stub that favours the first option sent shows the change)."""
    class FirstFavoured:
        def predict(self, state, questions):
            answers = {}
            for qid, question in questions.items():
                labels = list(question["criteria"])
                weights = [2.0 if index == 0 else 1.0 for index in range(len(labels))]
                answers[qid] = {"probabilities": {label: w / sum(weights) for label, w in zip(labels, weights)}}
            return {"answers": answers}

    class Reader:
        def state(self, row):
            return json.loads(row["state"])

    question = {"type": "choice", "instructions": "Which?", "criteria": {"a": None, "b": "bee", "c": None}}
    records = StateRecords('"s"', None, "s1", ("g",), ("q",), (json.dumps(question),), ((1.0, 0.0, 0.0),))
    batched = {("s1", "q"): {"a": 0.5, "b": 0.25, "c": 0.25}}
    found = [row for row in changes(FirstFavoured(), Reader(), [records], batched) if row[0] == "order"]
    assert len(found) == 1 and found[0][2] == pytest.approx(0.25)
