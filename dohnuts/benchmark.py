"""Latency benchmark of complete predict() calls over the upstream-matched workloads."""

from __future__ import annotations

import inspect
import platform
import resource
import statistics
import time

import torch
from PIL import Image, ImageDraw

from .schema import parse_request

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


def _measure(call, device: torch.device, warmup: int, timed: int) -> tuple[float, list[float], object]:
    """One cold call, `warmup` warm-up calls, then `timed` calls, each bracketed by syncs.

    Returns (cold ms, timed samples in ms, the cold call's result)."""
    def once():
        _synchronize(device)
        start = time.perf_counter()
        result = call()
        _synchronize(device)
        return (time.perf_counter() - start) * 1000.0, result

    cold_ms, result = once()
    for _ in range(warmup):
        once()
    return cold_ms, [once()[0] for _ in range(timed)], result


@torch.no_grad()
def hugging_face_logits(predictor, state, questions) -> torch.Tensor:
    """The baseline on the same inputs: Hugging Face's own `Qwen3_5Model` forward over the
    request's rows padded to the longest (no packing, no shared prefix), then the same
    marker gather and head. Returns logits [B, K]."""
    template, backbone, device = predictor.template, predictor.model.backbone, predictor.model.device
    request = parse_request(state, questions, template.reserved)
    image = template.encode_image(request.image) if request.image is not None else None
    rows = template.encode(request, predictor.config.max_tokens, 0, image)
    length = max(len(row.input_ids) for row in rows)
    ids = torch.full((len(rows), length), template.pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for index, row in enumerate(rows):
        ids[index, : len(row.input_ids)] = torch.tensor(row.input_ids)
        mask[index, : len(row.input_ids)] = 1
    ids, mask = ids.to(device), mask.to(device)
    kwargs = {}
    if image is not None:
        kwargs = {"pixel_values": image.pixel_values.repeat(len(rows), 1).to(device),
                  "image_grid_thw": image.grid_thw.repeat(len(rows), 1).to(device)}
        if "mm_token_type_ids" in inspect.signature(backbone.forward).parameters:  # transformers >= 5.23
            kwargs["mm_token_type_ids"] = (ids == template.image_pad_id).int()
    hidden = backbone(input_ids=ids, attention_mask=mask, use_cache=False, **kwargs).last_hidden_state
    markers = torch.zeros((len(rows), max(len(row.markers) for row in rows)), dtype=torch.long)
    for index, row in enumerate(rows):
        markers[index, : len(row.markers)] = torch.tensor(row.markers)
    picked = hidden[torch.arange(len(rows), device=device)[:, None], markers.to(device)]
    return predictor.model.head(picked.to(predictor.model.head.weight.dtype)).squeeze(-1)


def run_workload(predictor, name: str, state, questions, warmup: int, timed: int) -> dict:
    """Our predict() and the Hugging Face baseline on one workload, under the same protocol."""
    device = predictor.model.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    cold_ms, samples, result = _measure(lambda: predictor.predict(state, questions), device, warmup, timed)
    memory = {"max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if device.type == "cuda":
        memory["peak_allocated_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
        memory["peak_reserved_mib"] = torch.cuda.max_memory_reserved(device) / 2**20
    _, baseline, _ = _measure(lambda: hugging_face_logits(predictor, state, questions), device, warmup, timed)
    batch, _ = predictor.encode(state, questions)
    mean = statistics.fmean(samples)
    return {
        "workload": name, "questions": len(questions), "cold_ms": cold_ms,
        "p50_ms": percentile(samples, 0.5), "p95_ms": percentile(samples, 0.95), "mean_ms": mean,
        "decisions_per_second": 1000.0 * len(questions) / mean,
        "hugging_face_p50_ms": percentile(baseline, 0.5),
        "input_tokens": result["usage"]["input_tokens"], "computed_tokens": batch.computed_tokens,
        "shared_prefixes": 0 if batch.fork is None else len(batch.prefix_cu_seqlens) - 1,
        "image_grid_thw": None if batch.image_grid_thw is None else batch.image_grid_thw.tolist(),
        "samples_ms": samples, "hugging_face_samples_ms": baseline, "memory": memory,
    }


def training_requests(template, microbatch: int, rows: int, questions_per_state: int = 4):
    """`rows` rows of about 300 tokens: states of about 250 tokens, `questions_per_state`
    questions each, so the rows of a state share a prefix."""
    names = list(distinct_questions(50).items())
    out = []
    for state_index in range(rows // questions_per_state):
        note = " ".join(f"line {microbatch}-{state_index}-{i}: the customer wrote again about the invoice."
                        for i in range(6))
        chosen = names[(state_index * questions_per_state) % 50:][:questions_per_state]
        out.append(({**DISTINCT_STATE, "note": note}, dict(chosen)))
    return out


def training_update_record(model, template, microbatches: int = 4, rows: int = 8, timed: int = 5) -> dict:
    """Seconds per training update on the shared-prefix path: fresh LoRA injected into `model`
    (in place), activation checkpointing, `microbatches` of `rows` rows at one snapshot, RLCD +
    cross-entropy, clipping, one AdamW step."""
    from .config import LoraConfig, ObjectiveConfig
    from .model import with_lora
    from .objective import rlcd_loss

    with_lora(model.backbone, LoraConfig(), seed=0)
    model.activation_checkpointing = True
    model.train()
    device = model.device
    parameters = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(parameters, lr=1e-4, weight_decay=0.01)
    batches = []
    for micro in range(microbatches):
        encoded = []
        for state, questions in training_requests(template, micro, rows):
            encoded += template.encode(parse_request(state, questions, template.reserved), 2048)
        batch = template.collate(encoded, [])
        targets = torch.nn.functional.one_hot(torch.arange(len(encoded)) % 4, batch.markers.shape[1]).float()
        batches.append((batch, targets))

    def update():
        for batch, targets in batches:
            batch = batch.to(device)
            logits = model(batch)
            out = rlcd_loss(logits, batch.candidate_mask, targets.to(device),
                            torch.zeros(len(targets), dtype=torch.bool, device=device), ObjectiveConfig())
            (out.loss / microbatches).backward()
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    cold_ms, samples, _ = _measure(update, device, 1, timed)
    record = {
        "workload": "training_update", "microbatches": microbatches, "rows_per_microbatch": rows,
        "input_tokens": sum(batch.input_tokens for batch, _ in batches),
        "computed_tokens": sum(batch.computed_tokens for batch, _ in batches),
        "cold_ms": cold_ms, "p50_ms": percentile(samples, 0.5), "samples_ms": samples,
    }
    record["tokens_per_second"] = 1000.0 * record["input_tokens"] / record["p50_ms"]
    if device.type == "cuda":
        record["peak_allocated_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
    model.eval()
    return record


def environment(predictor) -> dict:
    device = predictor.model.device
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "device_type": device.type, "torch": torch.__version__, "threads": torch.get_num_threads(),
        "dtype": predictor.config.dtype, "base": predictor.config.base,
        "shape_only": predictor.config.base.startswith("shape-only:"),
    }


def benchmark(predictor, warmup: int, timed: int, progress=None) -> tuple[list[dict], dict]:
    """Run every workload, then one training-update record (which injects fresh LoRA into the
    predictor's model, so it comes last). `progress(records so far)` follows each record.
    Returns (raw records, summary for DVC metrics)."""
    env = environment(predictor)
    records = []
    for name, (state, questions) in workloads().items():
        records.append({**run_workload(predictor, name, state, questions, warmup, timed), "environment": env})
        if progress is not None:
            progress(records)
    training = {**training_update_record(predictor.model, predictor.template), "environment": env}
    if progress is not None:
        progress(records + [training])
    keys = ("p50_ms", "p95_ms", "mean_ms", "cold_ms", "decisions_per_second", "hugging_face_p50_ms")
    summary = {"environment": env,
               "workloads": {record["workload"]: {key: record[key] for key in keys} for record in records},
               "training_update": {key: training[key] for key in ("p50_ms", "tokens_per_second")}}
    return records + [training], summary
