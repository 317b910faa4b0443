"""The server's Prometheus metrics, one set a process: front ends count requests and their
encoding and answering, engines their invocations, stages and device time. Under several
processes (`PROMETHEUS_MULTIPROC_DIR` set before the process starts) each writes its own
files and a front end's /metrics adds them up (`exposition`).
"""

from __future__ import annotations

import os
from functools import cache

LATENCY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
STAGE_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# How an invocation ran (GraphedScores.stats): an exact graph's replay (one captured on the
# request replays too), a bucket's graphs, or eagerly. Captures made when idle are no invocation.
PATHS = ("replays", "bucket_replays", "eager")


class Metrics:
    """Every metric of the server (created once a process, `metrics()`)."""

    def __init__(self):
        from prometheus_client import Counter, Gauge, Histogram

        self.requests = Counter("dohnuts_requests", "Decision requests by HTTP status", ["status"])
        self.latency = Histogram("dohnuts_request_seconds", "Decision request latency, as the front end saw it",
                                 buckets=LATENCY_BUCKETS)
        self.rows = Counter("dohnuts_rows", "Questions answered")
        self.batches = Histogram("dohnuts_batch_requests", "Requests per model invocation", buckets=BATCH_BUCKETS)
        self.invocations = Counter("dohnuts_invocations", "Model invocations by how they ran", ["path"])
        self.cancelled = Counter("dohnuts_cancelled", "Requests dropped from an engine's queue (callers gone)")
        self.busy = Counter("dohnuts_device_busy_seconds", "Device time of the invocations (CUDA events)")
        self.stages = Histogram("dohnuts_stage_seconds", "Time a request spends in each stage: encode and answer "
                                "(front end), queue, prepare, run and finish (engine, per invocation but queue)",
                                ["stage"], buckets=STAGE_BUCKETS)
        self.queue = Gauge("dohnuts_queue_depth", "Requests waiting in the engines' queues",
                           multiprocess_mode="livesum")
        self.in_flight = Gauge("dohnuts_front_in_flight", "Requests the front ends have sent and await",
                               multiprocess_mode="livesum")


@cache
def metrics() -> Metrics:
    return Metrics()


def exposition() -> tuple[bytes, str]:
    """(the Prometheus text of every process's metrics, its content type)."""
    from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
    from prometheus_client.exposition import CONTENT_TYPE_LATEST

    registry = REGISTRY
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
    return generate_latest(registry), CONTENT_TYPE_LATEST


class Counting:
    """An `EngineLoop`'s `on_invocation`: the engine's own counters into the metrics after each
    invocation (the growth of each), then `then(requests, rows, waits)` when given."""

    def __init__(self, engine, then=None):
        self.engine, self.metrics, self.then = engine, metrics(), then
        self.seen = self._snapshot()

    def _snapshot(self) -> dict:
        engine = self.engine
        return {**{path: engine.scores.stats[path] for path in PATHS},
                **{f"stage:{stage}": engine.stage_seconds[stage] for stage in ("prepare", "run", "finish")}}

    def __call__(self, requests: int, rows: int, waits: list[float]) -> None:
        now, counted = self._snapshot(), self.metrics
        grown = {key: now[key] - self.seen[key] for key in now}
        self.seen = now
        counted.batches.observe(requests)
        counted.rows.inc(rows)
        for path in PATHS:
            if grown[path]:
                counted.invocations.labels(path).inc(grown[path])
        for stage in ("prepare", "run", "finish"):
            counted.stages.labels(stage).observe(grown[f"stage:{stage}"])
        if self.engine.model.device.type == "cuda":
            counted.busy.inc(grown["stage:run"])
        for wait in waits:
            counted.stages.labels("queue").observe(wait)
        if self.then is not None:
            self.then(requests, rows, waits)
