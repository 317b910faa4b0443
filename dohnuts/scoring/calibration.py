"""Per-question-type temperature scaling fitted on held-out logits."""

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
        fitted = _fit_one(logits[rows], mask[rows], targets[rows], lr, iterations)
        temperatures[kind] = min(max(fitted, bounds[0]), bounds[1])
    return temperatures


def calibrated_temperatures(logits: torch.Tensor, mask: torch.Tensor, targets: torch.Tensor, kinds: list[str],
                            **fit) -> tuple[dict[str, float], dict[str, dict]]:
    """`fit_temperatures`, then a guard: a type whose fitted temperature does not lower its
    row-mean NLL on these rows (a clamp at the bounds, a fit that did not converge) keeps 1.0,
    so calibration never raises a type's NLL on the data it was fitted on.

    Args:
        logits, mask, targets, kinds: as `fit_temperatures`; `fit`: its keyword arguments.

    Returns:
        ({type: temperature}, {type: {"rows", "nll_raw", "nll_calibrated", "temperature",
        "kept_at_1", and "reason" when kept at 1}}), a report for every type with rows.
    """
    temperatures = fit_temperatures(logits, mask, targets, kinds, **fit)
    report = {}
    for kind in QUESTION_TYPES:
        rows = torch.tensor([row_kind == kind for row_kind in kinds], dtype=torch.bool)
        if not rows.any():
            continue
        chosen = (logits[rows].double(), mask[rows], targets[rows].double())
        raw = float(soft_nll(*chosen))
        fitted = float(soft_nll(chosen[0].masked_fill(~chosen[1], 0.0) / temperatures[kind], *chosen[1:]))
        entry = {"rows": int(rows.sum()), "nll_raw": raw, "nll_calibrated": fitted, "kept_at_1": False}
        if entry["rows"] < fit.get("min_rows", 10):
            entry.update(kept_at_1=True, reason=f"{entry['rows']} rows, fewer than min_rows")
        elif not fitted < raw:
            entry.update(kept_at_1=True, nll_calibrated=raw,
                         reason=f"the fitted temperature {temperatures[kind]:.4g} gave NLL {fitted:.6g}, "
                                f"not below the raw {raw:.6g}")
            temperatures[kind] = 1.0
        report[kind] = {**entry, "temperature": temperatures[kind]}
    return temperatures, report


def _fit_one(logits, mask, targets, lr: float, iterations: int) -> float:
    """LBFGS on log T, so T stays positive without a constrained optimiser."""
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


def apply_temperatures(
    logits: torch.Tensor, kinds: list[str], temperatures: dict[str, float]
) -> torch.Tensor:
    """Divide each row's logits by its question type's temperature.

    Args:
        logits: [B, K] float logits.
        kinds: B question types, keys of temperatures.
        temperatures: {type: temperature}, as from fit_temperatures.

    Returns:
        [B, K] scaled logits.
    """
    scale = torch.tensor([temperatures[kind] for kind in kinds], dtype=logits.dtype)
    return logits / scale.to(logits.device).unsqueeze(1)
