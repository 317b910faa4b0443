"""The served calibrator: a row's logits z become z / T + b by what a served row carries (its
question type and number of candidates), the family of cells chosen by cross-validation and
guarded so that no group's ECE rises (a type's family steps down to a gentler one where a group
of that type would get worse); and its abstention thresholds.

Families, gentlest first:
- none: the raw logits;
- mix: the raw probabilities mixed with the uniform, p' = (1 - m) p + m / K, one m a type: it
  bounds how sure an answer can be, which lowers the NLL of confident mistakes and barely moves
  the confidence of the many confident right answers;
- type: one temperature a question type (`calibration.fit_temperatures`);
- count: a temperature for each (type, number of candidates) with enough rows, the type's
  temperature for the others;
- bias: as count, plus a bias a candidate place for noul and score questions, whose places
  mean the same in every question (false/true, level i); a choice's places do not.
A row takes its (type, count) cell, else its type's cell (count 0), else the identity.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..schema import QUESTION_TYPES
from .abstention import NEVER, risk_threshold
from .calibration import fit_temperature, fit_temperatures
from .metrics import PROB_FLOOR, ece, masked_softmax_rows, soft_nll

FAMILIES = ("none", "mix", "type", "count", "bias")
TYPE_WIDE = 0  # the candidate count of a type's own cell
BIASED = ("noul", "score")  # types whose candidate places mean the same in every question


@dataclass(frozen=True)
class Cell:
    """Logits z of a row become z / temperature + bias (bias: one a candidate place, or none);
    their softmax p then becomes (1 - mix) p + mix / K."""

    temperature: float = 1.0
    bias: tuple[float, ...] = ()
    mix: float = 0.0


IDENTITY = Cell()


class Calibrator:
    """Calibrated probabilities of served rows (see the module) and abstention thresholds:
    `thresholds[type][risk]`, the confidence from which an answer of that type is given at
    that risk (`abstention.NEVER`: never)."""

    def __init__(self, cells: Mapping[tuple[str, int], Cell] | None = None,
                 thresholds: Mapping[str, Mapping[float, float]] | None = None):
        self.cells = dict(cells or {})
        self.thresholds = {kind: dict(by_risk) for kind, by_risk in (thresholds or {}).items()}

    @classmethod
    def per_type(cls, temperatures: Mapping[str, float]) -> Calibrator:
        """The calibrator of one temperature a type (a checkpoint's `temperatures.json`)."""
        return cls({(kind, TYPE_WIDE): Cell(float(value)) for kind, value in temperatures.items()})

    def key(self, kind: str, count: int) -> tuple[str, int] | None:
        """The cell a row of `kind` with `count` candidates takes, or None (the identity)."""
        for key in ((kind, count), (kind, TYPE_WIDE)):
            if key in self.cells:
                return key
        return None

    def cell(self, kind: str, count: int) -> Cell:
        key = self.key(kind, count)
        return IDENTITY if key is None else self.cells[key]

    def probabilities(self, logits: np.ndarray, mask: np.ndarray, kinds: Sequence[str]) -> np.ndarray:
        """[B, K] calibrated probabilities, 0 at invalid places (mask [B, K], valid places first)."""
        counts = mask.sum(axis=1)
        cells = [self.cell(kind, count) for kind, count in zip(kinds, counts)]
        scaled = np.asarray(logits, dtype=np.float64) / np.array([cell.temperature for cell in cells])[:, None]
        for row, (cell, count) in enumerate(zip(cells, counts)):
            if cell.bias:
                scaled[row, :count] += cell.bias
        out = masked_softmax_rows(scaled, mask, np.ones(len(counts)))
        for row, (cell, count) in enumerate(zip(cells, counts)):
            if cell.mix:
                out[row, :count] = (1 - cell.mix) * out[row, :count] + cell.mix / count
        return out

    @property
    def risks(self) -> list[float]:
        """The risks every type has a threshold for."""
        found = [set(by_risk) for by_risk in self.thresholds.values()]
        return sorted(set.intersection(*found)) if len(found) == len(QUESTION_TYPES) else []

    def threshold(self, kind: str, risk: float) -> float:
        """The confidence from which an answer of `kind` is given at `risk`.

        Raises:
            ValueError: no threshold was fitted for `risk`.
        """
        if risk not in self.risks:
            raise ValueError(f"risk {risk!r} was not fitted for this checkpoint: its risks are {self.risks} "
                             f"(calibrate.risks)")
        return self.thresholds[kind][risk]

    def to_json(self) -> dict:
        return {"cells": [{"type": kind, "candidates": count, "temperature": cell.temperature,
                           "bias": list(cell.bias), "mix": cell.mix}
                          for (kind, count), cell in sorted(self.cells.items())],
                "abstention": {kind: {repr(risk): None if threshold == NEVER else threshold
                                      for risk, threshold in sorted(by_risk.items())}
                               for kind, by_risk in sorted(self.thresholds.items())}}

    @classmethod
    def from_json(cls, data: dict, where: str) -> Calibrator:
        """The calibrator `to_json` wrote; ValueError naming `where` and the bad entry otherwise."""
        try:
            cells = {}
            for entry in data["cells"]:
                kind, count, temperature, bias = entry["type"], int(entry["candidates"]), entry["temperature"], \
                    tuple(float(value) for value in entry["bias"])
                mix = float(entry.get("mix", 0.0))
                if not 0.0 <= mix < 1.0:
                    raise ValueError(entry)
                if kind not in QUESTION_TYPES or count < 0 or not (isinstance(temperature, (int, float))
                                                                   and 0 < temperature < math.inf):
                    raise ValueError(entry)
                if bias and (count == TYPE_WIDE or len(bias) != count or not all(map(math.isfinite, bias))):
                    raise ValueError(entry)
                cells[kind, count] = Cell(float(temperature), bias, mix)
            thresholds = {}
            for kind, by_risk in data["abstention"].items():
                if kind not in QUESTION_TYPES:
                    raise ValueError(kind)
                thresholds[kind] = {float(risk): NEVER if value is None else float(value)
                                    for risk, value in by_risk.items()}
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"{where} is not a calibrator (cells of a known type with a positive temperature "
                             f"and a bias a candidate or none; abstention thresholds by type): {error!r}") from None
        return cls(cells, thresholds)


