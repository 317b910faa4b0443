"""Tests for per-question-type temperature scaling."""

import pytest
import torch

from dohnuts.scoring.calibration import fit_temperatures
from dohnuts.scoring.metrics import masked_softmax, soft_nll

K = 5


def _padded_logits(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random logits with 2..K valid candidates per row and a huge value in the padding."""
    generator = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(rows, K, generator=generator, dtype=torch.float64)
    mask = torch.arange(K) < torch.randint(2, K + 1, (rows, 1), generator=generator)
    return logits.masked_fill(~mask, 1e6), mask


def test_fit_recovers_the_temperature_that_made_soft_targets():
    logits, mask = _padded_logits(200, seed=0)
    targets = masked_softmax(logits, mask, 2.5)
    temperatures = fit_temperatures(logits, mask, targets, ["choice"] * 200)
    assert temperatures["choice"] == pytest.approx(2.5, abs=1e-3)


def test_fit_clamps_temperatures_beyond_the_bounds():
    logits, mask = _padded_logits(40, seed=1)
    # Optimal temperatures are 0.05 for the choice rows and 50 for the score rows.
    targets = torch.cat(
        [masked_softmax(logits[:20], mask[:20], 0.05), masked_softmax(logits[20:], mask[20:], 50.0)]
    )
    kinds = ["choice"] * 20 + ["score"] * 20
    unbounded = fit_temperatures(logits, mask, targets, kinds, bounds=(1e-3, 1e3))
    assert unbounded["choice"] < 0.1 and unbounded["score"] > 10.0
    bounded = fit_temperatures(logits, mask, targets, kinds)
    assert bounded["choice"] == 0.1 and bounded["score"] == 10.0


def test_types_below_min_rows_or_absent_keep_unit_temperature():
    logits, mask = _padded_logits(19, seed=2)
    targets = masked_softmax(logits, mask, 3.0)
    kinds = ["choice"] * 10 + ["score"] * 9
    temperatures = fit_temperatures(logits, mask, targets, kinds)
    assert temperatures.keys() == {"choice", "noul", "score"}
    # Exactly min_rows rows are enough to fit.
    assert temperatures["choice"] == pytest.approx(3.0, abs=1e-2)
    assert temperatures["noul"] == 1.0 and temperatures["score"] == 1.0


def test_fitted_temperatures_do_not_increase_nll():
    logits, mask = _padded_logits(90, seed=3)
    # Noisy soft targets: no temperature fits them exactly, so the optimum is interior.
    generator = torch.Generator().manual_seed(4)
    noise = 2 * torch.randn(90, K, generator=generator, dtype=torch.float64)
    targets = masked_softmax(logits + noise, mask, 2.0)
    kinds = [("choice", "noul", "score")[i % 3] for i in range(90)]
    temperatures = fit_temperatures(logits, mask, targets, kinds)
    assert all(1.0 < t < 10.0 for t in temperatures.values())
    scaled = logits / torch.tensor([temperatures[kind] for kind in kinds], dtype=logits.dtype)[:, None]
    for kind in ("choice", "noul", "score"):
        rows = [i for i, row_kind in enumerate(kinds) if row_kind == kind]
        fitted = soft_nll(scaled[rows], mask[rows], targets[rows])
        assert fitted < soft_nll(logits[rows], mask[rows], targets[rows])


def test_soft_nll_ignores_padding():
    logits = torch.tensor([[0.0, 0.0, 1e6], [0.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False], [True, True, True]])
    targets = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]], dtype=torch.float64)
    # Row 0: -ln(1/2). Row 1: -ln(1/3).
    expected = (torch.log(torch.tensor(2.0)) + torch.log(torch.tensor(3.0))) / 2
    assert soft_nll(logits, mask, targets).item() == pytest.approx(expected.item())

