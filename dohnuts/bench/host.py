"""Where a repeated request's host time goes, and the helpers the device profiles share: a
warmed shape-only predictor, its warm-up, and calls timed between device synchronisations."""

from __future__ import annotations

import cProfile
import io
import json
import pstats
import statistics
import time

import numpy as np
import torch

from ..config import ModelConfig
from ..inputs.batch import PACKED_BYTES, lay_out, packed_layout
from ..inputs.pixels import image_key
from ..inputs.template import Template
from ..inputs.vocabulary import qwen3_5_tokenizer
from ..model.base import new_image_processor
from ..runtime.buckets import Ladder, all_buckets, bucket_for, pad_to_bucket
from ..runtime.cuda_graphs import layout_key
from ..runtime.engine import Piece, plan
from ..runtime.predict import answers_of, candidate_mask, encode_request
from ..schema import parse_request
from ..scoring.calibrator import Calibrator
from .protocol import workloads as benchmark_workloads
from .shapes import shape_only_predictor
from .telemetry import Telemetry
from .traffic import percentile, real_traffic

SHAPE = "qwen3_5-0.8b"  # the shape every measurement here times, as the benchmark stage does
UNCALIBRATED = Calibrator()


def require_cuda() -> None:
    """Raises RuntimeError off CUDA: these measurements time the CUDA path."""
    if not torch.cuda.is_available():
        raise RuntimeError("needs a CUDA device")


def chosen_workloads(names) -> dict[str, tuple[object, dict]]:
    """Workload name -> (state, questions) for each of `names`, in order.

    Raises:
        ValueError: a name that is not one of the benchmark's workloads (`protocol.workloads`).
    """
    table = benchmark_workloads()
    unknown = [name for name in names if name not in table]
    if unknown:
        raise ValueError(f"unknown workload {', '.join(map(repr, unknown))}; known: {sorted(table)}")
    return {name: table[name] for name in names}


def timed_samples(call, calls: int) -> list[float]:
    """Milliseconds of each of `calls` calls, each bracketed by device synchronisations."""
    samples = []
    for _ in range(calls):
        torch.cuda.synchronize()
        start = time.perf_counter()
        call()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) * 1e3)
    return samples


def warm_up(predictor, state, questions) -> None:
    """Five calls of one request, so its CUDA graph is captured (on the third), then a sync."""
    for _ in range(5):
        predictor.predict(state, questions)
    torch.cuda.synchronize()


def warmed_predictor(workload: str):
    """(the benchmark's shape-only Qwen3.5-0.8B predictor after 5 calls of `workload`, so its
    CUDA graph is captured, the workload's state, its questions).

    Raises:
        RuntimeError: no CUDA device.
        ValueError: an unknown workload.
    """
    require_cuda()
    state, questions = chosen_workloads([workload])[workload]
    predictor = shape_only_predictor(SHAPE)
    warm_up(predictor, state, questions)
    return predictor, state, questions


def block_median(call, calls: int = 300) -> float:
    """Median microseconds of `calls` calls, after 20 untimed ones."""
    for _ in range(20):
        call()
    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        samples.append(time.perf_counter() - start)
    return 1e6 * statistics.median(samples)


def _host_template() -> tuple[ModelConfig, Template]:
    """(config, template) of the shape-only model with Qwen3.5's real tokenizer and a pixel
    policy of 512 x 512, for the host's measurements: no model, no device."""
    config = ModelConfig(base="shape-only", revision="random-weights", dtype="bfloat16", image_pixels=512 * 512)
    return config, Template.of(qwen3_5_tokenizer(), new_image_processor(16, config.image_pixels), config)


