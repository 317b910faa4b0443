"""Abstention at a chosen risk: confidence thresholds whose answered questions keep their error
under the risk, with a finite-sample bound (Geifman and El-Yaniv's selection with guaranteed risk)."""

from __future__ import annotations

import math

import numpy as np

NEVER = math.inf  # a threshold no confidence reaches: every question of the type abstains


def binomial_upper(errors: int, count: int, delta: float) -> float:
    """The Clopper-Pearson upper bound on an error rate seen as `errors` of `count`: the rate p
    with P(Binomial(count, p) <= errors) = delta (1 when every one is an error or none is seen)."""
    if count == 0 or errors >= count:
        return 1.0
    terms = np.arange(errors + 1, dtype=np.float64)
    choose = math.lgamma(count + 1) - np.array([math.lgamma(i + 1) + math.lgamma(count - i + 1) for i in terms])

    def cdf(p: float) -> float:
        return float(np.exp(np.logaddexp.reduce(choose + terms * math.log(p) + (count - terms) * math.log1p(-p))))

    low, high = errors / count, 1.0
    for _ in range(60):  # the cdf falls as p rises; 60 halvings leave about 1e-18
        middle = (low + high) / 2
        if cdf(middle) > delta:
            low = middle
        else:
            high = middle
    return high


def risk_threshold(confidence: np.ndarray, wrong: np.ndarray, risk: float, delta: float) -> dict:
    """The lowest confidence threshold whose answered questions (confidence >= threshold) have,
    with probability at least 1 - delta, an error rate at most `risk` on new questions like
    these: a binary search over the questions' own confidences, each step's threshold tested
    with the Clopper-Pearson bound at delta / steps (a union bound over the steps, so the one
    returned holds at delta; Geifman & El-Yaniv, "Selective classification for deep neural
    networks", 2017).

    Args:
        confidence: [N] each question's confidence (its most probable answer's probability).
        wrong: [N] bool, whether that answer is wrong.
        risk: the error rate allowed among answered questions, in (0, 1).
        delta: the chance allowed that the bound fails, in (0, 1).

    Returns:
        {"threshold": NEVER when no threshold holds, "coverage", "error", "bound"}: the share
        of these questions answered, their error, and the bound that held.
    """
    order = np.argsort(-np.asarray(confidence, dtype=np.float64), kind="stable")
    ranked, errors = np.asarray(confidence, dtype=np.float64)[order], np.cumsum(np.asarray(wrong, dtype=bool)[order])
    count = len(ranked)
    steps = max(1, math.ceil(math.log2(count + 1)))
    best = {"threshold": NEVER, "coverage": 0.0, "error": 0.0, "bound": None}
    low, high = 0, count - 1  # the answered are the first z + 1 by confidence, ties included
    for _ in range(steps):
        if low > high:
            break
        z = (low + high) // 2
        threshold = ranked[z]
        answered = int(np.searchsorted(-ranked, -threshold, side="right"))  # every tie of the z-th
        bound = binomial_upper(int(errors[answered - 1]), answered, delta / steps)
        if bound <= risk:
            best = {"threshold": float(threshold), "coverage": answered / count,
                    "error": float(errors[answered - 1]) / answered, "bound": bound}
            low = z + 1
        else:
            high = z - 1
    return best


def selective(confidence: np.ndarray, wrong: np.ndarray, threshold: float) -> dict:
    """Coverage and error of the questions answered at `threshold` (NaN error when none is)."""
    answered = np.asarray(confidence) >= threshold
    count = int(answered.sum())
    return {"questions": len(answered), "coverage": count / max(len(answered), 1),
            "error": float(np.asarray(wrong)[answered].mean()) if count else math.nan}


def risk_coverage(confidence: np.ndarray, wrong: np.ndarray, points: int = 50) -> list[dict]:
    """The risk-coverage curve: the error of the most confident questions at `points` coverages
    from 1/points to 1 (plot data)."""
    order = np.argsort(-np.asarray(confidence, dtype=np.float64), kind="stable")
    errors = np.cumsum(np.asarray(wrong, dtype=np.float64)[order])
    count = len(order)
    curve = []
    for step in range(1, points + 1):
        answered = max(1, round(count * step / points))
        if count:
            curve.append({"coverage": answered / count, "error": float(errors[answered - 1] / answered)})
    return curve
