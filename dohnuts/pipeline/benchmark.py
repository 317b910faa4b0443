"""Latency benchmark of complete predict() calls over the upstream-matched workloads."""

from __future__ import annotations

import dataclasses
import inspect
import json
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from PIL import Image, ImageDraw

from ..config import EVALUATION_BATCH_TOKENS, BenchmarkConfig, LoraConfig, TrainConfig
from ..data import synthetic
from ..data.loader import workers_for
from ..data.records import RecordReader, load_records, write_mixture
from ..io import write_bytes
from ..measure.roofline import (
    DEVICES,
    Stage,
    bounds,
    efficiencies,
    efficiency,
    geometry_from_batch,
    stages,
    total,
    useful_work,
)
from ..measure.shapes import shape_only_predictor
from ..measure.telemetry import Telemetry, measure_ceilings, synchronize
from ..measure.traffic import percentile, varied_requests
from ..model.adapters import with_lora
from ..model.cuda_graphs import layout_key
from ..model.decoder import MIXER_KEEP_TOKENS
from ..model.predict import Predictor
from ..model.template import pieces_of
from ..model.training_graphs import training_bucket
from ..ops import kernels
from ..schema import parse_request
from ..scoring.objective import pack_targets
from ..serve.load import serving_record
from .distributed import World
from .evaluate import EvaluationBatches, evaluate, plan_batches, result_rows
from .train import build_optimizer, noise_generator, update_step

TEXT_STATE = "Customer: I was billed twice."
ONE_QUESTION = {"is_red": {"type": "noul", "instructions": "Is the square red?"}}
THREE_QUESTIONS = {
    **ONE_QUESTION,
    "color": {"type": "choice", "instructions": "What color?", "criteria": ["red", "blue", "green"]},
    "size": {"type": "score", "instructions": "How big?", "criteria": ["small", "medium", "large"]},
}
DISTINCT_STATE = {
    "customer": "Mina", "plan": "business", "invoice": "4411", "currency": "USD", "amount": 120,
    "charges": 2, "expected_charges": 1, "refund_requested": True, "deadline": "today",
    "service_available": True,
}
DISTINCT_FIELDS = [
    ("customer", ["Mina", "Alex", "Sam", "unknown"]),
    ("plan", ["free", "personal", "business", "enterprise"]),
    ("invoice", ["4400", "4411", "4422", "unknown"]),
    ("currency", ["EUR", "USD", "GBP", "unknown"]),
    ("amount", ["30", "60", "120", "240"]),
    ("charges", ["zero", "one", "two", "three"]),
    ("expected_charges", ["zero", "one", "two", "three"]),
    ("refund_requested", ["yes", "no", "unclear", "contradictory"]),
    ("deadline", ["today", "tomorrow", "next week", "none"]),
    ("service_available", ["yes", "no", "unclear", "contradictory"]),
]
DISTINCT_TEMPLATES = [
    "What value does the state give for {field}?",
    "Which candidate contradicts the reported {field}?",
    "Which candidate should a support agent preserve when copying {field}?",
    "Which candidate represents the customer's stated {field}?",
    "Which value is supported by the evidence about {field}?",
]


def protocol_image() -> Image.Image:
    """96x96 white canvas with a 48x48 red (220, 20, 20) square at (24, 24)."""
    image = Image.new("RGB", (96, 96), "white")
    ImageDraw.Draw(image).rectangle([24, 24, 24 + 48 - 1, 24 + 48 - 1], fill=(220, 20, 20))
    return image


def distinct_questions(count: int) -> dict:
    """The first `count` questions in template-major order (50 in all)."""
    questions = {}
    for j, template in enumerate(DISTINCT_TEMPLATES):
        for field, options in DISTINCT_FIELDS:
            questions[f"field_{field}_interpretation_{j}"] = {
                "type": "choice", "instructions": template.format(field=field), "criteria": list(options)}
    return dict(list(questions.items())[:count])


def workloads() -> dict[str, tuple[object, dict]]:
    """Workload name -> (state, questions), as in the upstream measurement protocol."""
    image_state = {"image": protocol_image()}
    cases = {
        "vision_protocol_text_1q": (TEXT_STATE, ONE_QUESTION),
        "vision_protocol_text_3q": (TEXT_STATE, THREE_QUESTIONS),
        "vision_protocol_image_1q": (image_state, ONE_QUESTION),
        "vision_protocol_image_3q": (image_state, THREE_QUESTIONS),
    }
    for count in (1, 5, 10, 50):
        cases[f"distinct_text_{count}q"] = (DISTINCT_STATE, distinct_questions(count))
    return cases


