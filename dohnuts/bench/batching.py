"""How the server's batching behaves: the batcher's policy on the host alone, answers batched
against alone, and the serving workload alone. Bench and serve are peers, so the caller hands in
serve's parts (the app factory, the batcher, the wire parser), as the benchmark stage does."""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time

import numpy as np

from ..runtime.predict import answers_of
from ..schema import parse_request
from .host import SHAPE, TEMPERATURES, require_cuda
from .records import environment
from .serving import LoopbackServer, drive, mixed_requests, serving_record
from .shapes import shape_only_predictor
from .stage import describe


class Instant:
    """The predictor's own results (`predict.answers_of`) from zero logits, at once."""

    def predict_many(self, requests, errors="return"):
        parsed = [parse_request(state, questions) for state, questions in requests]
        counts = [len(question.labels) for request in parsed for question in request.questions]
        mask = np.arange(max(counts))[None, :] < np.array(counts)[:, None]
        return answers_of(np.zeros(mask.shape, dtype=np.float32), mask, parsed, [1] * len(parsed), TEMPERATURES)


class StandIn:
    """Takes 6 ms a call plus 0.3 ms a request, as a small model's forward might."""

    def __init__(self):
        self.sizes = []

    def predict_many(self, requests, errors="return"):
        self.sizes.append(len(requests))
        time.sleep(0.006 + 0.0003 * len(requests))
        return [state for state, _ in requests]


def server_overhead(app_factory) -> None:
    """The server's own host work: p50 and p95 of three passes of 64 varied requests from one
    client over loopback, to the app over an `Instant` predictor."""
    server = LoopbackServer(app_factory(Instant(), "instant"))
    bodies = mixed_requests(16)
    try:
        drive(server.port, bodies, 1)  # warm
        for _ in range(3):
            level = drive(server.port, bodies * 4, 1)
            print(f"server, 1 client, instant predictor: p50 {level['p50_ms']:.2f} ms  p95 {level['p95_ms']:.2f} ms  "
                  f"failed {level['failed']}")
    finally:
        server.close()


def closed_loop(batcher_factory, clients: int, per_client: int = 60) -> None:
    """`clients` closed-loop clients, each submitting `per_client` requests straight to the
    batcher over a `StandIn`, the next 0.5 ms after its answer: requests/s, p50, mean batch."""
    predictor = StandIn()
    batcher = batcher_factory(predictor)
    latencies = []

    def client():
        for index in range(per_client):
            start = time.perf_counter()
            batcher.submit(index, {"q": {}}).result()
            latencies.append(time.perf_counter() - start)
            time.sleep(0.0005)

    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    batcher.close()
    print(f"closed loop, {clients} clients, 6 ms stand-in: {clients * per_client / wall:6.1f} requests/s  "
          f"p50 {1e3 * statistics.median(latencies):5.2f} ms  mean batch {statistics.fmean(predictor.sizes):4.2f}")


def batcher_policy(*, app_factory, batcher_factory) -> None:
    """The serving batcher's policy on the host alone, no model.

        python benchmarks/run.py batcher_policy

    1. The server's own host work: the benchmark's serving bodies (`bench.serving.mixed_requests`,
       16 varied requests, 4 with PNG images) sent by one client over loopback to the app over a
       predictor that answers at once; p50 and p95 of three passes of 64 requests.
    2. Closed-loop clients (1, 2 and 8), each submitting 60 requests straight to the `Batcher`,
       the next 0.5 ms after its answer, over a stand-in predictor that takes 6 ms a call plus
       0.3 ms a request: requests/s, p50 latency and the mean batch.

    `app_factory(predictor, model_name)` builds the app (`dohnuts.serve.app.create_app`) and
    `batcher_factory(predictor)` the batcher (`dohnuts.serve.batcher.Batcher`). Compare two
    commits by running it under each (PYTHONPATH pointing at the other's package).
    """
    server_overhead(app_factory)
    for count in (1, 2, 8):
        closed_loop(batcher_factory, count)


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
