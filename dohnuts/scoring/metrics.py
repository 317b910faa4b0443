"""Per-row and per-group evaluation metrics for padded candidate logits."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import torch

PROB_FLOOR = 1e-12
ECE_BINS = 15
MIN_FAMILY_ROWS = 8


def masked_softmax(logits: torch.Tensor, mask: torch.Tensor, temperature=1.0) -> torch.Tensor:
    """Softmax over each row's valid candidates.

    Args:
        logits: [B, K] float logits, padded.
        mask: [B, K] bool, True at valid candidates (at least one per row).
        temperature: a float, or a [B] tensor with one temperature per row.

    Returns:
        [B, K] probabilities summing to 1 over valid candidates, 0 at invalid ones.
    """
    temperature = torch.as_tensor(temperature, dtype=logits.dtype, device=logits.device)
    # Zero the padding before dividing so non-finite padded logits cannot leak into valid ones.
    scaled = logits.masked_fill(~mask, 0.0) / temperature.reshape(-1, 1)
    return torch.softmax(scaled.masked_fill(~mask, -math.inf), dim=-1)


def masked_softmax_rows(logits: np.ndarray, mask: np.ndarray, temperatures: np.ndarray) -> np.ndarray:
    """`masked_softmax` in float64 numpy, one temperature a row: for a request's few rows, five
    numpy operations cost a third of the host time of the torch operations (whose dispatch
    dominates at this size).

    Args:
        logits: [B, K] float logits, padded. mask: [B, K] bool, True at valid candidates (at
            least one a row). temperatures: [B] positive.

    Returns:
        [B, K] float64 probabilities summing to 1 over valid candidates, 0 at invalid ones.
    """
    with np.errstate(invalid="ignore"):  # a NaN or infinite valid logit gives NaN, as torch does, silently
        scaled = np.where(mask, logits.astype(np.float64) / temperatures[:, None], -np.inf)
        weights = np.exp(scaled - scaled.max(axis=1, keepdims=True))
        return weights / weights.sum(axis=1, keepdims=True)


def normalised_entropy_confidence(probs: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """1 - entropy / log K of each row's valid candidates (K of them, at least 2): the confidence
    `schema.answer` gives a choice or score question, for a batch's rows at once.

    Args:
        probs: [B, K] probabilities, 0 at invalid candidates. mask: [B, K] bool.

    Returns:
        [B] float64.
    """
    logs = np.log(np.where(probs > 0, probs, 1.0))  # 0 log 0 counts as 0
    entropy = -(probs * logs).sum(axis=1)
    return 1.0 - entropy / np.log(mask.sum(axis=1))


def masked_log_softmax(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Log-softmax over each row's valid candidates: [B, K] -> [B, K], -inf where masked.

    The one masked log-softmax of the objective, the calibration fit and the metrics.
    """
    return torch.log_softmax(logits.masked_fill(~mask, -math.inf), dim=-1)