def _measure(call, device: torch.device, warmup: int, timed: int,
             counters=None) -> tuple[float, list[float], object, dict]:
    """One cold call, `warmup` warm-up calls, then `timed` calls, each bracketed by syncs.

    Returns (cold ms, timed samples in ms, the cold call's result, how much each of the
    `counters()` counts grew over the timed calls alone)."""
    def once():
        synchronize(device)
        start = time.perf_counter()
        result = call()
        synchronize(device)
        return (time.perf_counter() - start) * 1000.0, result

    cold_ms, result = once()
    for _ in range(warmup):
        once()
    before = dict(counters()) if counters is not None else {}
    samples = [once()[0] for _ in range(timed)]
    grown = {name: value - before[name] for name, value in counters().items()} if counters is not None else {}
    return cold_ms, samples, result, grown


def _baseline_rows(predictor, state, questions):
    """(encoded image or None, rows) of a request, always preprocessed (no feature cache)."""
    template = predictor.template
    request = parse_request(state, questions, template.reserved)
    image = template.encode_image(request.image) if request.image is not None else None
    return image, template.encode(request, predictor.config.max_tokens, 0, image)


@torch.no_grad()
def hugging_face_logits(predictor, state, questions) -> torch.Tensor:
    """The baseline on the same inputs: Hugging Face's own `Qwen3_5Model` forward over the
    request's rows padded to the longest (no packing, no shared prefix), then the same
    marker gather and head. Returns logits [B, K]."""
    template, backbone, device = predictor.template, predictor.model.backbone, predictor.model.device
    image, rows = _baseline_rows(predictor, state, questions)
    length = max(len(row.input_ids) for row in rows)
    ids = torch.full((len(rows), length), template.pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for index, row in enumerate(rows):
        ids[index, : len(row.input_ids)] = torch.tensor(row.input_ids)
        mask[index, : len(row.input_ids)] = 1
    ids, mask = ids.to(device), mask.to(device)
    kwargs = {}
    if image is not None:
        kwargs = {"pixel_values": image.patches(device).repeat(len(rows), 1),
                  "image_grid_thw": image.grid_thw.repeat(len(rows), 1).to(device)}
        if "mm_token_type_ids" in inspect.signature(backbone.forward).parameters:  # transformers >= 5.23
            kwargs["mm_token_type_ids"] = (ids == template.image_pad_id).int()
    hidden = backbone(input_ids=ids, attention_mask=mask, use_cache=False, **kwargs).last_hidden_state
    markers = torch.zeros((len(rows), max(len(row.markers) for row in rows)), dtype=torch.long)
    for index, row in enumerate(rows):
        markers[index, : len(row.markers)] = torch.tensor(row.markers)
    picked = hidden[torch.arange(len(rows), device=device)[:, None], markers.to(device)]
    return predictor.model.head(picked.to(predictor.model.head.weight.dtype)).squeeze(-1)


def distinct_tokens(rows) -> int:
    """Tokens that are distinct computations: a token is the same computation in two rows when
    the rows' images and every token up to it are the same (the model is causal). The size of
    a trie of the rows, one root per image."""
    nodes: set = set()
    for row in rows:
        node = ("image", row.image)
        for token in row.input_ids:
            node = (hash(node), token)
            nodes.add(node)
    return len(nodes)


def _padded_baseline(rows) -> dict:
    """Tokens the padded, unshared baseline computes: beyond the useful ones, its padding, and
    the tokens it computes more than once (the shared beginning of a request's rows, once per
    row after the first)."""
    lengths = [len(row.input_ids) for row in rows]
    computed = len(rows) * max(lengths)
    return {"computed_tokens": computed, "padding_tokens": computed - sum(lengths),
            "repeated_prefix_tokens": sum(lengths) - distinct_tokens(rows)}


def roofline_record(model, batch, p50_ms: float, ceilings: dict, passes: int = 1, recomputed: bool = False) -> dict:
    """The useful work of `batch` (run `passes` times; vision only for the images it carries
    pixels of), its bounds under the measured `ceilings` (`measure_ceilings`) and under the
    datasheet of the device they were measured on (absent when that device is not in the
    table), efficiency t_lower / p50 against each, and each bound's share of p50. With
    `recomputed`, the work activation checkpointing repeats in the backward pass (a training
    update) is counted apart, as repeated work, never as useful."""
    config = model.backbone.config
    text, vision = config.text_config.to_dict(), config.vision_config.to_dict()
    dtype_bytes = torch.finfo(model.backbone.dtype).bits // 8
    geometry = geometry_from_batch(batch)
    work = useful_work(text, vision, geometry, dtype_bytes)
    for part in ("flops", "bytes"):
        work[part] = {name: passes * value for name, value in work[part].items()}
    layers = stages(text, vision, geometry, dtype_bytes, whole_layers=batch.computed_tokens > MIXER_KEEP_TOKENS)
    parts = [Stage(stage.name, {name: passes * value for name, value in stage.flops.items()}, passes * stage.bytes,
                   stage.recomputed) for stage in layers]
    transfer = sum(tensor.numel() * tensor.element_size() for tensor in batch.device_tensors())
    record = {"work": work, "transfer_bytes": transfer, "bounds": {}, "efficiency": {}, "efficiency_by_bound": {}}
    if recomputed:
        record["repeated_work"] = total(layers, recomputed_only=True)
    device_name = ceilings["device"]
    sheets = {"measured": ceilings}
    sheet = DEVICES.get(device_name)
    if sheet is not None:
        sheets["datasheet"] = sheet
    else:
        record["efficiency"]["datasheet"] = {"absent": f"no datasheet entry for {device_name!r}"}
    for label, limits in sheets.items():
        # A CPU run has no host-device link to cross.
        bound = bounds(work, limits, transfer if device_name != "CPU" else None, parts)
        record["bounds"][label] = bound
        record["efficiency"][label] = efficiency(bound["t_lower_seconds"], p50_ms / 1000.0)
        record["efficiency_by_bound"][label] = efficiencies(bound, p50_ms / 1000.0)
    return record


def run_workload(predictor, name: str, state, questions, warmup: int, timed: int, ceilings: dict,
                 cache_miss: bool = False) -> dict:
    """Our predict() and the Hugging Face baseline on one workload, under the same protocol.

    With `cache_miss`, the image-feature cache is emptied before every call, so each call
    encodes its image; otherwise warm calls hit the cache.
    """
    model, device = predictor.model, predictor.model.device

    def call():
        if cache_miss:
            model.image_cache.clear()
        return predictor.predict(state, questions)

    with Telemetry(device) as telemetry:
        cold_ms, samples, result, calls = _measure(call, device, warmup, timed, lambda: predictor.scores.stats)
    _, baseline, _, _ = _measure(lambda: hugging_face_logits(predictor, state, questions), device, warmup, timed)
    ours = predictor.predict_many([(state, questions)], raw_logits=True)[0]["logits"]
    theirs = hugging_face_logits(predictor, state, questions).float().cpu()
    difference = max((theirs[index, : len(values)] - torch.tensor(values)).abs().max().item()
                     for index, values in enumerate(ours.values()))
    if cache_miss:
        model.image_cache.clear()  # the batch as the timed calls built it: pixels included
    batch, _ = predictor.encode(state, questions)
    _, rows = _baseline_rows(predictor, state, questions)
    mean, p50 = statistics.fmean(samples), percentile(samples, 0.5)
    return {
        "workload": name + ("_cache_miss" if cache_miss else ""), "questions": len(questions), "cold_ms": cold_ms,
        "p50_ms": p50, "p95_ms": percentile(samples, 0.95), "mean_ms": mean,
        "decisions_per_second": 1000.0 * len(questions) / mean,
        "hugging_face_p50_ms": percentile(baseline, 0.5), "hugging_face": _padded_baseline(rows),
        "input_tokens": result["usage"]["input_tokens"], "computed_tokens": batch.computed_tokens,
        "shared_prefixes": 0 if batch.fork is None else len(batch.prefix_cu_seqlens) - 1,
        "image_grid_thw": None if batch.image_grid_thw_cpu is None else batch.image_grid_thw_cpu.tolist(),
        "vision_encoded": any(batch.image_has_pixels),
        "timed_calls": {"graph_replays": calls["replays"], "graph_captures": calls["captures"],
                        "bucket_replays": calls["bucket_replays"], "eager": calls["eager"]},
        "max_abs_logit_difference_to_hugging_face": difference,
        "roofline": roofline_record(model, batch, p50, ceilings),
        "telemetry": telemetry.summary(),
        "samples_ms": samples, "hugging_face_samples_ms": baseline,
    }


def varied_traffic(predictor, count: int, seed: int = 0, warmup: int = 8) -> tuple[list, list]:
    """(warm-up requests, timed requests) for the varied-traffic workload: `count` requests of
    `measure.traffic.varied_requests`, each with a layout (rows, prefixes, image grid: what a
    captured graph is keyed on) that no other request and no warm-up request has."""
    def layout(request) -> tuple:
        return layout_key(predictor.encode(*request)[0])

    warm = varied_requests(warmup, seed + 1)
    seen = {layout(request) for request in warm}
    timed = []
    for request in varied_requests(8 * count, seed):
        key = layout(request)
        if key not in seen:
            seen.add(key)
            timed.append(request)
            if len(timed) == count:
                return warm, timed
    raise RuntimeError(f"varied_requests gave fewer than {count} distinct layouts in {8 * count} requests")


def _timed_pass(predictor, requests) -> dict:
    """Each request once, bracketed by syncs: latency percentiles and what each call ran."""
    device, stats, vision = predictor.model.device, predictor.scores.stats, predictor.model.vision_graphs.stats
    counted = [(stats, "graph_replays", "replays"), (stats, "graph_captures", "captures"),
               (stats, "bucket_replays", "bucket_replays"), (stats, "eager", "eager"),
               (stats, "padding_tokens", "padding_tokens"), (vision, "vision_replays", "replays"),
               (vision, "vision_captures", "captures"), (vision, "vision_bucket_replays", "bucket_replays"),
               (vision, "vision_eager", "eager"), (vision, "vision_padding_patches", "padding_patches")]
    samples, calls = [], {name: 0 for _, name, _ in counted}
    for state, questions in requests:
        before = [source[counter] for source, _, counter in counted]
        synchronize(device)
        start = time.perf_counter()
        predictor.predict(state, questions)
        synchronize(device)
        samples.append((time.perf_counter() - start) * 1000.0)
        for (source, name, counter), value in zip(counted, before):
            calls[name] += source[counter] - value
    images = [ms for ms, (state, _) in zip(samples, requests) if "image" in state]
    texts = [ms for ms, (state, _) in zip(samples, requests) if "image" not in state]
    return {"p50_ms": percentile(samples, 0.5), "p95_ms": percentile(samples, 0.95),
            "p99_ms": percentile(samples, 0.99), "mean_ms": statistics.fmean(samples), "max_ms": max(samples),
            "text_p50_ms": percentile(texts, 0.5) if texts else None,
            "image_p50_ms": percentile(images, 0.5) if images else None,
            "decisions_per_second": 1000.0 * sum(len(q) for _, q in requests) / sum(samples),
            "timed_calls": calls, "samples_ms": samples}


def varied_traffic_record(predictor, count: int, seed: int = 0, warmup: int = 8) -> dict:
    """The varied-traffic workload: after a warm-up on other requests (each sent twice), `count`
    requests of distinct layouts, each timed on first sight (its images new to the feature
    cache), then the whole set once more; Hugging Face's padded forward once on each."""
    warm, timed = varied_traffic(predictor, count, seed, warmup)
    for state, questions in warm + warm:
        predictor.predict(state, questions)
    first = _timed_pass(predictor, timed)
    second = _timed_pass(predictor, timed)
    for state, questions in warm:
        hugging_face_logits(predictor, state, questions)
    baseline = []
    for state, questions in timed:
        synchronize(predictor.model.device)
        start = time.perf_counter()
        hugging_face_logits(predictor, state, questions)
        synchronize(predictor.model.device)
        baseline.append((time.perf_counter() - start) * 1000.0)
    tokens = [sum(len(row.input_ids) for row in _baseline_rows(predictor, *request)[1]) for request in timed]
    return {
        "workload": "varied_traffic", "requests": len(timed), "seed": seed, "warmup_requests": len(warm),
        "image_requests": sum("image" in state for state, _ in timed),
        "questions": [len(questions) for _, questions in timed], "input_tokens": tokens,
        "first_sight": first, "second_pass": second,
        "buckets": len(predictor.scores.buckets), "bucket_prepare_seconds": predictor.scores.stats["prepare_seconds"],
        "vision_buckets": [dataclasses.asdict(bucket) for bucket in predictor.model.vision_graphs.buckets],
        "vision_bucket_prepare_seconds": predictor.model.vision_graphs.prepare_seconds,
        "hugging_face_p50_ms": percentile(baseline, 0.5), "hugging_face_p99_ms": percentile(baseline, 0.99),
        "hugging_face_samples_ms": baseline,
    }


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
        cold_ms, samples, _, counts = _measure(update, device, 1, timed, lambda: _graph_counts(model))
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
                   str(processes), "-m", "dohnuts.pipeline.update_worker", json.dumps(settings)]
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


