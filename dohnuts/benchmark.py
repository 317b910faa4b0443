"""Latency benchmark of complete predict() calls over the upstream-matched workloads."""

from __future__ import annotations

import platform
import resource
import statistics
import time

import torch
from PIL import Image, ImageDraw

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


def percentile(samples: list[float], q: float) -> float:
    """Linear interpolation at index q * (n - 1) of the sorted samples."""
    ordered = sorted(samples)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_call(predictor, state, questions) -> tuple[float, dict]:
    _synchronize(predictor.model.device)
    start = time.perf_counter()
    result = predictor.predict(state, questions)
    _synchronize(predictor.model.device)
    return (time.perf_counter() - start) * 1000.0, result


def run_workload(predictor, name: str, state, questions, warmup: int, timed: int) -> dict:
    """One cold call, `warmup` warm-up calls, then `timed` calls, each between syncs."""
    device = predictor.model.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    cold_ms, result = _timed_call(predictor, state, questions)
    for _ in range(warmup):
        _timed_call(predictor, state, questions)
    samples = [_timed_call(predictor, state, questions)[0] for _ in range(timed)]
    batch, _ = predictor.encode(state, questions)
    mean = statistics.fmean(samples)
    memory = {"max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if device.type == "cuda":
        memory["peak_allocated_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
        memory["peak_reserved_mib"] = torch.cuda.max_memory_reserved(device) / 2**20
    return {
        "workload": name, "questions": len(questions), "cold_ms": cold_ms,
        "p50_ms": percentile(samples, 0.5), "p95_ms": percentile(samples, 0.95), "mean_ms": mean,
        "decisions_per_second": 1000.0 * len(questions) / mean,
        "input_tokens": result["usage"]["input_tokens"], "computed_tokens": batch.computed_tokens,
        "shared_prefixes": 0 if batch.fork is None else len(batch.prefix_cu_seqlens) - 1,
        "image_grid_thw": None if batch.image_grid_thw is None else batch.image_grid_thw.tolist(),
        "samples_ms": samples, "memory": memory,
    }


def environment(predictor) -> dict:
    device = predictor.model.device
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "device_type": device.type, "torch": torch.__version__, "threads": torch.get_num_threads(),
        "dtype": predictor.config.dtype, "base": predictor.config.base,
    }


def benchmark(predictor, warmup: int, timed: int, progress=None) -> tuple[list[dict], dict]:
    """Run every workload. Returns (raw records, summary for DVC metrics)."""
    env = environment(predictor)
    records = []
    for name, (state, questions) in workloads().items():
        records.append({**run_workload(predictor, name, state, questions, warmup, timed), "environment": env})
        if progress is not None:
            progress(name)
    summary = {"environment": env, "workloads": {
        record["workload"]: {key: record[key] for key in ("p50_ms", "p95_ms", "mean_ms", "cold_ms", "decisions_per_second")}
        for record in records}}
    return records, summary