def encode_host(workload: str = "distinct_text_50q", blocks: int = 5, calls: int = 300) -> None:
    """The host's part of a request with no device involved: validation, its images' cache keys,
    the template, the packing into a batch and the answers from given logits, for one benchmark
    workload, with Qwen3.5's real tokenizer (its pieces cached, as in a warm predictor; its images
    encoded once, as a warm feature cache holds them).

        python benchmarks/run.py encode_host --workload distinct_text_50q

    Prints the median of each step over `blocks` blocks of `calls` calls, and the smallest block
    median (the host is noisy: compare two commits by running it alternately under each).
    """
    state, questions = chosen_workloads([workload])[workload]
    config, template = _host_template()
    request = parse_request(state, questions, template.reserved)
    images = []
    indices = template.encode_images(request, images)
    rows = template.encode(request, config.max_tokens, indices, images)
    batch = template.collate(rows, images)
    logits = np.random.default_rng(0).standard_normal(tuple(batch.markers.shape)).astype(np.float32)
    mask = batch.candidate_mask.numpy()

    def encoded():  # a warm predictor's path: the images' keys found in its cache, not preprocessed
        parsed = parse_request(state, questions, template.reserved)
        keys = [image_key(image) for image in parsed.images]
        return template.collate(template.encode(parsed, config.max_tokens, indices, images), images), keys

    steps = {
        "parse": lambda: parse_request(state, questions, template.reserved),
        "image keys": lambda: [image_key(image) for image in request.images],
        "template": lambda: template.encode(request, config.max_tokens, indices, images),
        "pack": lambda: template.collate(rows, images),
        "encode (all four)": encoded,
        "answers": lambda: answers_of(logits, mask, [request], [batch.input_tokens], UNCALIBRATED),
    }
    medians = {step: [] for step in steps}
    for _ in range(blocks):
        for step, call in steps.items():
            medians[step].append(block_median(call, calls))
    print(f"## {workload}: {len(rows)} rows, {batch.computed_tokens} computed tokens; us per call")
    for step, values in medians.items():
        print(f"{step:20s} median {statistics.median(values):8.1f}  smallest block {min(values):8.1f}")


def encode_first_sight(count: int = 60, seed: int = 37, rounds: int = 3) -> None:
    """The host's part of real-traffic requests on their first sight, no device involved:
    validation, tokenising (the template's piece cache emptied before each request), every
    image's cache key and pixels (all new) and the packing into a batch; Qwen3.5's real
    tokenizer, a pixel policy of 512 x 512 (`_host_template`). `count` requests of
    `traffic.real_traffic` (a third with an image of 160 to 1,200 px a side), `rounds` times.

        python benchmarks/run.py encode_first_sight --count 60

    Prints one JSON line: milliseconds a request with an image and without, p50 and mean.
    """
    samples: dict[bool, list[float]] = {True: [], False: []}
    for images, steps in _first_sight_steps(count, seed, rounds):
        samples[images].append(steps["encode"] + steps["collate"])
    print(json.dumps({"workload": "encode_first_sight", "requests": count, "rounds": rounds,
                      **{f"{kind}_{name}_ms": round(value(samples[images]), 3)
                         for kind, images in (("image", True), ("text", False))
                         for name, value in (("p50", statistics.median), ("mean", statistics.fmean))}}))


# The host's steps of a new request whose batch a bucket's graph serves, in the order
# `Predictor.predict_many` runs them on CUDA (`GraphedScores.__call__`), up to the replay's launch,
# and the answers after it.
FIRST_SIGHT_STEPS = ("encode", "collate", "layout key", "bucket", "pad", "stage", "answers")