def environment(predictor) -> dict:
    """The machine and model a record was made on, and every slower path the runtime has taken
    in this process so far, with why (`dohnuts.ops.kernels.slow_paths`)."""
    device = predictor.model.device
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "device_type": device.type, "torch": torch.__version__, "threads": torch.get_num_threads(),
        "dtype": predictor.config.dtype, "base": predictor.config.base,
        "shape_only": predictor.config.base.startswith("shape-only:"), "slow_paths": kernels.slow_paths(),
    }


@torch.no_grad()
def synchronous_evaluation(model, build, plan) -> list[dict]:
    """The plain loop the loader replaces: build a batch, copy it, run it, wait for its logits."""
    results = []
    for tables in plan:
        item = build(tables)
        results.extend(result_rows(model(item.batch.to(model.device)).cpu(), item.meta))
    return results


def evaluation_throughput_record(model, template, max_tokens: int, root: Path, states_per_group: int = 12,
                                 batch_tokens: int = EVALUATION_BATCH_TOKENS, passes: int = 3) -> dict:
    """Rows per second of evaluation on a generated image-and-text partition: `evaluate` (loader
    workers, prefetch, overlapped results) against `synchronous_evaluation`, each the median of
    `passes` timed passes (a pass is a fraction of a second on the H200: one alone varied by a
    fifth), the two paths alternating pass by pass so that drift reaches both alike. The
    image-feature cache is emptied before each timed pass, so both encode every image; each path
    runs once untimed first (kernel autotuning, allocator warm-up)."""
    if passes < 1:
        raise ValueError(f"evaluation_throughput_record: passes must be at least 1, got {passes}")
    states = synthetic.generate(seed=0, states_per_group=states_per_group)
    write_mixture(states, root, 0, {"train": 0.0, "dev": 0.0, "calibration": 0.0, "test": 1.0})
    folder = root / "test"
    rows, reader = load_records(folder), RecordReader(folder)
    build = EvaluationBatches(template, reader, max_tokens)
    plan = plan_batches(rows, batch_tokens, template)
    device = model.device
    paths = {"overlapped": lambda: evaluate(model, template, reader, rows, batch_tokens, max_tokens,
                                            desc="overlapped"),
             "synchronous": lambda: synchronous_evaluation(model, build, plan)}
    samples = {name: [] for name in paths}
    for run in paths.values():
        run()
    for _ in range(passes):
        for name, run in paths.items():
            model.image_cache.clear()
            synchronize(device)
            start = time.perf_counter()
            run()
            synchronize(device)
            samples[name].append(time.perf_counter() - start)
    model.image_cache.clear()
    seconds = {name: statistics.median(values) for name, values in samples.items()}
    record = {"workload": "evaluation_throughput", "rows": len(rows), "batches": len(plan),
              "batch_tokens": batch_tokens, "images": int(rows.image.notna().sum()),
              "loader_workers": workers_for(device, len(plan)), "passes": passes}
    for name, value in seconds.items():
        record[f"{name}_seconds"] = value
        record[f"{name}_seconds_samples"] = samples[name]
        record[f"{name}_rows_per_second"] = len(rows) / value
    record["speedup"] = seconds["synchronous"] / seconds["overlapped"]
    return record