@dataclass(frozen=True)
class Rows:
    """The calibration rows: padded logits, mask and targets [B, K] float64, and per row its
    type, candidate count, group and fold."""

    logits: np.ndarray
    mask: np.ndarray
    targets: np.ndarray
    kinds: np.ndarray
    counts: np.ndarray
    groups: np.ndarray
    folds: np.ndarray

    @classmethod
    def of(cls, logits, mask, targets, kinds, groups, state_ids, folds: int) -> Rows:
        digests = [int(hashlib.sha256(str(state).encode()).hexdigest()[:8], 16) % folds for state in state_ids]
        mask = np.asarray(mask, dtype=bool)
        return cls(np.asarray(logits, dtype=np.float64), mask, np.asarray(targets, dtype=np.float64),
                   np.asarray(kinds), mask.sum(axis=1), np.asarray(groups), np.array(digests))

    def where(self, chosen: np.ndarray) -> Rows:
        return Rows(*(getattr(self, name)[chosen] for name in self.__dataclass_fields__))

    def probabilities(self, calibrator: Calibrator | None = None) -> np.ndarray:
        return (calibrator or Calibrator()).probabilities(self.logits, self.mask, self.kinds)

    def nll(self, calibrator: Calibrator) -> np.ndarray:
        """[B] each row's soft-target NLL under `calibrator`."""
        return -(self.targets * np.log(np.maximum(self.probabilities(calibrator), PROB_FLOOR))).sum(axis=1)


@dataclass(frozen=True)
class Fit:
    """How cells are fitted: `min_rows` a cell; LBFGS `lr` and `iterations`; temperature `bounds`."""

    min_rows: int = 10
    lr: float = 0.1
    iterations: int = 100
    bounds: tuple[float, float] = (0.1, 10.0)


def fit_family(family: str, rows: Rows, fit: Fit) -> dict[tuple[str, int], Cell]:
    """The cells of `family` fitted on `rows` (only cells with at least fit.min_rows rows)."""
    cells = {}
    if family == "none":
        return cells
    if family != "mix":
        type_wide = fit_temperatures(*_tensors(rows), list(rows.kinds), fit.min_rows, fit.lr, fit.iterations,
                                     fit.bounds)
    for kind in QUESTION_TYPES:
        of_kind = rows.kinds == kind
        if of_kind.sum() < fit.min_rows:
            continue
        if family == "mix":
            cells[kind, TYPE_WIDE] = Cell(mix=_fit_mix(rows.where(of_kind), fit))
            continue
        cells[kind, TYPE_WIDE] = Cell(type_wide[kind])
        if family == "type":
            continue
        for count in np.unique(rows.counts[of_kind]):
            chosen = of_kind & (rows.counts == count)
            if chosen.sum() >= fit.min_rows:
                dense = rows.where(chosen)
                cells[kind, int(count)] = _fit_cell(dense.logits[:, :count], dense.targets[:, :count],
                                                    family == "bias" and kind in BIASED, fit)
    return cells