def soft_nll(logits: torch.Tensor, mask: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean over rows of -sum y * log_softmax(logits) over valid candidates: the cross-entropy
    of soft targets, which training minimises and calibration fits.

    Args:
        logits: [B, K] float logits, padded.
        mask: [B, K] bool, True at valid candidates.
        targets: [B, K] target distribution over valid candidates, 0 elsewhere.

    Returns:
        A scalar tensor.
    """
    log_probs = masked_log_softmax(logits, mask).masked_fill(~mask, 0.0)
    return -(targets * log_probs).sum(dim=-1).mean()


def row_metrics(
    probs: torch.Tensor, mask: torch.Tensor, targets: torch.Tensor, ordinal: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Per-row scores of predicted probabilities against target distributions.

    Args:
        probs: [B, K] probabilities, 0 at invalid candidates (as from masked_softmax).
        mask: [B, K] bool, valid candidates as a prefix of each row, at least 2 per row.
        targets: [B, K] target distribution over valid candidates (may be soft), 0 elsewhere.
        ordinal: [B] bool, True where candidates are ordered levels ("score" rows).

    Returns:
        A dict of [B] float tensors: "correct", "soft_correct", "nll", "brier",
        "confidence", and the ordinal-only "rps" and "abs_error" (NaN on other rows).
    """
    # Invalid entries are 0 in both and every row has positive mass, so argmax stays valid;
    # torch.argmax breaks ties towards the lowest index.
    pred = probs.argmax(dim=-1)
    label = targets.argmax(dim=-1)
    rps, abs_error = _ordinal_errors(probs, mask, targets)
    nan = torch.full_like(rps, math.nan)
    return {
        "correct": (pred == label).to(probs.dtype),
        "soft_correct": targets.gather(1, pred.unsqueeze(1)).squeeze(1),
        "nll": -(targets * probs.clamp_min(PROB_FLOOR).log()).sum(dim=-1),
        "brier": ((probs - targets) ** 2 * mask).sum(dim=-1),
        "confidence": probs.max(dim=-1).values,
        "rps": torch.where(ordinal, rps, nan),
        "abs_error": torch.where(ordinal, abs_error, nan),
    }


def ranked_probability_score(probs: torch.Tensor, mask: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean over the first K_valid - 1 levels of squared CDF differences. Shapes [..., K] -> [...]."""
    levels = torch.arange(probs.shape[-1], device=probs.device)
    num_valid = mask.sum(dim=-1, keepdim=True)
    # The last valid level's cumulative sums are both 1, so it is left out of the mean.
    scored_levels = levels < num_valid - 1
    cumulative_gap = (probs.cumsum(dim=-1) - targets.cumsum(dim=-1)) ** 2
    return (cumulative_gap * scored_levels).sum(dim=-1) / (num_valid.squeeze(-1) - 1).clamp(min=1)


def _ordinal_errors(probs, mask, targets) -> tuple[torch.Tensor, torch.Tensor]:
    """Ranked probability score and expected-level error, computed for every row."""
    levels = torch.arange(probs.shape[-1], device=probs.device)
    expected_gap = ((probs - targets) * levels.to(probs.dtype)).sum(dim=-1)
    return ranked_probability_score(probs, mask, targets), expected_gap.abs()


def ece(confidence, correct, bins: int = ECE_BINS) -> float:
    """Expected calibration error over equal-width confidence bins of [0, 1].

    Bins are [i/bins, (i+1)/bins), except the last, which also holds a confidence of 1.0.

    Args:
        confidence: [B] max probability per row (tensor, array or Series).
        correct: [B] 1.0 where the prediction is right, else 0.0.
        bins: number of bins.

    Returns:
        sum over bins of |bin| / B * |mean correct - mean confidence|.
    """
    _, correct_sum, confidence_sum = _binned(confidence, correct, bins)
    # |bin| / B * |mean gap| equals |sum of gaps in the bin| / B.
    return float(np.abs(correct_sum - confidence_sum).sum() / len(_as_numpy(confidence)))


def reliability(confidence, correct, bins: int = ECE_BINS) -> list[dict]:
    """The reliability diagram of `ece`'s bins: per non-empty bin its index, row count, mean
    confidence and accuracy (plain floats, ready for JSON)."""
    counts, correct_sum, confidence_sum = _binned(confidence, correct, bins)
    return [{"bin": int(index), "rows": int(counts[index]), "confidence": float(confidence_sum[index] / counts[index]),
             "accuracy": float(correct_sum[index] / counts[index])} for index in np.flatnonzero(counts)]


def _binned(confidence, correct, bins: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per equal-width confidence bin: row counts, sums of correct and sums of confidence."""
    confidence = _as_numpy(confidence)
    correct = _as_numpy(correct)
    index = np.clip(np.floor(confidence * bins).astype(int), 0, bins - 1)
    return (np.bincount(index, minlength=bins), np.bincount(index, weights=correct, minlength=bins),
            np.bincount(index, weights=confidence, minlength=bins))


def macro_f1(pred, true, num_classes: int) -> float:
    """Mean F1 over classes that occur in either the predictions or the labels.

    Only meaningful when candidate index i means the same thing on every row.

    Args:
        pred: [B] predicted class indices.
        true: [B] true class indices.
        num_classes: upper bound (exclusive) on the indices.

    Returns:
        The unweighted mean of per-class F1.
    """
    pred = _as_numpy(pred).astype(int)
    true = _as_numpy(true).astype(int)
    confusion = np.bincount(true * num_classes + pred, minlength=num_classes**2)
    confusion = confusion.reshape(num_classes, num_classes)
    # F1 = 2 TP / (2 TP + FP + FN) = 2 TP / (true count + predicted count).
    support = confusion.sum(axis=0) + confusion.sum(axis=1)
    present = support > 0
    return float(np.mean(2 * np.diag(confusion)[present] / support[present]))


def summarize(rows: pd.DataFrame, min_family_rows: int = MIN_FAMILY_ROWS) -> dict:
    """Aggregate per-row metrics into per-group and macro-averaged reports.

    Args:
        rows: one row per question with columns group, correct, soft_correct, nll, brier,
            confidence, rps, abs_error (NaN off ordinal rows), pred, label, num_candidates,
            family (questions of one family have the same type and candidate labels in
            the same order, so their candidate indices share meaning).
        min_family_rows: families smaller than this get no macro-F1.

    Returns:
        {"groups": {group: metrics}, "macro": metrics averaged unweighted over the groups
        that have each key ("rows" is the total)}, with plain floats and ints and no NaN:
        "rps" and "mae" appear only for groups with ordinal rows, "macro_f1" (the mean over
        the group's families of at least `min_family_rows` rows) only where one exists.
    """
    groups = {name: _group_metrics(group, min_family_rows) for name, group in rows.groupby("group", sort=True)}
    keys = dict.fromkeys(key for metrics in groups.values() for key in metrics if key != "rows")
    macro = {
        key: float(np.mean([metrics[key] for metrics in groups.values() if key in metrics]))
        for key in keys
    }
    return {"groups": groups, "macro": {"rows": int(len(rows)), **macro}}


def _group_metrics(group: pd.DataFrame, min_family_rows: int) -> dict:
    metrics = {
        "rows": len(group),
        "accuracy": float(group["correct"].mean()),
        "soft_accuracy": float(group["soft_correct"].mean()),
        "nll": float(group["nll"].mean()),
        "brier": float(group["brier"].mean()),
        "ece": ece(group["confidence"], group["correct"]),
        "chance": float((1.0 / group["num_candidates"]).mean()),
    }
    # Ordinal rows are the ones whose rps is defined; NaN marks the others.
    ordinal = group["rps"].notna()
    if ordinal.any():
        metrics["rps"] = float(group.loc[ordinal, "rps"].mean())
        metrics["mae"] = float(group.loc[ordinal, "abs_error"].mean())
    scores = [macro_f1(family["pred"], family["label"], int(family["num_candidates"].max()))
              for _, family in group.groupby("family", sort=True) if len(family) >= min_family_rows]
    if scores:
        metrics["macro_f1"] = float(np.mean(scores))
    return metrics


def _as_numpy(values) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu()
    return np.asarray(values, dtype=float)
