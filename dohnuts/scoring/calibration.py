"""Temperature scaling fitted on held-out logits: one temperature a question type (the calibrator's
`type` family, `scoring.calibrator`)."""

from __future__ import annotations

import math

import torch

from ..schema import QUESTION_TYPES
from .metrics import soft_nll


def fit_temperatures(
    logits: torch.Tensor,
    mask: torch.Tensor,
    targets: torch.Tensor,
    kinds: list[str],
    min_rows: int = 10,
    lr: float = 0.1,
    iterations: int = 100,
    bounds: tuple[float, float] = (0.1, 10.0),
) -> dict[str, float]:
    """Fit one temperature per question type by minimising the soft-target NLL.

    Args:
        logits: [B, K] float logits, padded.
        mask: [B, K] bool, True at valid candidates.
        targets: [B, K] target distribution over valid candidates, 0 elsewhere.
        kinds: B question types, each one of QUESTION_TYPES.
        min_rows: types with fewer rows than this keep temperature 1.0.
        lr: LBFGS learning rate on log T.
        iterations: LBFGS max_iter for its single step.
        bounds: (low, high) range the fitted temperature is clamped to.

    Returns:
        {type: temperature} for every type in QUESTION_TYPES.
    """
    temperatures = {}
    for kind in QUESTION_TYPES:
        rows = [i for i, row_kind in enumerate(kinds) if row_kind == kind]
        if len(rows) < min_rows:
            temperatures[kind] = 1.0
            continue
        fitted = fit_temperature(logits[rows], mask[rows], targets[rows], lr, iterations)
        temperatures[kind] = min(max(fitted, bounds[0]), bounds[1])
    return temperatures


def fit_temperature(logits, mask, targets, lr: float, iterations: int) -> float:
    """The one temperature of these rows (unclamped): LBFGS on log T, so T stays positive without
    a constrained optimiser."""
    # Zero the padding before dividing by T: a non-finite padded logit would make the
    # gradient through the division NaN even though its softmax weight is masked.
    logits = logits.double().masked_fill(~mask, 0.0)
    targets = targets.double()
    log_t = torch.zeros((), dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.LBFGS([log_t], lr=lr, max_iter=iterations)

    def closure():
        optimizer.zero_grad()
        loss = soft_nll(logits / log_t.exp(), mask, targets)
        loss.backward()
        return loss

    optimizer.step(closure)
    return math.exp(log_t.item())