def _first_sight_steps(count: int, seed: int, rounds: int):
    """(whether the request has an image, {step of `FIRST_SIGHT_STEPS`: milliseconds}) of each
    of `count` real-traffic requests, `rounds` times, each on first sight (the template's piece
    cache emptied, images new)."""
    config, template = _host_template()
    buckets = Ladder(all_buckets())  # as a predictor's `GraphedScores.ladder`
    staging = np.empty(PACKED_BYTES, dtype=np.uint8)
    requests = real_traffic(count, seed)
    rng = np.random.default_rng(seed)
    for _ in range(rounds):
        for state, questions in requests:
            template.pieces.clear()
            template.piece_chars = 0
            marks = [time.perf_counter()]
            request = parse_request(state, questions, template.reserved, template.max_images)
            encoded = encode_request(template, config, request)
            marks.append(time.perf_counter())
            batch = template.collate(list(encoded.rows), list(encoded.images))
            marks.append(time.perf_counter())
            layout_key(batch)
            marks.append(time.perf_counter())
            bucket = bucket_for(batch, buckets)
            marks.append(time.perf_counter())
            padded = pad_to_bucket(batch, bucket, 0) if bucket is not None else batch
            marks.append(time.perf_counter())
            tensors = padded.device_tensors()
            offsets, total = packed_layout(tensors)
            if total <= PACKED_BYTES:
                lay_out(tensors, staging, offsets)
            marks.append(time.perf_counter())
            logits = rng.standard_normal(tuple(batch.markers.shape)).astype(np.float32)
            answers_of(logits, candidate_mask([request]), [request], [batch.input_tokens], UNCALIBRATED)
            marks.append(time.perf_counter())
            yield bool(request.images), {step: (after - before) * 1e3
                                         for step, before, after in zip(FIRST_SIGHT_STEPS, marks, marks[1:])}


def host_first_sight(count: int = 80, seed: int = 37, rounds: int = 3) -> None:
    """The host's steps of real-traffic requests on their first sight, as a predictor on CUDA
    runs them for a batch its bucket graphs serve (`FIRST_SIGHT_STEPS`), without the device:
    encode (validation, tokenising with the piece cache emptied, new images' keys and pixels,
    the template), collate (the packed batch), the layout key of an exact graph, the bucket's
    choice, the padding to it, the staging of its tensors' bytes for their one copy (the pinned
    buffer's part of `move_packed`) and the answers from random logits. Qwen3.5's real tokenizer,
    a pixel policy of 512 x 512 (`_host_template`); `count` requests of `traffic.real_traffic`,
    `rounds` times.

        python benchmarks/run.py host_first_sight --count 80

    Prints one JSON line: milliseconds of each step and of all, p50 and mean, for requests with
    an image and without.
    """
    samples: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    for images, steps in _first_sight_steps(count, seed, rounds):
        samples[images].append(steps)
    figures = {}
    for kind, images in (("image", True), ("text", False)):
        for step in (*FIRST_SIGHT_STEPS, "all"):
            values = [sum(steps.values()) if step == "all" else steps[step] for steps in samples[images]]
            for name, value in (("p50", statistics.median), ("mean", statistics.fmean)):
                figures[f"{kind}_{step.replace(' ', '_')}_{name}_ms"] = round(value(values), 4)
    print(json.dumps({"workload": "host_first_sight", "requests": count, "rounds": rounds, **figures}))


STEPS = ("encode", "collate", "layout key", "load into the graph", "embeddings", "replay launch", "version check",
         "wait for the logits", "answers")


@torch.no_grad()
def predict_steps(predictor, state, questions) -> list[float]:
    """Milliseconds of each of `STEPS` in one `predict_many` of the request, as it runs them.

    Raises:
        RuntimeError: the request's layout has no exact CUDA graph, or its batch does not load
            into the graph's inputs in one copy.
    """
    scores, model = predictor.scores, predictor.model
    marks = [time.perf_counter()]
    encoded, parsed, tokens, _ = predictor._encode([(state, questions)], collect=False)
    marks.append(time.perf_counter())
    batch = predictor.engine.collate(encoded, [Piece(0, list(range(len(encoded[0].rows))))])
    marks.append(time.perf_counter())
    key = layout_key(batch)
    marks.append(time.perf_counter())
    graph = scores.graphs.get(key)
    if graph is None:
        raise RuntimeError("the workload's layout has no exact CUDA graph (it was not captured)")
    moved = graph.load(batch)
    if moved is None:
        raise RuntimeError("the workload's batch does not load into its graph's inputs in one copy")
    marks.append(time.perf_counter())
    embeds = None if graph.text else model.embeddings(moved)  # a text graph looks its embeddings up itself
    marks.append(time.perf_counter())
    logits = graph.replay(embeds, moved)
    marks.append(time.perf_counter())
    scores._check_versions()
    marks.append(time.perf_counter())
    logits = logits.cpu().float().numpy()
    marks.append(time.perf_counter())
    answers_of(logits, candidate_mask(parsed), parsed, tokens, predictor.calibrator)
    marks.append(time.perf_counter())
    return [1e3 * (after - before) for before, after in zip(marks, marks[1:])]


