"""Batched evaluation: candidate logits for every row of a partition, one request per state."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pandas as pd
import torch
from PIL import Image
from tqdm import tqdm

from ..data.loader import Item, prefetch, worker_batches
from ..data.records import RecordReader, with_images
from ..inputs.batch import SHARED_MIN
from ..inputs.template import Template, pieces_of
from ..schema import parse_request
from ..scoring.calibrator import Calibrator
from ..scoring.metrics import masked_softmax, row_metrics, summarize
from .distributed import World, gathered, shard


@dataclass(frozen=True)
class StateRecords:
    """One state's records as plain values, in the partition's order: one request. Plain lists
    cost far less to walk than the table's rows (pandas indexing was half of a batch's build)."""

    state: str  # the state's JSON, each image's file name in its place
    images: tuple[str, ...]  # its images' files, relative to the partition, in the order of the state's text
    state_id: str
    groups: tuple[str, ...]
    qids: tuple[str, ...]
    questions: tuple[str, ...]  # each question's JSON
    targets: tuple[tuple[float, ...], ...]

    def __len__(self) -> int:
        return len(self.qids)

    def request_questions(self) -> dict:
        """qid -> question, as a user would send them to `predict`."""
        return {qid: json.loads(question) for qid, question in zip(self.qids, self.questions)}


BLANK = Image.new("RGB", (1, 1))  # what stands for an image whose block is counted, not made
COLUMNS = ("state", "images", "state_id", "group", "qid", "question", "target")


def state_records(rows: pd.DataFrame) -> list[StateRecords]:
    """The records of each state, in order of first appearance: one request per state."""
    columns = {name: rows[name].tolist() for name in COLUMNS}
    members: dict[str, list[int]] = {}
    for index, state_id in enumerate(columns["state_id"]):
        members.setdefault(state_id, []).append(index)
    requests = []
    for state_id, indices in members.items():
        images = columns["images"][indices[0]]
        requests.append(StateRecords(
            columns["state"][indices[0]], tuple(images) if images is not None else (), state_id,
            *(tuple(columns[name][index] for index in indices) for name in ("group", "qid", "question")),
            tuple(tuple(float(x) for x in columns["target"][index]) for index in indices)))
    return requests


def request_tokens(template: Template, records: StateRecords) -> int:
    """The tokens one request (a state's records) computes once packed, as `pack_rows` lays it
    out: the state with its images' blocks, shared by its questions when it holds at least
    `SHARED_MIN` tokens, then each question's own header, candidates and markers. Counted from the
    text, without decoding the images (`Template.image_tokens` bounds each block)."""
    names = set(records.images)
    state = with_images(json.loads(records.state), names, dict.fromkeys(names, BLANK))
    request = parse_request(state, records.request_questions(), template.reserved, template.max_images)
    lengths = [len(ids) for ids in template.tokenize(pieces_of(request, template.inline))]
    parts = len(request.state_parts) if template.inline else 1  # the state's pieces
    prefix = sum(lengths[:parts]) + template.image_tokens() * len(request.images)
    pieces = iter(lengths[parts:])
    own = [next(pieces) + sum(next(pieces) + 1 for _ in question.candidates)  # header, candidates, markers
           for question in request.questions]
    split = prefix if len(own) > 1 and prefix >= SHARED_MIN else 0
    return split + sum(prefix - split + tokens for tokens in own)


def plan_batches(rows: pd.DataFrame, batch_tokens: int, template: Template) -> list[list[StateRecords]]:
    """Whole requests per batch, in order, up to `batch_tokens` computed tokens a batch (a
    request over the budget goes alone): batches sized by work, not by a count of rows, so a
    forward's fixed cost is spread over as many tokens as the budget allows."""
    batches, current, count = [], [], 0
    for records in state_records(rows):
        tokens = request_tokens(template, records)
        if current and count + tokens > batch_tokens:
            batches.append(current)
            current, count = [], 0
        current.append(records)
        count += tokens
    if current:
        batches.append(current)
    return batches


def request_of(reader: RecordReader, records: StateRecords) -> tuple[object, dict]:
    """(state, questions) of one state's records, as a user would send them to `predict`."""
    return reader.state({"state": records.state, "images": records.images}), records.request_questions()


class EvaluationBatches:
    """Builds one evaluation batch from its requests (runs in loader workers)."""

    def __init__(self, template: Template, reader: RecordReader, max_tokens: int):
        self.template, self.reader, self.max_tokens = template, reader, max_tokens

    def __call__(self, requests: list[StateRecords]) -> Item:
        template = self.template
        encoded_rows, images, meta = [], [], []
        for records in requests:
            request = parse_request(*request_of(self.reader, records), template.reserved, template.max_images)
            indices = template.encode_images(request, images, {})  # each request's own: no joint prefixes
            rows = template.encode(request, self.max_tokens, indices, images)
            encoded_rows.extend(rows)
            for row, group, qid, target in zip(rows, records.groups, records.qids, records.targets):
                meta.append({"group": group, "state_id": records.state_id, "qid": qid, "kind": row.question.kind,
                             "labels": list(row.question.labels), "candidates": len(row.markers),
                             "target": list(target)})
        return Item(template.collate(encoded_rows, images), meta=meta)


def _to_host(logits: torch.Tensor, stream):
    """Start copying logits to pinned host memory on the side `stream`, without waiting: the
    copy waits for the forward that made them, and the compute stream goes on with the next
    batch. Returns (host, event recorded after the copy)."""
    if not logits.is_cuda:
        return logits, None
    host = torch.empty(logits.shape, dtype=logits.dtype, pin_memory=True)
    stream.wait_stream(torch.cuda.current_stream(logits.device))
    with torch.cuda.stream(stream):
        host.copy_(logits, non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
    logits.record_stream(stream)  # the allocator keeps them until the side stream has read them
    return host, done


def result_rows(logits: torch.Tensor, meta: list[dict]) -> list[dict]:
    """One result row per batch row: its metadata and its candidates' logits [K] (host)."""
    records = []
    for index, row in enumerate(meta):
        row = dict(row)
        count = row.pop("candidates")
        records.append({**row, "logits": logits[index, :count].tolist()})
    return records


def _results(host: torch.Tensor, done, meta: list[dict]) -> list[dict]:
    if done is not None:
        done.synchronize()
    return result_rows(host, meta)


@torch.no_grad()
def evaluate(model, template: Template, reader: RecordReader, rows: pd.DataFrame, batch_tokens: int,
             max_tokens: int, desc: str = "evaluate", workers: int | None = None,
             place: World | None = None) -> pd.DataFrame | None:
    """Logits of every row; all questions of a state go into one request.

    Batches are built by loader workers and prefetched; each batch's logits are copied to
    pinned host memory on a side stream, and its result rows are made while the next batch's
    forward runs. Under several processes (`place`), each rank evaluates every size-th batch
    and rank 0 gathers the rows in the original order: the same batches, the same results.

    Returns:
        One row per record: group, state_id, qid, kind, labels, logits, target (on rank 0; None
        on the other ranks).
    """
    place = place or World(0, 1, model.device)
    model.eval()
    plan = plan_batches(rows, batch_tokens, template)
    mine = shard(place, len(plan))
    done: list[tuple[int, list[dict]]] = []
    bar = tqdm(total=sum(sum(len(records) for records in plan[index]) for index in mine), desc=desc, unit="row",
               dynamic_ncols=True, disable=not place.main)
    batches = worker_batches(EvaluationBatches(template, reader, max_tokens), [plan[i] for i in mine], model.device,
                             workers)
    results_stream = torch.cuda.Stream(model.device) if model.device.type == "cuda" else None
    previous = None
    # Built in this loop (no workers), the next batch is built while the device runs this one.
    for index, item in zip(mine, prefetch(batches, model.device, ahead=batches.num_workers > 0)):
        current = (index, *_to_host(model(item.batch), results_stream), item.meta)
        if previous is not None:
            done.append((previous[0], _results(*previous[1:])))
            bar.update(len(previous[3]))
        previous = current
    if previous is not None:
        done.append((previous[0], _results(*previous[1:])))
        bar.update(len(previous[3]))
    bar.close()
    everything = gathered(place, done)
    if everything is None:
        return None
    results = [row for _, part in sorted(everything, key=lambda pair: pair[0]) for row in part]
    columns = ["group", "state_id", "qid", "kind", "labels", "logits", "target"]
    return pd.DataFrame.from_records(results, columns=columns)


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


def score_table(table: pd.DataFrame, calibrator: Calibrator | None = None,
                probabilities: list[list[float]] | None = None) -> tuple[pd.DataFrame, dict]:
    """Per-row metrics and the per-group/macro summary of an evaluation table.

    Args:
        table: from `evaluate`.
        calibrator: what calibrates the logits; None means raw (T = 1).
        probabilities: each row's candidate probabilities as they were served (`Predictor`),
            scored instead of those of the logits.

    Returns:
        (table with probabilities, prediction and per-row metrics added, summary dict)
    """
    logits, mask, targets = padded(table)
    if probabilities is not None:
        probs = torch.zeros_like(logits)
        for index, row in enumerate(probabilities):
            probs[index, : len(row)] = torch.tensor(row, dtype=probs.dtype)
    elif calibrator is not None:
        probs = torch.from_numpy(calibrator.probabilities(logits.numpy(), mask.numpy(), list(table.kind)))
    else:
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
