"""The serving workload: the server on loopback, driven by concurrent clients over varied requests."""

from __future__ import annotations

import base64
import http.client
import io
import json
import socket
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from .traffic import percentile, varied_requests


def mixed_requests(count: int, seed: int = 0) -> list[dict]:
    """`count` distinct wire request bodies: `measure.traffic.varied_requests`, each image sent
    as a base64 PNG asset placed under "photo", choice candidates as the client's mapping."""
    bodies = []
    for index, (state, questions) in enumerate(varied_requests(count, seed)):
        state = dict(state)
        assets = {}
        if "image" in state:
            buffer = io.BytesIO()
            state.pop("image").save(buffer, format="PNG")
            key = f"<image:{index:032x}>"
            state["photo"] = key
            encoded = base64.b64encode(buffer.getvalue()).decode()
            assets[key] = {"type": "image", "format": "png", "data_base64": encoded}
        questions = {qid: {**question, "criteria": dict.fromkeys(question["criteria"])}
                     if question["type"] == "choice" else question for qid, question in questions.items()}
        bodies.append({"model": "jev-latest", "state": state, "questions": questions,
                       **({"assets": assets} if assets else {})})
    return bodies


class LoopbackServer:
    """The app on a free loopback port, in a background thread (uvicorn)."""

    def __init__(self, app):
        import uvicorn

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 300
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the loopback server did not start")
            time.sleep(0.05)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)


def drive(port: int, bodies: list[dict], clients: int, deadline_seconds: float = 600.0) -> dict:
    """Send every body once with `clients` concurrent clients (each its own keep-alive
    connection, taking the next body when its last is answered). Returns the level's figures:
    requests/s and decisions/s over the wall time, latency p50/p95/p99, and the requests that
    failed (a status other than 200) or were never sent before the deadline (lost)."""
    payloads = [json.dumps(body).encode() for body in bodies]
    decisions = [len(body["questions"]) for body in bodies]
    next_index, lock = [0], threading.Lock()
    latencies, failed, answered = [], [], []
    stop_at = time.monotonic() + deadline_seconds

    def client():
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        while time.monotonic() < stop_at:
            with lock:
                index = next_index[0]
                next_index[0] += 1
            if index >= len(payloads):
                break
            started = time.perf_counter()
            try:
                connection.request("POST", "/v1/systemone", payloads[index], {"content-type": "application/json"})
                response = connection.getresponse()
                response.read()
                status = response.status
            except (OSError, http.client.HTTPException) as error:
                status = f"{type(error).__name__}"
                connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
            elapsed = time.perf_counter() - started
            with lock:
                if status == 200:
                    latencies.append(elapsed)
                    answered.append(index)
                else:
                    failed.append({"request": index, "status": status})
        connection.close()

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=clients) as pool:
        for _ in range(clients):
            pool.submit(client)
    wall = time.perf_counter() - started
    done = sum(decisions[index] for index in answered)
    return {"clients": clients, "requests": len(bodies), "answered": len(answered), "failed": len(failed),
            "lost": len(bodies) - len(answered) - len(failed), "failures": failed[:10], "seconds": wall,
            "requests_per_second": len(answered) / wall, "decisions_per_second": done / wall,
            "p50_ms": 1000 * percentile(latencies, 0.5) if latencies else None,
            "p95_ms": 1000 * percentile(latencies, 0.95) if latencies else None,
            "p99_ms": 1000 * percentile(latencies, 0.99) if latencies else None,
            "mean_ms": 1000 * statistics.fmean(latencies) if latencies else None}


def serving_record(predictor, requests: int, clients: tuple[int, ...], app_factory, seed: int = 0) -> dict:
    """The serving workload: `requests` varied requests (`mixed_requests`) sent to the server
    on loopback at each count of concurrent `clients`; one client sending one request at a time
    is the baseline. `app_factory(predictor, model_name, on_invocation=...)` builds the served app
    (`dohnuts.serve.app.create_app`: bench does not import its peer serve, the caller hands it
    in). Each level also records the mean batch size the server ran (requests per model
    invocation), from the batcher's own count, and how many invocations replayed a CUDA graph
    or a bucket's graphs, captured one or ran eagerly; `idle_captures` counts the captures the
    server made between requests (all of them: no request waits for one)."""
    batches = []
    app = app_factory(predictor, "dohnuts-benchmark", on_invocation=lambda count, rows, waits: batches.append(count))
    server = LoopbackServer(app)
    bodies = mixed_requests(requests, seed)
    try:
        drive(server.port, bodies[: min(8, len(bodies))], 1)  # warm the path (not timed)
        levels = []
        for count in clients:
            batches.clear()
            before = dict(predictor.scores.stats)
            level = drive(server.port, bodies, count)
            level["mean_batch_requests"] = statistics.fmean(batches) if batches else None
            level["invocations"] = len(batches)
            level["timed_calls"] = {name: predictor.scores.stats[name] - before[name]
                                    for name in ("replays", "bucket_replays", "captures", "idle_captures", "eager")}
            levels.append(level)
    finally:
        server.close()
    baseline = next((level for level in levels if level["clients"] == 1), None)
    for level in levels:
        if baseline is not None and baseline["decisions_per_second"]:
            level["decisions_per_second_vs_one_client"] = level["decisions_per_second"] / baseline[
                "decisions_per_second"]
    return {"workload": "serving", "requests": requests, "levels": levels,
            "questions_per_request": statistics.fmean(len(body["questions"]) for body in bodies),
            "images": sum("assets" in body for body in bodies)}
