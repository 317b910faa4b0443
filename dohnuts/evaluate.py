"""Batched evaluation: candidate logits for every row of a partition, one request per state."""

from __future__ import annotations

import json

import pandas as pd
import torch
from tqdm import tqdm

from .calibration import apply_temperatures
from .data import RecordReader
from .metrics import masked_softmax, row_metrics, summarize
from .schema import parse_request
from .template import Template


def _requests(rows: pd.DataFrame, reader: RecordReader):
    """(state, questions, targets, record rows) per state, in order of first appearance."""
    for _, table in rows.groupby("state_id", sort=False):
        first = table.iloc[0]
        questions = {qid: json.loads(question) for qid, question in zip(table.qid, table.question)}
        yield reader.state(first), questions, list(table.target), table


@torch.no_grad()
def evaluate(model, template: Template, reader: RecordReader, rows: pd.DataFrame, batch_rows: int,
             max_tokens: int, desc: str = "evaluate") -> pd.DataFrame:
    """Logits of every row; all questions of a state go into one request.

    Returns:
        One row per record: group, state_id, qid, kind, labels, logits, target.
    """
    model.eval()
    results = []
    pending: list = []
    bar = tqdm(total=len(rows), desc=desc, unit="row", dynamic_ncols=True)

    def flush():
        encoded_rows, images, metas = [], [], []
        for state, questions, targets, table in pending:
            request = parse_request(state, questions, template.reserved)
            image = template.encode_image(request.image) if request.image is not None else None
            encoded_rows.extend(template.encode(request, max_tokens, len(images), image))
            if image is not None:
                images.append(image)
            metas.extend(zip(table.itertuples(), targets))
        batch = template.collate(encoded_rows, images).to(model.device)
        logits = model(batch).cpu()
        for index, (row, (record, target)) in enumerate(zip(encoded_rows, metas)):
            count = len(row.markers)
            results.append({
                "group": record.group, "state_id": record.state_id, "qid": record.qid,
                "kind": row.question.kind, "labels": list(row.question.labels),
                "logits": logits[index, :count].tolist(), "target": [float(x) for x in target],
            })
        bar.update(len(encoded_rows))
        pending.clear()

    for item in _requests(rows, reader):
        pending.append(item)
        if sum(len(entry[1]) for entry in pending) >= batch_rows:
            flush()
    if pending:
        flush()
    bar.close()
    return pd.DataFrame.from_records(results)


def padded(table: pd.DataFrame) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[B, K] logits, candidate mask and targets from an evaluation table."""
    width = max(len(x) for x in table.logits)
    logits = torch.zeros((len(table), width), dtype=torch.float64)
    targets = torch.zeros_like(logits)
    mask = torch.zeros((len(table), width), dtype=torch.bool)
    for index, (row_logits, target) in enumerate(zip(table.logits, table.target)):
        logits[index, : len(row_logits)] = torch.tensor(row_logits)
        targets[index, : len(target)] = torch.tensor(target)
        mask[index, : len(row_logits)] = True
    return logits, mask, targets


def score_table(table: pd.DataFrame, temperatures: dict[str, float] | None = None) -> tuple[pd.DataFrame, dict]:
    """Per-row metrics and the per-group/macro summary of an evaluation table.

    Args:
        table: from `evaluate`.
        temperatures: per question type; None means raw (T = 1).

    Returns:
        (table with probabilities, prediction and per-row metrics added, summary dict)
    """
    logits, mask, targets = padded(table)
    if temperatures is not None:
        logits = apply_temperatures(logits, list(table.kind), temperatures)
    probs = masked_softmax(logits, mask)
    ordinal = torch.tensor([kind == "score" for kind in table.kind])
    metrics = row_metrics(probs, mask, targets, ordinal)
    scored = table.assign(
        probabilities=[p[: len(x)].tolist() for p, x in zip(probs, table.logits)],
        pred=probs.masked_fill(~mask, -1).argmax(-1).numpy(),
        label=targets.argmax(-1).numpy(),
        num_candidates=[len(x) for x in table.logits],
        **{name: value.numpy() for name, value in metrics.items()},
    )
    scored["family"] = [f"{kind}:{'|'.join(labels)}" for kind, labels in zip(scored.kind, scored.labels)]
    return scored, summarize(scored)
