"""The long-context workload (issue 37): requests of many thousand tokens, up to the wire
format's budgets (32,768 tokens a row: the state and one question; 65,536 a request), each
timed on first sight and once more, with its tokens a second and its peak device memory."""

from __future__ import annotations

import time

import torch

from ..inputs.template import OverBudget
from .telemetry import synchronize
from .traffic import WORDS

MARGIN = 256  # tokens a row's template adds around its state and question, and then some


def text_of_tokens(tokenizer, tokens: int, offset: int = 0) -> str:
    """Plain words that tokenise to about `tokens` tokens (`offset` varies which words)."""
    words = " ".join(WORDS[(offset + index * 7) % len(WORDS)] for index in range(tokens + 16))
    return tokenizer.decode(tokenizer(words, add_special_tokens=False)["input_ids"][:tokens])


def long_request(tokenizer, tokens: int, max_tokens: int) -> tuple[dict, dict]:
    """A request of about `tokens` input tokens. Within the row budget `max_tokens`: a state of
    that length and one yes/no question. Past it: a state of half a row and as many questions,
    each with instructions of half a row, as bring the request near `tokens` (not past it)."""
    if tokens <= max_tokens - MARGIN:
        return ({"document": text_of_tokens(tokenizer, tokens - MARGIN)},
                {"q0": {"type": "noul", "instructions": "Does the document mention a refund?"}})
    half = max_tokens // 2 - MARGIN
    count = max(1, (tokens - half) // half)
    questions = {f"q{index}": {"type": "noul", "instructions": text_of_tokens(tokenizer, half, index + 1)
                               + " Is this described in the document?"} for index in range(count)}
    return {"document": text_of_tokens(tokenizer, half)}, questions


def exact_request(predictor, tokens: int) -> tuple[dict, dict]:
    """`long_request` of `tokens` input tokens: a one-question request's state grown by what its
    template added short of them (MARGIN is a bound, about 200 tokens above what it adds), where
    the row budget allows. Its text is new to the template's piece cache: the request encoded to
    count is a shorter one."""
    tokenizer, budget = predictor.template.tokenizer, predictor.config.max_tokens
    state, questions = long_request(tokenizer, tokens, budget)
    if len(questions) == 1:
        short = tokens - predictor.encode(state, questions)[0].input_tokens
        if short > 0 and tokens + short <= budget - MARGIN:
            state, questions = long_request(tokenizer, tokens + short, budget)
    return state, questions


@torch.no_grad()
def long_context_record(predictor, lengths: tuple[int, ...]) -> dict:
    """Each of `lengths` as an `exact_request`: first-sight and second-call milliseconds, computed
    tokens a second (second call), the peak device memory the call added (CUDA), and what ran
    (eager or graphs); a request over the model's budgets is recorded as refused, with why. The
    first sight tokenises the request's text (the template keeps recent pieces' ids: the second
    call finds them)."""
    device, config = predictor.model.device, predictor.config
    results = []
    for tokens in lengths:
        state, questions = exact_request(predictor, tokens)
        stats = predictor.scores.stats
        before = dict(stats)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        resident = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        calls = []
        try:
            for _ in range(2):
                synchronize(device)
                start = time.perf_counter()
                answer = predictor.predict(state, questions)
                synchronize(device)
                calls.append((time.perf_counter() - start) * 1000.0)
        except OverBudget as error:
            results.append({"target_tokens": tokens, "refused": str(error)})
            continue
        batch, _ = predictor.encode(state, questions)
        peak = torch.cuda.max_memory_allocated(device) - resident if device.type == "cuda" else None
        results.append({
            "target_tokens": tokens, "input_tokens": answer["usage"]["input_tokens"],
            "computed_tokens": batch.computed_tokens, "rows": len(questions),
            "first_sight_ms": calls[0], "second_ms": calls[1],
            "computed_tokens_per_second": batch.computed_tokens / (calls[1] / 1000.0),
            "peak_memory_bytes": peak,
            "timed_calls": {name: stats[name] - before[name] for name in ("eager", "bucket_replays", "replays",
                                                                          "captures")},
        })
    return {"workload": "long_context", "max_tokens": config.max_tokens,
            "max_request_tokens": config.max_request_tokens, "requests": results}

