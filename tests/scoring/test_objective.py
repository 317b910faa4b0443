"""The RLCD + cross-entropy objective against the recipe's reference values."""

import json
from pathlib import Path

import pytest
import torch

from dohnuts.config import ObjectiveConfig
from dohnuts.scoring.objective import rlcd_loss

CASES = json.loads((Path(__file__).parents[1] / "fixtures" / "rlcd_cases.json").read_text())["cases"]


def _inputs(case):
    logits = torch.tensor(case["logits"], dtype=torch.float32, requires_grad=True)
    return logits, torch.tensor(case["mask"]), torch.tensor(case["targets"]), torch.tensor(case["ordinal"])


@pytest.mark.parametrize("case", CASES, ids=lambda case: f"ce_weight={case['ce_weight']}")
def test_rlcd_reproduces_reference_loss_gradient_and_reward(case):
    logits, mask, targets, ordinal = _inputs(case)
    torch.manual_seed(case["seed"])
    out = rlcd_loss(logits, mask, targets, ordinal, ObjectiveConfig(ce_weight=case["ce_weight"]))
    out.loss.backward()
    torch.testing.assert_close(out.loss, torch.tensor(case["loss"]), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(logits.grad, torch.tensor(case["gradient"]), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(out.reward_mean, torch.tensor(case["reward_mean"]), atol=1e-5, rtol=0)


def test_distribution_targets_equal_index_targets_and_a_generator_replaces_the_global_seed():
    case = CASES[1]
    logits, mask, targets, ordinal = _inputs(case)
    one_hot = torch.nn.functional.one_hot(targets, logits.shape[-1]).float()
    generator = torch.Generator().manual_seed(case["seed"])
    out = rlcd_loss(logits, mask, one_hot, ordinal, ObjectiveConfig(ce_weight=case["ce_weight"]), generator)
    torch.testing.assert_close(out.loss, torch.tensor(case["loss"]), atol=1e-6, rtol=1e-5)


def test_masked_candidates_get_no_gradient_and_soft_targets_are_supported():
    logits = torch.zeros((3, 5), requires_grad=True)
    mask = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.bool)
    targets = torch.tensor([[0.3, 0.7, 0, 0, 0], [0.1, 0.2, 0.4, 0.2, 0.1], [0, 0, 1.0, 0, 0]])
    out = rlcd_loss(logits, mask, targets, torch.tensor([False, True, True]), ObjectiveConfig())
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert (logits.grad[~mask] == 0).all() and (logits.grad[mask] != 0).any()
