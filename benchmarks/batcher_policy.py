"""The serving batcher's policy on the host alone, no model: the script behind the
`*-batcher-policy-*.txt` files in docs/results/.

    python3 benchmarks/batcher_policy.py

1. The server's own host work: the benchmark's serving bodies (`serve.load.mixed_requests`,
   16 varied requests, 4 with PNG images) sent by one client over loopback to the app over a
   predictor that answers at once; p50 and p95 of three passes of 64 requests.
2. Closed-loop clients (1, 2 and 8), each submitting 60 requests straight to the `Batcher`,
   the next 0.5 ms after its answer, over a stand-in predictor that takes 6 ms a call plus
   0.3 ms a request: requests/s, p50 latency and the mean batch.

Compare two commits by running it under each (PYTHONPATH pointing at the other's package).
"""

import statistics
import threading
import time

import numpy as np

from dohnuts.bench.serving import LoopbackServer, drive, mixed_requests
from dohnuts.runtime.predict import answers_of
from dohnuts.schema import parse_request
from dohnuts.serve.app import create_app
from dohnuts.serve.batcher import Batcher

TEMPERATURES = {"choice": 1.0, "noul": 1.0, "score": 1.0}


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


def server_overhead() -> None:
    server = LoopbackServer(create_app(Instant(), "instant"))
    bodies = mixed_requests(16)
    try:
        drive(server.port, bodies, 1)  # warm
        for _ in range(3):
            level = drive(server.port, bodies * 4, 1)
            print(f"server, 1 client, instant predictor: p50 {level['p50_ms']:.2f} ms  p95 {level['p95_ms']:.2f} ms  "
                  f"failed {level['failed']}")
    finally:
        server.close()


def closed_loop(clients: int, per_client: int = 60) -> None:
    predictor = StandIn()
    batcher = Batcher(predictor)
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


if __name__ == "__main__":
    server_overhead()
    for count in (1, 2, 8):
        closed_loop(count)