def real_traffic_warmed(count: int, seed: int):
    """(the shape-only Qwen3.5-0.8B predictor, graphs prepared, after 10 requests of
    `traffic.real_traffic`; the `count` requests after them, new to it)."""
    predictor = shape_only_predictor(SHAPE)
    requests = real_traffic(10 + count, seed)
    for state, questions in requests[:10]:
        predictor.predict(state, questions)
    return predictor, requests[10:]


def traffic_kind(state, prefixed: bool) -> str:
    """A real-traffic request's kind: "text" or "image", then "prefix" when its rows share one,
    else "rows"."""
    return ("image" if "image" in state else "text") + (" prefix" if prefixed else " rows")


# The steps of a request a bucket's graphs serve, as `Predictor.predict_many` runs them on CUDA:
# encoding, `Engine.run`'s plan, then `Engine.launch` (the collation, its start event,
# `GraphedScores.__call__`'s bucket path, the logits' copy to pinned memory and the end event),
# `Engine.finish` (the wait, the logits as float32) and the answers.
BUCKET_STEPS = ("encode", "plan", "collate", "layout key", "bucket", "pad", "load into the graph", "embeddings",
                "replay launch", "version check", "logits copy", "wait for the logits", "answers")


@torch.no_grad()
def bucket_steps(predictor, state, questions) -> tuple[bool, list[float]] | None:
    """(whether the request has a shared prefix, milliseconds of each of `BUCKET_STEPS`) of one
    `predict_many` of the request served by a bucket's graphs, as it runs them, or None when no
    bucket serves it or it has an exact graph (its encoding and collation then ran, nothing on
    the device). The steps are timed on the host with no synchronisation between them: each is
    host time but the wait, the device's remaining work (a one-row bucket's replay is one launch;
    a prefix bucket's launches its pieces and runs its attention cores between them)."""
    scores, model, engine = predictor.scores, predictor.model, predictor.engine
    marks = [time.perf_counter()]
    encoded, parsed, tokens, _ = predictor._encode([(state, questions)], collect=False)
    marks.append(time.perf_counter())
    invocations = plan(encoded, engine.admits, engine.cost)
    marks.append(time.perf_counter())
    if len(invocations) != 1:
        return None
    batch = engine.collate(encoded, invocations[0])
    marks.append(time.perf_counter())
    key = layout_key(batch)
    marks.append(time.perf_counter())
    if key in scores.graphs:
        return None
    bucket = bucket_for(batch, scores.ladder) if scores.buckets else None
    marks.append(time.perf_counter())
    if bucket is None:
        return None
    device = model.device
    with torch.cuda.device(device):
        stream = torch.cuda.current_stream(device)
        started = torch.cuda.Event(enable_timing=True)
        started.record(stream)
        graphs = scores.buckets[bucket]
        padded = pad_to_bucket(batch, bucket, scores.pad_id)
        marks.append(time.perf_counter())
        padded = graphs.load(padded) or padded.moved(device)
        marks.append(time.perf_counter())
        embeds = model.embeddings(padded)
        marks.append(time.perf_counter())
        logits = graphs.replay(embeds, padded)[: batch.markers.shape[0], : batch.markers.shape[1]]
        marks.append(time.perf_counter())
        if scores.changed_during_replay():  # as `_replay_bucket` reads them, while the device replays
            raise RuntimeError("a weight changed in place during the measurement")
        marks.append(time.perf_counter())
        pinned = torch.empty(logits.shape, dtype=logits.dtype, pin_memory=True)
        pinned.copy_(logits, non_blocking=True)
        done = torch.cuda.Event(enable_timing=True)
        done.record(stream)
    marks.append(time.perf_counter())
    done.synchronize()
    started.elapsed_time(done)  # `finish` reads the run's device time
    logits = pinned.float().numpy()
    marks.append(time.perf_counter())
    answers_of(logits, candidate_mask(parsed), parsed, tokens, predictor.calibrator)
    marks.append(time.perf_counter())
    return bool(batch.prefix_tokens), [1e3 * (after - before) for before, after in zip(marks, marks[1:])]