# Published upstream p50 latencies (ms), from shared/reference/benchmark-workloads.json.
PUBLISHED_P50_MS = {
    "Dohnuts-0.1.0-0.8B on AMD RX 7900 XTX (upstream, bf16, merged LoRA)": {
        "distinct_text_1q": 15.07, "distinct_text_50q": 112.51, "vision_protocol_image_1q": 24.43,
        "vision_protocol_image_3q": 35.84},
    "Linnaeus-0.1.0-2B on NVIDIA RTX 4090 (fork, bf16, merged LoRA)": {
        "vision_protocol_text_1q": 44.53, "vision_protocol_text_3q": 47.81, "vision_protocol_image_1q": 49.88,
        "vision_protocol_image_3q": 100.83, "distinct_text_1q": 46.83, "distinct_text_5q": 94.32,
        "distinct_text_10q": 94.83, "distinct_text_50q": 122.42},
}


def benchmark(predictor, warmup: int, timed: int, progress=None, serving_requests: int = 0,
              serving_clients: tuple[int, ...] = (), shape: str | None = None,
              checkpoint: Path | None = None, varied_requests: int = 60) -> tuple[list[dict], dict, list[dict]]:
    """Run every repeated workload (image workloads also with a cold image-feature cache), the
    varied-traffic workload (`varied_requests` requests of distinct layouts), evaluation
    throughput, the serving workload (`serving_requests` varied requests over loopback at each
    count of `serving_clients`; none when 0), then one training-update record (which injects
    fresh LoRA into the predictor's model, so it comes last), with one more per process count a
    machine of several GPUs offers (the model rebuilt from `shape` or `checkpoint` in each
    process). Ceilings are measured first, in the same process. `progress(records so far)`
    follows each record.

    Returns:
        (raw records, summary for DVC metrics, plot rows: one per workload)
    """
    device = predictor.model.device
    ceilings = measure_ceilings(device)
    records = []
    for name, (state, questions) in workloads().items():
        variants = (False, True) if isinstance(state, dict) and "image" in state else (False,)
        for cache_miss in variants:
            record = run_workload(predictor, name, state, questions, warmup, timed, ceilings, cache_miss)
            records.append({**record, "environment": environment(predictor)})
            if progress is not None:
                progress(records)
    varied = {**varied_traffic_record(predictor, varied_requests), "environment": environment(predictor)}
    if progress is not None:
        progress([*records, varied])
    with tempfile.TemporaryDirectory() as scratch:
        throughput = {**evaluation_throughput_record(predictor.model, predictor.template, predictor.config.max_tokens,
                                                     Path(scratch)), "environment": environment(predictor)}
    extra = [varied, throughput]
    if progress is not None:
        progress(records + extra)
    serving = None
    if serving_requests:
        serving = {**serving_record(predictor, serving_requests, serving_clients),
                   "environment": environment(predictor)}
        extra.append(serving)
        if progress is not None:
            progress(records + extra)
    environment_now = environment(predictor)
    # The varied-layout training record is about the training graphs, which only CUDA has.
    first, *varied_training = training_update_record(predictor.model, predictor.template, ceilings,
                                                     varied=TRAINING_LAYOUTS if device.type == "cuda" else 0)
    trainings = [first]
    # One record per process count the machine offers: 2 .. its GPUs, each its own torchrun.
    source = {"shape": shape} if shape else {"checkpoint": str(checkpoint)} if checkpoint else None
    if device.type == "cuda" and source is not None:
        trainings += [multi_process_update_record(source, count, ceilings)
                      for count in range(2, torch.cuda.device_count() + 1)]
    trainings = [{**record, "environment": environment_now} for record in scaling(trainings)]
    training = trainings[0]
    varied_training = [{**record, "environment": environment_now} for record in varied_training]
    extra += trainings + varied_training
    if progress is not None:
        progress(records + extra)
    keys = ("p50_ms", "p95_ms", "cold_ms", "decisions_per_second", "hugging_face_p50_ms")
    keys += ("max_abs_logit_difference_to_hugging_face", "timed_calls")
    summary = {
        "environment": environment(predictor), "ceilings": ceilings,
        "workloads": {record["workload"]: {**{key: record[key] for key in keys},
                                           "efficiency": record["roofline"]["efficiency"]["measured"],
                                           "efficiency_by_bound": record["roofline"]["efficiency_by_bound"]["measured"]}
                      for record in records},
        "varied_traffic": {
            "requests": varied["requests"], "hugging_face_p50_ms": varied["hugging_face_p50_ms"],
            **{name: {key: value for key, value in varied[name].items() if key != "samples_ms"}
               for name in ("first_sight", "second_pass")}},
        "training_update": {"p50_ms": training["p50_ms"], "tokens_per_second": training["tokens_per_second"],
                            "processes": training["processes"],
                            "scaling": {str(record["processes"]): record["scaling_efficiency"] for record in trainings},
                            "efficiency": training["roofline"]["efficiency"]["measured"],
                            "training_graphs": training["training_graphs"]},
        "training_update_varied": {key: varied_training[0][key] for key in (
            "updates", "p50_ms", "p95_ms", "mean_ms", "training_graphs")} if varied_training else {},
        "evaluation_rows_per_second": {name: throughput[f"{name}_rows_per_second"]
                                       for name in ("overlapped", "synchronous")},
        "serving": {f"clients_{level['clients']}": {key: level[key] for key in (
            "requests_per_second", "decisions_per_second", "p50_ms", "p99_ms", "mean_batch_requests", "failed",
            "lost")} for level in serving["levels"]} if serving else {},
        "published_p50_ms": PUBLISHED_P50_MS,
    }
    plots = [{"workload": record["workload"], "p50_ms": record["p50_ms"],
              "hugging_face_p50_ms": record["hugging_face_p50_ms"],
              "efficiency": record["roofline"]["efficiency"]["measured"]} for record in records]
    plots += [{"workload": f"varied_traffic_{name}", "p50_ms": varied[name]["p50_ms"],
               "hugging_face_p50_ms": varied["hugging_face_p50_ms"], "efficiency": None}
              for name in ("first_sight", "second_pass")]
    return records + extra, summary, plots


