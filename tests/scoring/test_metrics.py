"""Tests for the per-row and per-group evaluation metrics."""

import json
import math

import numpy as np
import pandas as pd
import pytest
import torch

from dohnuts.scoring.metrics import (
    ece,
    macro_f1,
    masked_softmax,
    masked_softmax_rows,
    normalised_entropy_confidence,
    reliability,
    row_metrics,
    summarize,
)

# Three rows padded to K = 4:
#   row 0: 3 valid, not ordinal, one-hot target on index 0.
#   row 1: 3 valid, ordinal, one-hot target on index 2.
#   row 2: 4 valid, ordinal, soft target split over indices 1 and 2 (argmax ties).
PROBS = torch.tensor(
    [
        [0.5, 0.3, 0.2, 0.0],
        [0.2, 0.5, 0.3, 0.0],
        [0.1, 0.4, 0.4, 0.1],
    ],
    dtype=torch.float64,
)
MASK = torch.tensor(
    [
        [True, True, True, False],
        [True, True, True, False],
        [True, True, True, True],
    ]
)
TARGETS = torch.tensor(
    [
        [1.0, 0.0, 0.0, 0.0],
        [0.0, 0.0, 1.0, 0.0],
        [0.0, 0.5, 0.5, 0.0],
    ],
    dtype=torch.float64,
)
ORDINAL = torch.tensor([False, True, True])


@pytest.fixture
def metrics():
    return row_metrics(PROBS, MASK, TARGETS, ORDINAL)


def test_masked_softmax_zeroes_padding_and_normalises_valid_candidates():
    logits = torch.tensor([[1.0, 2.0, 1e9], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False], [True, True, True]])
    probs = masked_softmax(logits, mask)
    # Row 0: softmax([1, 2]) = [1, e] / (1 + e); the huge padded logit is ignored.
    expected_row0 = torch.tensor([1.0, math.e]) / (1.0 + math.e)
    torch.testing.assert_close(probs[0, :2], expected_row0)
    assert probs[0, 2] == 0.0
    torch.testing.assert_close(probs[1], torch.full((3,), 1 / 3))


def test_masked_softmax_applies_per_row_temperature():
    logits = torch.tensor([[2.0, 0.0], [2.0, 0.0]])
    mask = torch.ones(2, 2, dtype=torch.bool)
    probs = masked_softmax(logits, mask, torch.tensor([1.0, 2.0]))
    # Row 1 at T = 2 equals softmax([1, 0]).
    torch.testing.assert_close(probs[1], torch.softmax(torch.tensor([1.0, 0.0]), dim=0))
    torch.testing.assert_close(probs[0], torch.softmax(logits[0], dim=0))


def test_numpy_masked_softmax_rows_equal_the_torch_reference():
    """The served path's numpy softmax (one temperature a row) against torch's division then
    `masked_softmax`, padding holding huge and non-finite logits: equal to 1e-12."""
    generator = torch.Generator().manual_seed(3)
    logits = 4 * torch.randn(40, 7, generator=generator)
    mask = torch.arange(7) < torch.randint(1, 8, (40, 1), generator=generator)
    logits = logits.masked_fill(~mask, 1e9)
    logits[0, -1], logits[1, -1] = math.inf, math.nan
    mask[0, -1] = mask[1, -1] = False
    kinds = [("choice", "noul", "score")[index % 3] for index in range(40)]
    temperatures = {"choice": 0.7, "noul": 1.9, "score": 1.2}
    divisors = torch.tensor([temperatures[kind] for kind in kinds], dtype=torch.float64)
    expected = masked_softmax(logits.double() / divisors[:, None], mask)
    ours = masked_softmax_rows(logits.numpy(), mask.numpy(), np.array([temperatures[kind] for kind in kinds]))
    np.testing.assert_allclose(ours, expected.numpy(), rtol=0, atol=1e-12)
    assert (ours[~mask.numpy()] == 0).all()


def test_batch_confidences_equal_the_per_question_formula():
    """`normalised_entropy_confidence` (the served path, all rows at once) against `answer`'s own
    1 - entropy / log K, zero probabilities included: equal to 1e-12."""
    generator = torch.Generator().manual_seed(4)
    mask = torch.arange(6) < torch.randint(2, 7, (30, 1), generator=generator)
    probs = masked_softmax(8 * torch.randn(30, 6, generator=generator, dtype=torch.float64), mask)
    probs[0, 1] = 0.0  # a candidate with no mass
    ours = normalised_entropy_confidence(probs.numpy(), mask.numpy())
    for row, valid, confidence in zip(probs.tolist(), mask.sum(1).tolist(), ours):
        p = row[:valid]
        entropy = -sum(value * math.log(value) for value in p if value > 0)
        assert confidence == pytest.approx(1.0 - entropy / math.log(valid), abs=1e-12)


