"""How the server's batching behaves: answers batched against alone, and the serving workload
alone. Bench and serve are peers, so the caller hands in serve's parts (the app factory, the
wire parser), as the benchmark stage does."""

from __future__ import annotations

import json
import sys

from .host import SHAPE, require_cuda
from .records import environment
from .serving import mixed_requests, serving_record
from .shapes import shape_only_predictor
from .stage import describe


def batched_vs_alone(count: int = 32, *, parse_body) -> None:
    """How far a request's answers move when it is batched with others, on the shape-only
    Qwen3.5-0.8B predictor in bf16 (the server's batching): `predict_many` over the serving
    workload's varied requests against `predict` on each alone.

        python benchmarks/run.py batched_vs_alone --count 32 > batched-vs-alone.txt

    `parse_body` reads a wire body into (state, questions, ...) (`dohnuts.serve.wire.parse_system_one`).
    """
    require_cuda()
    predictor = shape_only_predictor(SHAPE)
    requests = [parse_body(body)[:2] for body in mixed_requests(count, seed=1)]
    batched = predictor.predict_many(requests)
    worst = 0.0
    for request, together in zip(requests, batched):
        alone = predictor.predict(*request)
        for qid, answer in alone["answers"].items():
            gap = max(abs(a - b) for a, b in zip(answer["probabilities"].values(),
                                                  together["answers"][qid]["probabilities"].values()))
            worst = max(worst, gap)
    questions = sum(len(request[1]) for request in requests)
    print(f"{count} requests, {questions} questions, one batch against each alone (bf16, shape-only): "
          f"largest probability difference {worst:.3e}")


def serving_workload(requests: int = 256, clients: tuple[int, ...] = (1, 8, 64), *, app_factory) -> None:
    """The benchmark's serving workload alone, on the shape-only Qwen3.5-0.8B predictor the
    benchmark stage times: the server on loopback, `requests` varied requests at each client count.

        python benchmarks/run.py serving_workload --requests 256 --clients 1 8 64 > serving.json

    Prints the record (JSON) on stdout and one line per client count on stderr. `app_factory`
    builds the served app as `serving.serving_record` takes it.
    """
    require_cuda()
    predictor = shape_only_predictor(SHAPE)
    record = {**serving_record(predictor, requests, clients, app_factory), "environment": environment(predictor)}
    print(describe(record), file=sys.stderr)
    print(json.dumps(record))