def _fit_mix(rows: Rows, fit: Fit) -> float:
    """The uniform share m of (1 - m) p + m / K that minimises the rows' soft-target NLL (LBFGS on
    its logit, from m = 1%)."""
    probabilities = torch.from_numpy(rows.probabilities())
    uniform = torch.from_numpy(rows.mask / rows.counts[:, None])
    targets = torch.from_numpy(rows.targets)
    logit = torch.tensor(math.log(0.01 / 0.99), dtype=torch.float64, requires_grad=True)
    # A line search: the NLL is flat in the logit near a small share, where fixed steps stall.
    optimizer = torch.optim.LBFGS([logit], lr=1.0, max_iter=fit.iterations, line_search_fn="strong_wolfe")

    def closure():
        optimizer.zero_grad()
        mix = torch.sigmoid(logit)
        mixed = (1 - mix) * probabilities + mix * uniform
        loss = -(targets * mixed.clamp_min(PROB_FLOOR).log()).sum(dim=1).mean()
        loss.backward()
        return loss

    optimizer.step(closure)
    return float(torch.sigmoid(logit.detach()))


def _tensors(rows: Rows):
    return torch.from_numpy(rows.logits), torch.from_numpy(rows.mask), torch.from_numpy(rows.targets)


def _clamped(temperature: float, fit: Fit) -> float:
    return min(max(temperature, fit.bounds[0]), fit.bounds[1])


def _fit_cell(logits: np.ndarray, targets: np.ndarray, biased: bool, fit: Fit) -> Cell:
    """A temperature, and with `biased` a bias a place (the first fixed at 0), by LBFGS on the
    soft-target NLL of rows that all have these candidates."""
    logits, targets = torch.from_numpy(logits), torch.from_numpy(targets)
    mask = torch.ones_like(logits, dtype=torch.bool)
    log_t = torch.zeros((), dtype=torch.float64, requires_grad=True)
    bias = torch.zeros(logits.shape[1] - 1, dtype=torch.float64, requires_grad=biased)
    optimizer = torch.optim.LBFGS([log_t, bias] if biased else [log_t], lr=fit.lr, max_iter=fit.iterations)

    def closure():
        optimizer.zero_grad()
        loss = soft_nll(logits / log_t.exp() + torch.cat([bias.new_zeros(1), bias]), mask, targets)
        loss.backward()
        return loss

    optimizer.step(closure)
    temperature = math.exp(log_t.item())
    if not fit.bounds[0] <= temperature <= fit.bounds[1] or not math.isfinite(temperature):
        # Clamped, the bias fitted beside the free temperature no longer fits: temperature only.
        return Cell(_clamped(fit_temperature(logits, mask, targets, fit.lr, fit.iterations), fit))
    return Cell(temperature, tuple([0.0] + bias.detach().tolist()) if biased else ())


def choose_families(rows: Rows, folds: int, fit: Fit) -> tuple[dict[str, str], dict[str, dict[str, float]]]:
    """Each type's family by `folds`-fold cross-validation over states (a state's rows stay in one
    fold), by the one-standard-error rule: the simplest family whose held-out NLL exceeds the
    lowest by no more than the standard error of their difference row by row (a richer family
    must earn its parameters; noise alone does not pick it).

    Returns:
        ({type: family}, {type: {family: held-out NLL}}) for the types with rows.
    """
    held_out = {family: np.full(len(rows.kinds), np.nan) for family in FAMILIES}
    for family in FAMILIES:
        for fold in range(folds):
            chosen = rows.folds == fold
            if chosen.any() and (~chosen).any():
                held_out[family][chosen] = rows.where(chosen).nll(Calibrator(fit_family(family, rows.where(~chosen),
                                                                                          fit)))
    chosen, report = {}, {}
    for kind in QUESTION_TYPES:
        of_kind = (rows.kinds == kind) & ~np.isnan(held_out["none"])
        if of_kind.any():
            report[kind] = {family: float(held_out[family][of_kind].mean()) for family in FAMILIES}
            best = held_out[min(FAMILIES, key=report[kind].get)][of_kind]
            for family in FAMILIES:  # simplest first
                gap = held_out[family][of_kind] - best
                error = gap.std(ddof=1) / math.sqrt(len(gap)) if len(gap) > 1 else 0.0
                if gap.mean() <= error:
                    chosen[kind] = family
                    break
    return chosen, report