def real_traffic_steps(count: int = 60, seed: int = 37) -> None:
    """The host's steps of real-traffic first sights that a bucket's graphs serve (issue 37), each
    timed in place (`bucket_steps`, no profiler): the workload of `real_traffic` on the
    shape-only Qwen3.5-0.8B predictor, graphs prepared as a server loads, 10 requests of it first.

        python benchmarks/run.py real_traffic_steps --count 60

    Prints the p50 of each step and of their sum by kind (text or image, with or without a shared
    prefix), and how many requests no bucket served (skipped)."""
    require_cuda()
    predictor, requests = real_traffic_warmed(count, seed)
    samples: dict[str, list[list[float]]] = {}
    skipped = 0
    for state, questions in requests:
        timed = bucket_steps(predictor, state, questions)
        if timed is None:
            skipped += 1
            continue
        prefixed, steps = timed
        samples.setdefault(traffic_kind(state, prefixed), []).append(steps)
    print(f"{count} real-traffic first sights, {skipped} served by no bucket (skipped); p50 ms of each step",
          flush=True)
    kinds = sorted(samples)
    print(f"{'step':22s}" + "".join(f"{kind:>14s}" for kind in kinds))
    print(f"{'requests':22s}" + "".join(f"{len(samples[kind]):14d}" for kind in kinds))
    for index, step in enumerate(BUCKET_STEPS):
        print(f"{step:22s}" + "".join(f"{statistics.median(s[index] for s in samples[kind]):14.3f}" for kind in kinds))
    print(f"{'sum':22s}" + "".join(f"{statistics.median(sum(s) for s in samples[kind]):14.3f}" for kind in kinds),
          flush=True)


def host_steps(workloads: tuple[str, ...] = ("distinct_text_1q", "vision_protocol_image_1q")) -> None:
    """The host's steps of a repeated workload's `predict`: as it replays its exact CUDA graph, or
    as `bucket_steps` times them where a bucket's graphs serve it.

        python benchmarks/run.py host_steps --workloads distinct_text_1q vision_protocol_image_1q

    On the shape-only Qwen3.5-0.8B predictor (random weights, bf16) warmed up on the workload, each
    of 100 calls runs `Predictor.predict_many`'s steps one after another as it does (encode; the
    layout key, the load into the graph's inputs, the embeddings, the replay's launch and the
    weight-version check, which runs while the device replays, inside `GraphedScores`; the wait for
    the logits; the answers), timed on the host with no synchronisation between them, so each
    step's time is its host time, except the wait, which is the device's remaining work. Prints
    the p50 of each step and of their sum, beside the p50 of 100 plain `predict` calls.
    """
    table = chosen_workloads(workloads)
    predictor, _, _ = warmed_predictor(workloads[0])
    for name, (state, questions) in table.items():
        warm_up(predictor, state, questions)
        first = bucket_steps(predictor, state, questions)
        bucketed = first is not None
        if bucketed:  # no exact graph: a bucket's graphs serve it, timed as `bucket_steps` runs them
            samples = [first[1]] + [bucket_steps(predictor, state, questions)[1] for _ in range(99)]
            steps = BUCKET_STEPS
        else:
            samples, steps = [predict_steps(predictor, state, questions) for _ in range(100)], STEPS
        plain = timed_samples(lambda state=state, questions=questions: predictor.predict(state, questions), 100)
        print(f"## {name}: p50 of 100 calls (ms), {'a bucket' if bucketed else 'its exact graph'} serving it; "
              f"plain predict p50 {statistics.median(plain):.3f}")
        for index, step in enumerate(steps):
            print(f"{step:22s} {statistics.median(sample[index] for sample in samples):7.3f}")
        print(f"{'sum':22s} {statistics.median(sum(sample) for sample in samples):7.3f}", flush=True)