def test_correct_breaks_argmax_ties_towards_lowest_index(metrics):
    # Row 0: pred 0 = label 0. Row 1: pred 1 != label 2. Row 2: both tie on {1, 2} -> 1 = 1.
    assert metrics["correct"].tolist() == [1.0, 0.0, 1.0]


def test_soft_correct_is_target_mass_at_prediction(metrics):
    # Row 2's predicted index 1 carries half the target mass.
    assert metrics["soft_correct"].tolist() == [1.0, 0.0, 0.5]


def test_soft_correct_equals_correct_for_one_hot_targets():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(50, 6, generator=generator)
    mask = torch.arange(6) < torch.randint(2, 7, (50, 1), generator=generator)
    labels = (torch.rand(50, generator=generator) * mask.sum(1)).long()
    targets = torch.nn.functional.one_hot(labels, 6).double()
    probs = masked_softmax(logits.double(), mask)
    result = row_metrics(probs, mask, targets, torch.zeros(50, dtype=torch.bool))
    assert 0 < result["correct"].sum() < 50
    torch.testing.assert_close(result["soft_correct"], result["correct"])


def test_nll_brier_and_confidence_match_hand_values(metrics):
    # nll:   -ln 0.5;  -ln 0.3;  -(0.5 ln 0.4 + 0.5 ln 0.4) = -ln 0.4
    # brier: 0.25 + 0.09 + 0.04 = 0.38;  0.04 + 0.25 + 0.49 = 0.78;  4 * 0.01 = 0.04
    torch.testing.assert_close(
        metrics["nll"], -torch.log(torch.tensor([0.5, 0.3, 0.4], dtype=torch.float64))
    )
    torch.testing.assert_close(metrics["brier"], torch.tensor([0.38, 0.78, 0.04], dtype=torch.float64))
    torch.testing.assert_close(metrics["confidence"], torch.tensor([0.5, 0.5, 0.4], dtype=torch.float64))


def test_nll_floors_zero_probability_at_the_target():
    probs = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    targets = torch.tensor([[0.0, 1.0]], dtype=torch.float64)
    result = row_metrics(probs, torch.ones(1, 2, dtype=torch.bool), targets, torch.tensor([False]))
    assert result["nll"].item() == pytest.approx(-math.log(1e-12))


def test_ordinal_errors_match_hand_values_and_are_nan_off_ordinal_rows(metrics):
    # Row 1: cumsum p = [0.2, 0.7], cumsum y = [0, 0] over the first 2 levels
    #   -> rps = (0.04 + 0.49) / 2 = 0.265; E[p] = 0.5 + 0.6 = 1.1, E[y] = 2 -> 0.9.
    # Row 2: cumsum p = [0.1, 0.5, 0.9], cumsum y = [0, 0.5, 1.0]
    #   -> rps = (0.01 + 0 + 0.01) / 3; E[p] = 0.4 + 0.8 + 0.3 = 1.5 = E[y] -> 0.
    assert math.isnan(metrics["rps"][0]) and math.isnan(metrics["abs_error"][0])
    assert metrics["rps"][1:].tolist() == pytest.approx([0.265, 0.02 / 3])
    assert metrics["abs_error"][1:].tolist() == pytest.approx([0.9, 0.0])


def test_ece_is_zero_when_every_bin_is_calibrated():
    # Bin of 0.8: 8 of 10 right. Bin of 0.6: 3 of 5 right.
    confidence = [0.8] * 10 + [0.6] * 5
    correct = [1] * 8 + [0] * 2 + [1] * 3 + [0] * 2
    assert ece(confidence, correct) == pytest.approx(0.0)


def test_ece_matches_hand_value_per_bin():
    # Bin [14/15, 1]: two rows at 0.95, accuracy 0.5 -> 2/4 * 0.45.
    # Bin [8/15, 9/15): two rows at 0.55, accuracy 1.0 -> 2/4 * 0.45. Total 0.45.
    # A single bin would see mean confidence 0.75 = accuracy 0.75 and report 0.
    assert ece([0.95, 0.95, 0.55, 0.55], [1, 0, 1, 1]) == pytest.approx(0.45)


