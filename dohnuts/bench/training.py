"""The training update as training runs it: repeated (a replay figure on CUDA), over distinct
layouts, and on several processes."""

from __future__ import annotations

import json
import random
import tempfile
import time
from pathlib import Path

import torch

from ..config import LoraConfig, TrainConfig
from ..inputs.template import pieces_of
from ..model.adapters import with_lora
from ..runtime.distributed import World
from ..runtime.training import build_optimizer, noise_generator, update_step
from ..runtime.training_graphs import training_bucket
from ..schema import parse_request
from ..scoring.objective import pack_targets
from .protocol import DISTINCT_STATE, distinct_questions
from .records import measure_calls, roofline_record
from .telemetry import Telemetry, synchronize
from .traffic import percentile


def training_requests(template, microbatch: int, rows: int, questions_per_state: int = 4,
                      state_tokens: int = 250) -> list[tuple[dict, dict]]:
    """(state, questions) of `rows` rows of about 300 tokens: states of at least `state_tokens`
    tokens under `template`, `questions_per_state` questions each, so the rows of a state
    share a prefix."""
    names = list(distinct_questions(50).items())
    out = []
    for state_index in range(rows // questions_per_state):
        chosen = dict(names[(state_index * questions_per_state) % 50:][:questions_per_state])
        lines = []
        while True:
            lines.append(f"line {microbatch}-{state_index}-{len(lines)}: the customer wrote again about the invoice.")
            state = {**DISTINCT_STATE, "note": " ".join(lines)}
            state_piece = pieces_of(parse_request(state, chosen, template.reserved))[0]
            if len(template.tokenize([state_piece])[0]) >= state_tokens:
                break
        out.append((state, chosen))
    return out

def training_update(model, template, microbatches: int = 4, rows: int = 8, place: World | None = None,
                    state_tokens: tuple[int, ...] = (250,)):
    """One training update as the trainer runs it, as a callable: fresh LoRA injected into
    `model` (in place), activation checkpointing, `microbatches` of `rows` rows at one snapshot
    packed into one batch, the trainer's optimizer and `update_step` at the recipe's defaults
    (`TrainConfig()`), the batch copied to the device in every call. One batch is built for each
    of `state_tokens` (the least tokens of its states): `update(index)` runs batch `index`. Under
    several processes (`place`), this rank packs its share of the microbatches and DDP averages
    the gradients.

    Returns (update, the packed batches of this rank)."""
    place = place or World(0, 1, model.device)
    with_lora(model.backbone, LoraConfig(), seed=0)
    model.changed()  # modules were replaced: no captured graph of the merged model applies
    model.activation_checkpointing = True
    model.train()
    device = model.device
    config = TrainConfig()
    optimizer = build_optimizer(model, config)
    if microbatches % place.size:
        raise ValueError(f"{microbatches} microbatches do not divide among {place.size} processes")
    share = range(place.rank * microbatches // place.size, (place.rank + 1) * microbatches // place.size)
    noise = [noise_generator(0, micro, device) for micro in share]
    updates = []
    for least in state_tokens:
        encoded, targets = [], []
        for micro in share:
            own = []
            for state, questions in training_requests(template, micro, rows, state_tokens=least):
                own += template.encode(parse_request(state, questions, template.reserved), config.max_tokens)
            width = max(len(row.markers) for row in own)
            targets.append(torch.nn.functional.one_hot(torch.arange(len(own)) % 4, width).float())
            encoded += own
        targets, sizes = pack_targets(targets)
        updates.append((template.collate(encoded, []), targets, torch.zeros(len(encoded), dtype=torch.bool), sizes))
    forward = model
    if place.distributed:
        forward = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None, broadcast_buffers=False)

    def update(index: int = 0):
        batch, targets, ordinal, sizes = updates[index]
        update_step(forward, optimizer, batch.to(device), targets.to(device), ordinal.to(device), sizes, config,
                    noise, place=place)

    return update, [batch for batch, _, _, _ in updates]

TRAINING_LAYOUTS = 16  # updates of distinct layouts in the varied training record (CUDA)

def distinct_state_tokens(template, microbatches: int, rows: int, count: int, seed: int = 0) -> list[int]:
    """`count` least state lengths, drawn from 120 to 400 tokens with `seed`, whose updates
    (`training_requests`, which grows states by whole lines) all differ from one another and from
    the 250-token one the repeated record times.

    Raises:
        ValueError: that range holds fewer distinct updates than `count`.
    """
    def states(least: int) -> tuple:
        return tuple(state["note"] for micro in range(microbatches)
                     for state, _ in training_requests(template, micro, rows, state_tokens=least))

    draw, seen, lengths = random.Random(seed), {states(250)}, []
    for _ in range(50 * count):
        if len(lengths) == count:
            break
        least = draw.randrange(120, 400)
        key = states(least)
        if key not in seen:
            seen.add(key)
            lengths.append(least)
    if len(lengths) < count:
        raise ValueError(f"states of 120 to 400 tokens give {len(lengths)} distinct training updates, not {count}")
    return lengths

def _graph_counts(model) -> dict:
    """The training graphs' counters (`TrainingGraphs.stats`) that say how updates ran."""
    return {name: model.training_graphs.stats[name] for name in ("eager", "captures", "replays", "failed",
                                                                  "padding_tokens")}

def training_update_record(model, template, ceilings: dict, microbatches: int = 4, rows: int = 8,
                           timed: int = 10, place: World | None = None, varied: int = 0, seed: int = 0) -> list[dict]:
    """Seconds per `training_update` (which injects fresh LoRA into `model`), with its roofline.

    Useful work of an update: 2 forward passes' worth of its packed batch, FLOPs and bytes (the
    forward and the backward's input gradients; the frozen base needs no weight gradients, and
    LoRA's are negligible). What activation checkpointing recomputes in the backward pass is
    repeated work, recorded apart (`repeated_work`), never counted as useful. Under several
    processes the record is rank 0's: its share of the update, the time of the whole update.

    The timed updates repeat one batch: on CUDA, from its second call on, they replay its training
    bucket's graphs (`training_graphs` counts how they ran). With `varied`, a second record
    (`training_update_varied`) times `varied` updates of distinct layouts
    (`distinct_state_tokens`), each once, in order, as a training run meets them: a batch
    replays a captured bucket it fits, or runs eagerly, and a bucket's second batch captures its
    graphs.

    Returns:
        [the record of the repeated batch] (and the varied record)
    """
    place = place or World(0, 1, model.device)
    lengths = distinct_state_tokens(template, microbatches, rows, varied, seed)
    update, batches = training_update(model, template, microbatches, rows, place, state_tokens=(250, *lengths))
    batch = batches[0]
    device = model.device
    with Telemetry(device) as telemetry:
        cold_ms, samples, _, counts = measure_calls(update, device, 1, timed, lambda: _graph_counts(model))
    p50 = percentile(samples, 0.5)
    record = {
        "workload": "training_update", "processes": place.size, "microbatches": microbatches,
        "rows_per_microbatch": rows, "input_tokens": batch.input_tokens, "computed_tokens": batch.computed_tokens,
        "cold_ms": cold_ms, "p50_ms": p50, "samples_ms": samples, "telemetry": telemetry.summary(),
        "training_graphs": counts,
        "roofline": roofline_record(model, batch, p50, ceilings, passes=2, recomputed=True),
    }
    # Every rank packs the same number of tokens (the requests are alike): the update's tokens
    # are this rank's times the process count.
    record["tokens_per_second"] = 1000.0 * record["input_tokens"] * place.size / p50
    records = [record]
    if varied:
        before, times = _graph_counts(model), []
        for index in range(1, len(batches)):
            synchronize(device)
            start = time.perf_counter()
            update(index)
            synchronize(device)
            times.append((time.perf_counter() - start) * 1000.0)
        after = _graph_counts(model)
        records.append({
            "workload": "training_update_varied", "processes": place.size, "updates": varied, "seed": seed,
            "state_tokens": lengths, "computed_tokens": [batch.computed_tokens for batch in batches[1:]],
            "p50_ms": percentile(times, 0.5), "p95_ms": percentile(times, 0.95), "mean_ms": sum(times) / len(times),
            "samples_ms": times, "training_graphs": {name: after[name] - before[name] for name in after},
            "buckets": len({str(bucket) for bucket in map(training_bucket, batches[1:])})})
    model.eval()
    return records

def multi_process_update_record(source: dict, processes: int, ceilings: dict, microbatches: int = 4, rows: int = 8,
                                timed: int = 10) -> dict:
    """The training update on `processes` processes of this machine (torchrun, one per GPU; gloo
    on the CPU), for the model `source` names ({"checkpoint": folder} or {"shape": name}).

    Raises:
        RuntimeError: a process failed (its output is in the message).
    """
    import subprocess
    import sys

    with tempfile.TemporaryDirectory() as scratch:
        output = Path(scratch) / "record.json"
        settings = {**source, "microbatches": microbatches, "rows": rows, "timed": timed, "ceilings": ceilings,
                    "output": str(output)}
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                   str(processes), "-m", "dohnuts.bench.update_worker", json.dumps(settings)]
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0 or not output.is_file():
            raise RuntimeError(f"the {processes}-process training update failed:\n{result.stderr[-2000:]}")
        return json.loads(output.read_text())

def scaling(records: list[dict]) -> list[dict]:
    """Each training-update record with its scaling efficiency: its tokens/s over the one-process
    record's times the process count (1.0: perfect scaling)."""
    single = next((record for record in records if record["processes"] == 1), None)
    for record in records:
        if single is not None:
            record["scaling_efficiency"] = record["tokens_per_second"] / (
                single["tokens_per_second"] * record["processes"])
    return records
