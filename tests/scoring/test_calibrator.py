"""The served calibrator: families chosen by cross-validation, the ECE guard, JSON, abstention."""

import math

import numpy as np
import pytest

from dohnuts.scoring.abstention import NEVER, binomial_upper, risk_coverage, risk_threshold, selective
from dohnuts.scoring.calibrator import (
    FAMILIES,
    IDENTITY,
    Calibrator,
    Cell,
    Fit,
    Rows,
    choose_families,
    fit_calibrator,
    fit_family,
    guarded,
)


def _softmax(logits):
    weights = np.exp(logits - logits.max(axis=1, keepdims=True))
    return weights / weights.sum(axis=1, keepdims=True)


def _rows(kind_counts, make_targets, seed=0, groups=None):
    """Rows of (kind, candidate count, how many), logits ~ 3 N(0, 1), targets one-hot draws
    from make_targets(kind, count, logits) (each row's true distribution), padded to 5."""
    rng = np.random.default_rng(seed)
    logits, mask, targets, kinds = [], [], [], []
    for kind, count, many in kind_counts:
        z = 3 * rng.standard_normal((many, count))
        truth = make_targets(kind, count, z)
        drawn = np.array([rng.choice(count, p=p) for p in truth])
        for row, label in zip(z, drawn):
            padded = np.zeros(5)
            padded[:count] = row
            logits.append(padded)
            mask.append(np.arange(5) < count)
            target = np.zeros(5)
            target[label] = 1.0
            targets.append(target)
            kinds.append(kind)
    count = len(kinds)
    return Rows.of(np.array(logits), np.array(mask), np.array(targets), kinds,
                   groups if groups is not None else [f"g{index % 3}" for index in range(count)],
                   [f"s{index}" for index in range(count)], folds=5)


def test_cross_validation_picks_the_family_that_made_the_data():
    # Choice rows of 3 and 5 candidates over-confident by different factors: one temperature a
    # candidate count fits them, one a type does not. Noul rows with a bias towards "true".
    def truth(kind, count, z):
        if kind == "choice":
            return _softmax(z / (4.0 if count == 3 else 1.0))
        return _softmax(z / 2.0 + np.array([0.0, 1.5]))

    rows = _rows([("choice", 3, 600), ("choice", 5, 600), ("noul", 2, 600)], truth)
    chosen, held_out = choose_families(rows, 5, Fit())
    assert chosen == {"choice": "count", "noul": "bias"}, held_out
    calibrator, report = fit_calibrator(rows, 5, Fit(), (0.05,), 0.1)
    assert calibrator.cell("choice", 3).temperature == pytest.approx(4.0, rel=0.25)
    assert calibrator.cell("choice", 5).temperature == pytest.approx(1.0, rel=0.25)
    noul = calibrator.cell("noul", 2)
    assert noul.temperature == pytest.approx(2.0, rel=0.25) and noul.bias[1] == pytest.approx(1.5, abs=0.4)
    assert calibrator.cell("score", 4) is IDENTITY  # no score rows: raw
    # Calibrated rows of an already calibrated type keep the raw logits.
    plain = _rows([("choice", 4, 900)], lambda kind, count, z: _softmax(z), seed=1)
    assert choose_families(plain, 5, Fit())[0] == {"choice": "none"}


def test_the_guard_steps_a_family_down_until_no_group_is_worse_than_raw():
    # Over-confident rows (made at temperature 3) in group a, calibrated ones in group b, all of
    # one type: a temperature helps a and makes b worse than raw, so the type steps down to
    # gentler families until b is no worse; without b, the temperature stays.
    def truth(kind, count, z):
        return _softmax(z / np.where(np.arange(len(z)) < 600, 3.0, 1.0)[:, None])

    rows = _rows([("choice", 3, 1200)], truth, groups=["a"] * 600 + ["b"] * 600)
    fitted = {"none": {}, "mix": {("choice", 0): Cell(mix=0.3)}, "type": {("choice", 0): Cell(3.0)}}
    fitted |= {"count": fitted["type"], "bias": fitted["type"]}
    families, fallbacks = guarded({"choice": "type"}, fitted, rows, min_rows=10)
    assert FAMILIES.index(families["choice"]) < FAMILIES.index("type") and fallbacks
    assert fallbacks[0]["steps"] == {"choice": "type -> mix"} and "b" in fallbacks[0]["groups"]
    entry = fallbacks[0]["groups"]["b"]
    assert entry["ece_calibrated"] > entry["ece_raw"]
    alone = rows.where(rows.groups == "a")
    assert guarded({"choice": "type"}, fitted, alone, min_rows=10) == ({"choice": "type"}, [])
    # A group below min_rows is not guarded.
    assert guarded({"choice": "type"}, fitted, rows, min_rows=1000) == ({"choice": "type"}, [])
    calibrator, report = fit_calibrator(rows, 5, Fit(), (0.05,), 0.1)
    for group, entry in report["groups"].items():
        assert entry["ece_calibrated"] <= entry["ece_raw"] + 1e-12, group