def test_ece_puts_confidence_one_in_the_last_bin():
    # 1.0 shares the last bin with 0.94: |(0 + 1) - (1.0 + 0.94)| / 2 = 0.47.
    # A separate bin for 1.0 would give (|0 - 1.0| + |1 - 0.94|) / 2 = 0.53.
    assert ece(torch.tensor([1.0, 0.94]), torch.tensor([0.0, 1.0])) == pytest.approx(0.47)


def test_macro_f1_averages_over_classes_seen_in_labels_or_predictions():
    # Class 0: TP 1, FP 1, FN 1 -> 0.5. Class 1: TP 2, FP 1, FN 0 -> 0.8.
    # Class 2: TP 0, FN 1 -> 0. Class 3 never occurs and is skipped: (0.5 + 0.8 + 0) / 3.
    score = macro_f1(np.array([0, 1, 1, 1, 0]), np.array([0, 0, 1, 1, 2]), num_classes=4)
    assert score == pytest.approx(1.3 / 3)


def _rows(group, correct, rps, families):
    count = len(correct)
    return pd.DataFrame(
        {
            "group": group,
            "correct": correct,
            "soft_correct": correct,
            "nll": [0.5] * count,
            "brier": [0.2] * count,
            "confidence": [0.75] * count,
            "rps": rps,
            "abs_error": [math.nan if math.isnan(r) else 2 * r for r in rps],
            "pred": [0] * count,
            "label": [0 if c else 1 for c in correct],
            "num_candidates": [2] * count,
            "family": families,
        }
    )


@pytest.fixture
def summary():
    # Each choice row has its own candidate list (no shared meaning); the score rows share one.
    choice = _rows("choice", [1.0, 1.0], [math.nan, math.nan], families=["c:a|b", "c:b|a"])
    score = _rows("score", [1.0, 0.0, 0.0, 0.0], [0.1, 0.3, 0.2, 0.2], families="s:0|1")
    return summarize(pd.concat([choice, score], ignore_index=True), min_family_rows=2)


def test_summarize_reports_ordinal_and_f1_keys_only_where_they_apply(summary):
    choice, score = summary["groups"]["choice"], summary["groups"]["score"]
    assert not {"rps", "mae", "macro_f1"} & choice.keys()
    assert score["rps"] == pytest.approx(0.2)
    assert score["mae"] == pytest.approx(0.4)
    # Score preds [0, 0, 0, 0] vs labels [0, 1, 1, 1]: class 0 F1 = 2/5, class 1 F1 = 0.
    assert score["macro_f1"] == pytest.approx(0.2)
    assert score["rows"] == 4 and score["chance"] == pytest.approx(0.5)
    # Every score row has confidence 0.75 in one bin at accuracy 0.25.
    assert score["ece"] == pytest.approx(0.5)


def test_summarize_macro_averages_groups_unweighted(summary):
    macro = summary["macro"]
    # Unweighted (1.0 + 0.25) / 2; weighting by rows would give 3 / 6 = 0.5.
    assert macro["accuracy"] == pytest.approx(0.625)
    # Only the score group has rps, mae and macro_f1.
    assert macro["rps"] == pytest.approx(0.2)
    assert macro["macro_f1"] == pytest.approx(0.2)


def test_summarize_returns_plain_json_without_nan(summary):
    text = json.dumps(summary, allow_nan=False)
    assert json.loads(text) == summary
    assert type(summary["groups"]["choice"]["rows"]) is int
    assert summary["macro"]["rows"] == 6  # the total, not a mean


def test_reliability_bins_are_the_eces_and_json_ready():
    confidence = torch.tensor([0.05, 0.5, 0.52, 0.99, 1.0])
    correct = torch.tensor([0.0, 1.0, 0.0, 1.0, 1.0])
    bins = reliability(confidence, correct)
    assert json.loads(json.dumps(bins)) == bins
    assert [row["bin"] for row in bins] == [0, 7, 14] and [row["rows"] for row in bins] == [1, 2, 2]
    assert bins[1]["confidence"] == pytest.approx(0.51) and bins[1]["accuracy"] == 0.5
    gaps = sum(row["rows"] / 5 * abs(row["accuracy"] - row["confidence"]) for row in bins)
    assert gaps == pytest.approx(ece(confidence, correct))
