"""The upstream measurement protocol's workloads: one request repeated (a replay figure), our
`predict` against Hugging Face's padded forward on the same inputs, under one timing protocol."""

from __future__ import annotations

import statistics

import torch
from PIL import Image, ImageDraw

from .baseline import baseline_rows, hugging_face_logits, padded_baseline
from .records import measure_calls, roofline_record
from .telemetry import Telemetry
from .traffic import percentile

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

def protocol_images() -> dict:
    """Four images in one state (`vision_protocol_images_4q`): the protocol's canvas with its
    square in another colour and place in each, two under keys and two in a list."""
    images = []
    for index, colour in enumerate([(220, 20, 20), (20, 60, 220), (20, 160, 40), (240, 200, 0)]):
        image = Image.new("RGB", (96, 96), "white")
        corner = 8 + 16 * index
        ImageDraw.Draw(image).rectangle([corner, corner, corner + 40 - 1, corner + 40 - 1], fill=colour)
        images.append(image)
    return {"front": images[0], "back": images[1], "details": images[2:]}

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
        # Four images, three questions (the workload of the several-images issue).
        "vision_protocol_images_4q": (protocol_images(), THREE_QUESTIONS),
    }
    for count in (1, 5, 10, 50):
        cases[f"distinct_text_{count}q"] = (DISTINCT_STATE, distinct_questions(count))
    return cases

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
        cold_ms, samples, result, calls = measure_calls(call, device, warmup, timed, lambda: predictor.scores.stats)
    _, baseline, _, _ = measure_calls(lambda: hugging_face_logits(predictor, state, questions), device, warmup, timed)
    ours = predictor.predict_many([(state, questions)], raw_logits=True)[0]["logits"]
    theirs = hugging_face_logits(predictor, state, questions).float().cpu()
    difference = max((theirs[index, : len(values)] - torch.tensor(values)).abs().max().item()
                     for index, values in enumerate(ours.values()))
    if cache_miss:
        model.image_cache.clear()  # the batch as the timed calls built it: pixels included
    batch, _ = predictor.encode(state, questions)
    _, rows = baseline_rows(predictor, state, questions)
    mean, p50 = statistics.fmean(samples), percentile(samples, 0.5)
    return {
        "workload": name + ("_cache_miss" if cache_miss else ""), "questions": len(questions), "cold_ms": cold_ms,
        "p50_ms": p50, "p95_ms": percentile(samples, 0.95), "mean_ms": mean,
        "decisions_per_second": 1000.0 * len(questions) / mean,
        "hugging_face_p50_ms": percentile(baseline, 0.5), "hugging_face": padded_baseline(rows),
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