def test_the_mix_family_recovers_a_uniform_share():
    # Rows whose truth is 80% the logits' softmax and 20% uniform.
    rows = _rows([("noul", 2, 3000)], lambda kind, count, z: 0.8 * _softmax(z) + 0.2 / count, seed=4)
    (cell,) = fit_family("mix", rows, Fit()).values()
    assert cell.temperature == 1.0 and cell.mix == pytest.approx(0.2, abs=0.05)
    probabilities = Calibrator({("noul", 0): cell}).probabilities(rows.logits, rows.mask, rows.kinds)
    np.testing.assert_allclose(probabilities[:, :2].min(axis=1) >= cell.mix / 2 - 1e-12, True)
    np.testing.assert_allclose(probabilities.sum(axis=1), 1.0)


def test_a_calibrator_scales_rows_by_their_cell_and_round_trips_through_json():
    calibrator = Calibrator({("choice", 0): Cell(2.0), ("choice", 3): Cell(0.5), ("noul", 2): Cell(1.0, (0.0, 1.0)),
                             ("score", 0): Cell(mix=0.1)},
                            {"choice": {0.05: 0.8}, "noul": {0.05: NEVER}, "score": {0.05: 0.5}})
    logits = np.array([[2.0, 4.0, 0.0], [2.0, 4.0, 6.0], [1.0, 1.0, 0.0]])
    mask = np.array([[True, True, False], [True, True, True], [True, True, False]])
    probabilities = calibrator.probabilities(logits, mask, ["choice", "choice", "noul"])
    # Row 0 takes the choice type's T = 2, row 1 its 3-candidate cell's T = 0.5, row 2 the bias.
    np.testing.assert_allclose(probabilities[0, :2], _softmax(np.array([[1.0, 2.0]]))[0])
    np.testing.assert_allclose(probabilities[1], _softmax(np.array([[4.0, 8.0, 12.0]]))[0])
    np.testing.assert_allclose(probabilities[2, :2], _softmax(np.array([[1.0, 2.0]]))[0])
    assert probabilities[0, 2] == 0.0
    again = Calibrator.from_json(calibrator.to_json(), "here")
    assert again.cells == calibrator.cells and again.thresholds == calibrator.thresholds
    assert again.risks == [0.05] and again.threshold("noul", 0.05) == NEVER
    with pytest.raises(ValueError, match="risk 0.2 was not fitted for this checkpoint: its risks are"):
        again.threshold("choice", 0.2)
    for bad in ({"cells": [{"type": "box", "candidates": 0, "temperature": 1.0, "bias": []}], "abstention": {}},
                {"cells": [{"type": "noul", "candidates": 2, "temperature": -1.0, "bias": []}], "abstention": {}},
                {"cells": [{"type": "noul", "candidates": 2, "temperature": 1.0, "bias": [0.0]}], "abstention": {}},
                {"cells": []}):
        with pytest.raises(ValueError, match="calib.json is not a calibrator"):
            Calibrator.from_json(bad, "calib.json")
    assert Calibrator.per_type({"choice": 2.0, "noul": 1.0, "score": 1.0}).cell("choice", 7).temperature == 2.0


def test_the_clopper_pearson_bound_matches_its_closed_forms():
    # No error in n: the bound solves (1 - p)^n = delta. All errors: 1.
    assert binomial_upper(0, 100, 0.1) == pytest.approx(1 - 0.1 ** (1 / 100), rel=1e-9)
    assert binomial_upper(5, 5, 0.1) == 1.0 and binomial_upper(0, 0, 0.1) == 1.0
    # One error in n: P(X <= 1) = (1 - p)^n + n p (1 - p)^(n - 1) = delta at the bound.
    bound = binomial_upper(1, 50, 0.05)
    assert (1 - bound) ** 50 + 50 * bound * (1 - bound) ** 49 == pytest.approx(0.05, abs=1e-9)


def test_a_risk_threshold_keeps_new_answers_under_the_risk():
    rng = np.random.default_rng(0)

    def draw(count):  # a question's confidence, and whether it is wrong: wrong with chance 1 - confidence
        confidence = rng.uniform(0.3, 1.0, count)
        return confidence, rng.uniform(size=count) > confidence

    confidence, wrong = draw(4000)
    found = risk_threshold(confidence, wrong, 0.05, 0.1)
    assert 0.85 < found["threshold"] < 1.0 and found["bound"] <= 0.05 and 0 < found["coverage"] < 0.2
    assert found["error"] <= found["bound"]
    failures = 0
    for _ in range(20):  # new questions like these: the answered ones err under the risk
        fresh = selective(*draw(4000), found["threshold"])
        failures += fresh["error"] > 0.05
    assert failures <= 4
    # A risk nothing meets abstains on everything.
    assert risk_threshold(np.full(50, 0.9), np.ones(50, dtype=bool), 0.05, 0.1)["threshold"] == NEVER
    curve = risk_coverage(confidence, wrong, points=10)
    assert [point["coverage"] for point in curve] == pytest.approx([step / 10 for step in range(1, 11)])
    assert curve[0]["error"] < curve[-1]["error"] == pytest.approx(wrong.mean())
    assert math.isnan(selective(confidence, wrong, 2.0)["error"])