@torch.no_grad()
def host_profile(workloads: tuple[str, ...] = ("distinct_text_1q", "vision_protocol_image_1q", "distinct_text_50q"),
                 rounds: int = 4) -> None:
    """Where a repeated workload's host time goes, and what the benchmark's NVML sampler costs it.

        python benchmarks/run.py host_profile --workloads distinct_text_1q vision_protocol_image_1q > host.txt

    For each workload, on one shape-only Qwen3.5-0.8B predictor (random weights, bf16) warmed up
    on it: `rounds` alternations of 30 `predict` calls alone and 30 under the benchmark's
    `Telemetry` (p50 of each block, so drift between blocks shows), then cProfile of 100 calls,
    the functions with the most own time. A replay's device time shows as the own time of the
    call that waits for the logits (`Tensor.cpu`).
    """
    table = chosen_workloads(workloads)
    predictor, _, _ = warmed_predictor(workloads[0])
    device = predictor.model.device
    for name, (state, questions) in table.items():
        call = lambda state=state, questions=questions: predictor.predict(state, questions)
        warm_up(predictor, state, questions)
        alone, sampled = [], []
        for _ in range(rounds):
            alone.append(statistics.median(timed_samples(call, 30)))
            with Telemetry(device):
                sampled.append(statistics.median(timed_samples(call, 30)))
        print(f"## {name}: predict p50 of 30 calls, {rounds} alternating blocks", flush=True)
        print("alone           " + " ".join(f"{value:6.3f}" for value in alone))
        print("under Telemetry " + " ".join(f"{value:6.3f}" for value in sampled))
        cprofiled([call] * 100, 30)


def cprofiled(calls, rows: int = 25) -> None:
    """cProfile of `calls` run in turn, then a device synchronisation: the `rows` functions with
    the most own time (the wait for the device shows as the own time of the call that waits)."""
    profiler = cProfile.Profile()
    profiler.enable()
    for call in calls:
        call()
    torch.cuda.synchronize()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(rows)
    print(text.getvalue(), flush=True)


# Telemetry windows in run order: (label, sampling interval in seconds or None for none).
WINDOWS = (("none", None), ("telemetry 0.01", 0.01), ("none", None), ("telemetry 0.1", 0.1),
           ("telemetry 0.01", 0.01))


def telemetry_overhead(workload: str = "distinct_text_50q", calls: int = 200) -> None:
    """Telemetry's observer effect on a repeated workload's `predict`.

        python benchmarks/run.py telemetry_overhead --workload distinct_text_50q

    On the shape-only Qwen3.5-0.8B predictor (random weights, bf16) warmed up on the workload,
    prints the p50 and p95 of `calls` calls without telemetry and with NVML sampled every 10 and
    100 ms, in that order, then once more each without and at 10 ms: the sampler is a thread of
    the timed process.
    """
    predictor, state, questions = warmed_predictor(workload)

    def call():
        predictor.predict(state, questions)

    for label, interval in WINDOWS:
        if interval is None:
            samples = timed_samples(call, calls)
        else:
            with Telemetry(torch.device("cuda"), interval_s=interval):
                samples = timed_samples(call, calls)
        print(f"{label:16s} p50 {percentile(samples, 0.5):.3f} p95 {percentile(samples, 0.95):.3f}", flush=True)
