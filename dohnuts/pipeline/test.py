"""The test step: raw and calibrated metrics of the deployable checkpoint on the test partition."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from tqdm import tqdm

from ..config import TestConfig
from ..data.records import RecordReader, load_records
from ..runtime.buckets import all_buckets
from ..runtime.distributed import World, gathered, shard, world
from ..runtime.evaluation import plan_batches, request_of, score_table, state_records
from ..runtime.predict import Predictor
from ..schema import QUESTION_TYPES
from ..scoring.abstention import risk_coverage
from ..scoring.calibrator import Calibrator
from ..scoring.metrics import reliability
from .audits import changes, sample, summarise


def predictions(predictor: Predictor, rows: pd.DataFrame, reader: RecordReader, batch_tokens: int,
                place: World | None = None) -> pd.DataFrame | None:
    """Every record of a partition answered through `Predictor.predict_many`, what a user of
    the checkpoint gets (its CUDA graphs, calibrator and `answer`): one request per state,
    whole requests per batch, up to `batch_tokens` computed tokens.

    Under several processes (`place`) each rank answers every size-th batch and rank 0 gathers
    the rows in the original order.

    Returns:
        One row per record: group, state_id, qid, kind, labels, logits (raw), target and
        served (the calibrated probabilities of the answer); None on ranks other than 0.
    """
    place = place or World(0, 1, predictor.model.device)
    plan = plan_batches(rows, batch_tokens, predictor.template)
    done = []
    bar = tqdm(total=len(rows), desc="test", unit="row", dynamic_ncols=True, disable=not place.main)
    for index in shard(place, len(plan)):
        requests, records = plan[index], []
        results = predictor.predict_many([request_of(reader, state) for state in requests], raw_logits=True)
        for state, result in zip(requests, results):
            for group, qid, target in zip(state.groups, state.qids, state.targets):
                answer = result["answers"][qid]
                records.append({"group": group, "state_id": state.state_id, "qid": qid, "kind": answer["type"],
                                "labels": list(answer["probabilities"]), "logits": result["logits"][qid],
                                "target": list(target), "served": list(answer["probabilities"].values())})
            bar.update(len(state))
        done.append((index, records))
    bar.close()
    everything = gathered(place, done)
    if everything is None:
        return None
    return pd.DataFrame.from_records([row for _, part in sorted(everything, key=lambda pair: pair[0]) for row in part])


def reliability_diagrams(raw: pd.DataFrame, calibrated: pd.DataFrame) -> dict[str, list[dict]]:
    """Plot data of the reliability diagrams: per question type, raw and calibrated, the 15
    confidence bins of the ECE (mean confidence, accuracy, rows); the diagonal of perfect
    calibration; and per type the risk-coverage curve of the served answers (the error of the
    most confident at each coverage). Every type has its files, empty when the partition has no
    question of it."""
    diagrams = {"diagonal": [{"confidence": value, "accuracy": value} for value in (0.0, 1.0)]}
    for kind in QUESTION_TYPES:
        for name, scored in (("raw", raw), ("calibrated", calibrated)):
            rows = scored[scored.kind == kind]
            diagrams[f"{kind}_{name}"] = reliability(rows.confidence, rows.correct) if len(rows) else []
        rows = calibrated[calibrated.kind == kind]
        diagrams[f"risk_coverage_{kind}"] = risk_coverage(rows.confidence.to_numpy(), rows.correct.to_numpy() < 1)
    return diagrams


def abstention(scored: pd.DataFrame, calibrator: Calibrator) -> dict:
    """At each risk the checkpoint has thresholds for, per group and over all: the share of
    questions answered (their served confidence at least their type's threshold) and the error
    of those answered (None where none is)."""
    def summary(rows):
        answered = rows[rows.answered]
        return {"questions": len(rows), "coverage": float(rows.answered.mean()),
                "error": float(1 - answered.correct.mean()) if len(answered) else None}

    report = {}
    for risk in calibrator.risks:
        thresholds = scored.kind.map(lambda kind, risk=risk: calibrator.threshold(kind, risk))
        rows = scored.assign(answered=scored.confidence >= thresholds)
        report[repr(risk)] = {"all": summary(rows),
                              "groups": {group: summary(part) for group, part in rows.groupby("group", sort=True)}}
    return report


def audits(predictor: Predictor, records: pd.DataFrame, reader: RecordReader, table: pd.DataFrame,
           count: int) -> dict:
    """The audits (`pipeline.audits`) of up to `count` of the partition's requests, taken in
    turn from each group, against `table`'s served probabilities."""
    batched = {(state_id, qid): dict(zip(labels, served))
               for state_id, qid, labels, served in zip(table.state_id, table.qid, table.labels, table.served)}
    chosen = sample(state_records(records), count)
    found = list(tqdm(changes(predictor, reader, chosen, batched), desc="audits", unit="question",
                      dynamic_ncols=True))
    return summarise(found)


def test(checkpoint: Path, data: Path, config: TestConfig) -> tuple[pd.DataFrame, dict, dict[str, list[dict]]] | None:
    """Raw and calibrated metrics on the test partition with the deployable checkpoint.

    The calibrated metrics score the probabilities `Predictor` served; the raw ones the same
    forward's logits at temperature 1.

    Returns:
        (per-example predictions, metrics dict, reliability diagrams: file name -> rows), or None
        on ranks other than 0.
    """
    place = world()
    # Bucket graphs only when its batches can fit one (the default 16,384 tokens cannot).
    fits = config.batch_tokens <= max(bucket.tokens for bucket in all_buckets())
    predictor = Predictor.from_checkpoint(checkpoint, place.device, graphs=fits)
    records, reader = load_records(data), RecordReader(data)
    table = predictions(predictor, records, reader, config.batch_tokens, place)
    if table is None:  # another rank's share: rank 0 scores and writes
        return None
    raw_rows, raw = score_table(table)
    scored, calibrated = score_table(table.drop(columns="served"), probabilities=list(table.served))
    metrics = {"calibrated": calibrated, "raw": raw, "calibrator": predictor.calibrator.to_json(),
               "abstention": abstention(scored, predictor.calibrator),
               "audits": audits(predictor, records, reader, table, config.audit_states)}
    return scored, metrics, reliability_diagrams(raw_rows, scored)
