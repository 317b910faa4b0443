"""The varied-traffic workload: distinct request layouts, each timed on first sight, then again."""

from __future__ import annotations

import dataclasses
import statistics
import time

from ..ops.compiles import kernel_variants
from ..runtime.cuda_graphs import layout_key
from .baseline import baseline_rows, hugging_face_logits
from .telemetry import synchronize
from .traffic import percentile, real_traffic, serving_mix, varied_requests

# The generators `real_traffic_record` can time: issue 37's real traffic, or the serving mix the
# load harness sends (issue 36's one-client line, here without HTTP, front end or engine process).
MIXES = {"real": real_traffic, "serving": serving_mix}


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
    # The engine's stages of each call (`Engine.stage_seconds`): prepare (the host's packing,
    # copies and launches), run (on CUDA the device's time from the invocation's first launch to
    # its logits, gaps included) and finish (the wait for the logits, then their copy).
    engine_stages = predictor.engine.stage_seconds
    stages = {stage: [] for stage in engine_stages}
    compiled = kernel_variants()
    for state, questions in requests:
        before = [source[counter] for source, _, counter in counted]
        staged = dict(engine_stages)
        synchronize(device)
        start = time.perf_counter()
        predictor.predict(state, questions)
        synchronize(device)
        samples.append((time.perf_counter() - start) * 1000.0)
        for (source, name, counter), value in zip(counted, before):
            calls[name] += source[counter] - value
        for stage, seconds in staged.items():
            stages[stage].append((engine_stages[stage] - seconds) * 1000.0)
    now = kernel_variants()  # Triton's compiles and autotunes on the timed requests: none is the aim
    calls["triton_compiles"], calls["triton_autotunes"] = (now[key] - compiled[key] for key in ("compiled", "tuned"))
    images = [ms for ms, (state, _) in zip(samples, requests) if "image" in state]
    texts = [ms for ms, (state, _) in zip(samples, requests) if "image" not in state]
    return {"p50_ms": percentile(samples, 0.5), "p95_ms": percentile(samples, 0.95),
            "p99_ms": percentile(samples, 0.99), "mean_ms": statistics.fmean(samples), "max_ms": max(samples),
            "text_p50_ms": percentile(texts, 0.5) if texts else None,
            "image_p50_ms": percentile(images, 0.5) if images else None,
            "decisions_per_second": 1000.0 * sum(len(q) for _, q in requests) / sum(samples),
            "engine_stages_p50_ms": {stage: percentile(values, 0.5) for stage, values in stages.items()},
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
    baseline = _hugging_face_samples(predictor, warm, timed)
    tokens = [sum(len(row.input_ids) for row in baseline_rows(predictor, *request)[1]) for request in timed]
    return {
        "workload": "varied_traffic", "requests": len(timed), "seed": seed, "warmup_requests": len(warm),
        "image_requests": sum("image" in state for state, _ in timed),
        "questions": [len(questions) for _, questions in timed], "input_tokens": tokens,
        "first_sight": first, "second_pass": second,
        **preparation(predictor),
        "hugging_face_p50_ms": percentile(baseline, 0.5), "hugging_face_p99_ms": percentile(baseline, 0.99),
        "hugging_face_samples_ms": baseline,
    }


def preparation(predictor) -> dict:
    """What the predictor's load prepared: the shape buckets ready, those whose capture failed and
    the seconds their graphs took, the vision buckets and theirs."""
    stats = predictor.scores.stats
    return {"buckets": len(predictor.scores.buckets), "bucket_prepare_seconds": stats["prepare_seconds"],
            "failed_bucket_captures": stats["failed_buckets"],
            "vision_buckets": [dataclasses.asdict(bucket) for bucket in predictor.model.vision_graphs.buckets],
            "vision_bucket_prepare_seconds": predictor.model.vision_graphs.prepare_seconds}


def _hugging_face_samples(predictor, warm, timed) -> list[float]:
    """Milliseconds of Hugging Face's padded forward on each `timed` request, after one untimed
    pass over `warm`."""
    for state, questions in warm:
        hugging_face_logits(predictor, state, questions)
    samples = []
    for state, questions in timed:
        synchronize(predictor.model.device)
        start = time.perf_counter()
        hugging_face_logits(predictor, state, questions)
        synchronize(predictor.model.device)
        samples.append((time.perf_counter() - start) * 1000.0)
    return samples


def real_traffic_record(predictor, count: int, seed: int = 37, warmup: int = 10, mix: str = "real") -> dict:
    """The real-traffic workload (issue 37): `warmup` requests of the real-traffic generator sent
    first, then `count` others, each timed once, on first sight: its layout and its image new
    (`traffic.real_traffic`: up to 1,500 words, 20 questions, 40 options, a third with an image
    of 160 to 1,200 pixels a side; or, with `mix` "serving", `traffic.serving_mix`). The pass
    counts the kernels Triton compiled or tuned on the timed requests; Hugging Face's padded
    forward runs on the same requests.

    Raises:
        ValueError: `mix` is not one of MIXES.
    """
    if mix not in MIXES:
        raise ValueError(f"unknown mix {mix!r}: one of {', '.join(MIXES)}")
    requests = MIXES[mix](warmup + count, seed)
    warm, timed = requests[:warmup], requests[warmup:]
    for state, questions in warm:
        predictor.predict(state, questions)
    first = _timed_pass(predictor, timed)
    baseline = _hugging_face_samples(predictor, warm[:2], timed)
    tokens = [sum(len(row.input_ids) for row in baseline_rows(predictor, *request)[1]) for request in timed]
    return {
        "workload": "real_traffic" if mix == "real" else f"real_traffic_{mix}_mix", "requests": len(timed),
        "seed": seed, "warmup_requests": len(warm),
        "image_requests": sum("image" in state for state, _ in timed),
        "image_sides": [list(state["image"].size) for state, _ in timed if "image" in state],
        "questions": [len(questions) for _, questions in timed], "input_tokens": tokens,
        "first_sight": first, **preparation(predictor),
        "hugging_face_p50_ms": percentile(baseline, 0.5), "hugging_face_p99_ms": percentile(baseline, 0.99),
        "hugging_face_max_ms": max(baseline), "hugging_face_samples_ms": baseline,
    }