def group_ece(rows: Rows, probabilities: np.ndarray) -> dict[str, tuple[int, float]]:
    """{group: (rows, ECE of its rows' most probable answers)}."""
    correct = probabilities.argmax(axis=1) == rows.targets.argmax(axis=1)
    confidence = probabilities.max(axis=1)
    return {str(group): (int((rows.groups == group).sum()),
                         ece(confidence[rows.groups == group], correct[rows.groups == group]))
            for group in np.unique(rows.groups)}


def assembled(families: Mapping[str, str], fitted: Mapping[str, dict]) -> Calibrator:
    """The calibrator taking each type's cells from its family's fit."""
    return Calibrator({key: cell for kind, family in families.items() for key, cell in fitted[family].items()
                       if key[0] == kind})


def guarded(families: Mapping[str, str], fitted: Mapping[str, dict], rows: Rows,
            min_rows: int) -> tuple[dict[str, str], list[dict]]:
    """Each type's family, stepped down to the next gentler one (`FAMILIES`, to none at last)
    while a group of at least `min_rows` rows has a higher ECE calibrated than raw: the types
    that group's rows have step down. Each round steps a type down, and with every type at none
    every ECE is the raw one, so it ends.

    Args:
        families: {type: family} to start from; fitted: {family: its cells fitted on `rows`}.

    Returns:
        ({type: family}, one entry per round some group was worse: those groups with their
        ECEs, and the steps their types took)
    """
    raw = group_ece(rows, rows.probabilities())
    families, fallbacks = dict(families), []
    while True:
        calibrated = group_ece(rows, rows.probabilities(assembled(families, fitted)))
        worse = [group for group, (count, value) in calibrated.items()
                 if count >= min_rows and value > raw[group][1] + 1e-12]
        if not worse:
            return families, fallbacks
        kinds = {str(kind) for kind in rows.kinds[np.isin(rows.groups, worse)]}
        steps = {}
        for kind in sorted(kinds):  # each type of a worse group steps down once a round
            if families.get(kind, "none") != "none":
                gentler = FAMILIES[FAMILIES.index(families[kind]) - 1]
                steps[kind] = f"{families[kind]} -> {gentler}"
                families[kind] = gentler
        fallbacks.append({"groups": {group: {"ece_raw": raw[group][1], "ece_calibrated": calibrated[group][1]}
                                     for group in worse}, "steps": steps})


def fit_calibrator(rows: Rows, folds: int, fit: Fit, risks: Sequence[float], delta: float) -> tuple[Calibrator, dict]:
    """The calibrator of `rows`: each type's family by cross-validation, fitted on every row,
    guarded against a group's ECE rising (`guarded`), then each type's abstention threshold at
    each of `risks` (`abstention.risk_threshold` at `delta`) on its calibrated probabilities.

    Returns:
        (Calibrator, report: families with their held-out NLLs, cells, fallbacks, the groups'
        ECE raw and calibrated, and each threshold with its coverage, error and bound here)
    """
    chosen, held_out = choose_families(rows, folds, fit)
    fitted = {family: fit_family(family, rows, fit) for family in FAMILIES}
    families, fallbacks = guarded(chosen, fitted, rows, fit.min_rows)
    calibrator = assembled(families, fitted)
    probabilities = rows.probabilities(calibrator)
    confidence = probabilities.max(axis=1)
    wrong = probabilities.argmax(axis=1) != rows.targets.argmax(axis=1)
    thresholds, abstention = {}, {}
    for kind in QUESTION_TYPES:
        of_kind = rows.kinds == kind
        found = {risk: risk_threshold(confidence[of_kind], wrong[of_kind], risk, delta) for risk in risks}
        thresholds[kind] = {risk: found[risk]["threshold"] for risk in risks}
        abstention[kind] = {repr(risk): {**result, "threshold": None if result["threshold"] == NEVER
                                         else result["threshold"]} for risk, result in found.items()}
    raw, calibrated = group_ece(rows, rows.probabilities()), group_ece(rows, probabilities)
    report = {"families": {kind: {"chosen": chosen[kind], "kept": families[kind], "held_out_nll": held_out[kind]}
                           for kind in chosen},
              "cells": calibrator.to_json()["cells"], "fallbacks": fallbacks,
              "groups": {group: {"rows": count, "ece_raw": raw[group][1], "ece_calibrated": value}
                         for group, (count, value) in calibrated.items()},
              "abstention": abstention}
    return Calibrator(calibrator.cells, thresholds), report