def describe(record: dict) -> str:
    """One progress line for a benchmark record."""
    if record["workload"] == "serving":
        return "serving                              " + "; ".join(
            f"{level['clients']} clients {level['decisions_per_second']:.1f} decisions/s p50 {level['p50_ms']:.1f} ms"
            f" batch {level['mean_batch_requests'] or 0:.1f} failed {level['failed']} lost {level['lost']}"
            for level in record["levels"])
    if record["workload"] == "varied_traffic":
        return "varied_traffic                       " + "; ".join(
            f"{name.replace('_', ' ')} p50 {record[name]['p50_ms']:.2f} p99 {record[name]['p99_ms']:.2f} ms "
            f"{record[name]['timed_calls']}" for name in ("first_sight", "second_pass")) + (
            f"; Hugging Face p50 {record['hugging_face_p50_ms']:.2f} ms")
    if record["workload"] == "training_update_varied":
        return (f"training_update_varied               p50 {record['p50_ms']:8.2f} ms  p95 {record['p95_ms']:.2f}  "
                f"mean {record['mean_ms']:.2f}  {record['updates']} layouts in {record['buckets']} buckets "
                f"{record['training_graphs']}")
    if "p50_ms" not in record or "roofline" not in record:
        return f"{record['workload']:36s} {json.dumps({k: v for k, v in record.items() if k != 'environment'})}"
    baseline = f"  Hugging Face {record['hugging_face_p50_ms']:8.2f} ms" if "hugging_face_p50_ms" in record else ""
    share = record["roofline"]["efficiency"]["measured"]
    share = f"  efficiency {share:.2e}" if share is not None else ""
    return f"{record['workload']:36s} p50 {record['p50_ms']:8.2f} ms{baseline}{share}"


def run(config: BenchmarkConfig, checkpoint: Path, records: Path, echo=print) -> tuple[dict, list[dict]]:
    """The benchmark stage: the deployable checkpoint, or a random-weight model of the shape
    `config.shape` names (shape-only), through `benchmark`. The raw records are rewritten
    atomically to `records` after each one, so a killed run keeps what it finished; `echo`
    gets a progress line per record.

    Returns:
        (summary for DVC metrics, plot rows)
    """
    if config.shape is not None:
        predictor = shape_only_predictor(config.shape)
        echo(f"shape-only: random weights of {config.shape}, not the checkpoint")
    else:
        predictor = Predictor.from_checkpoint(checkpoint)

    echoed = 0

    def progress(done):
        nonlocal echoed
        write_bytes(Path(records), "".join(json.dumps(record) + "\n" for record in done).encode())
        for record in done[echoed:]:  # a step may add several records (the two training records)
            echo(describe(record))
        echoed = len(done)

    _, summary, plots = benchmark(predictor, config.warmup, config.timed, progress=progress,
                                  serving_requests=config.serving_requests, serving_clients=config.serving_clients,
                                  shape=config.shape, checkpoint=None if config.shape else checkpoint,
                                  varied_requests=config.varied_requests)
    return summary, plots
