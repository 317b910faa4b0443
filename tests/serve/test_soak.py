"""`dohnuts serve` (two front ends, one engine, the CPU) under sustained load from the load
harness's client processes: a soak at 64 clients loses nothing and holds its memory,
processes killed under load cost only the requests they held, never a 5xx but 503, and clients
that give up have their queued requests dropped by the engine."""

import os
import signal
import threading
import time
from pathlib import Path

import httpx2
import pytest
from served import Server

from dohnuts.bench.load import Load, encode_bodies, run_level, scrape
from dohnuts.bench.traffic import varied_requests

SOAK_SECONDS = float(os.environ.get("DOHNUTS_SOAK_SECONDS", "300"))
BODY = {"model": "jev-latest", "state": "I was billed twice",
        "questions": {"refund": {"type": "noul", "instructions": "Refund asked?"}}}


def _rss_bytes(pids) -> int:
    """The resident memory of processes, summed (Linux's /proc)."""
    total = 0
    for pid in pids:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) * 1024
    return total


@pytest.fixture(scope="module")
def bodies():
    return encode_bodies(varied_requests(256, seed=9))


@pytest.fixture
def server(deployable):
    """The split server. 64 clients keep its CPU engine's queue seconds deep, so its queue-delay
    admission is set past that here (the last test holds it to its word)."""
    root, _ = deployable
    running = Server(root / "checkpoint", options=("--max-queue-seconds", "60"))
    running.wait_ready()
    yield running
    if running.process.poll() is None:
        running.stop()


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads resident memory from /proc")
def test_a_soak_at_64_clients_loses_nothing_and_holds_its_memory(server, bodies):
    encoded, decisions = bodies
    run_level(server.url, encoded, decisions, Load(10.0, clients=64), processes=1)  # warm: caches fill
    processes = [server.process.pid, *server.pids().values()]
    before = _rss_bytes(processes)
    level = run_level(server.url, encoded, decisions, Load(SOAK_SECONDS, clients=64), processes=1)
    after = _rss_bytes(processes)
    print(f"soak {SOAK_SECONDS:g} s at 64 clients: {level['sent']} requests, {level['statuses']}, "
          f"p50 {level['p50_ms']:.0f} ms p99 {level['p99_ms']:.0f} ms; server RSS {before / 2**20:.0f} MiB "
          f"before, {after / 2**20:.0f} MiB after")
    assert level["sent"] > 64 and level["statuses"] == {"200": level["sent"]} and level["no_answer"] == 0
    assert after <= before * 1.15 + 64 * 2**20, (before, after)
    assert server.pids() == dict(zip(server.pids(), processes[1:]))  # nothing restarted


def test_processes_killed_under_load_cost_only_the_requests_they_held(server, bodies):
    encoded, decisions = bodies
    found = {}
    load = threading.Thread(target=lambda: found.update(
        run_level(server.url, encoded, decisions, Load(24.0, clients=16), processes=1, start_after=1.0)))
    load.start()
    time.sleep(7.0)
    engine = server.pids()["engine-0"]
    os.kill(engine, signal.SIGKILL)
    time.sleep(8.0)
    front = server.pids()["front-0"]
    os.kill(front, signal.SIGKILL)
    load.join(timeout=300)
    assert not load.is_alive(), "the clients hung"
    statuses = found["statuses"]
    assert set(statuses) - {"200", "503"} <= {status for status in statuses if status.startswith("no answer")}
    assert statuses.get("503", 0) > 0 and statuses["200"] > 0  # the engine's downtime, and the rest answered
    assert found["no_answer"] <= 16  # at most one in-flight request a client, on the killed front end
    pids = server.pids()
    assert pids["engine-0"] != engine and pids["front-0"] != front
    server.wait_ready()
    assert [httpx2.post(f"{server.url}/v1/systemone", json=BODY, timeout=30).status_code for _ in range(4)] == [200] * 4


def test_clients_that_give_up_have_their_queued_requests_dropped(server, bodies):
    """48 clients that wait 30 ms for an answer and then close their connection: the front ends
    withdraw their requests, the engine drops those still queued (counted in /metrics), and
    the server answers as usual afterwards."""
    encoded, _ = bodies

    def impatient(count: int) -> list:
        outcomes = []
        for index in range(count):
            try:
                response = httpx2.post(f"{server.url}/v1/systemone", content=encoded[index % len(encoded)],
                                       headers={"content-type": "application/json"}, timeout=0.03)
                outcomes.append(response.status_code)
            except httpx2.TimeoutException:
                outcomes.append("gave up")
        return outcomes

    before = scrape(server.url).get("dohnuts_cancelled_total", 0.0)
    threads, results = [], []
    for _ in range(48):
        thread = threading.Thread(target=lambda: results.extend(impatient(8)))
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join(timeout=300)
    assert not any(thread.is_alive() for thread in threads)
    assert "gave up" in results and all(result in (200, "gave up") for result in results)
    deadline = time.monotonic() + 30
    while scrape(server.url).get("dohnuts_cancelled_total", 0.0) <= before:
        assert time.monotonic() < deadline, "the engine dropped no withdrawn request"
        time.sleep(0.2)
    assert [httpx2.post(f"{server.url}/v1/systemone", json=BODY, timeout=30).status_code for _ in range(4)] == [200] * 4


def test_past_its_queue_delay_the_server_refuses_at_once_and_answers_the_rest(deployable, bodies):
    """With --max-queue-seconds 0.001, 64 clients overload the CPU engine: a request that comes
    while another has waited a millisecond gets 429 with Retry-After at once (refusals far faster
    than answers), the rest 200, nothing else. (At 0.05 s a CI machine whose front ends were
    slowed by another job fed the engine too slowly for any request to wait that long.)"""
    root, _ = deployable
    encoded, decisions = bodies
    running = Server(root / "checkpoint", options=("--max-queue-seconds", "0.001"))
    try:
        running.wait_ready()
        level = run_level(running.url, encoded, decisions, Load(8.0, clients=64), processes=1)
    finally:
        running.stop()
    statuses = level["statuses"]
    assert any("waited over 0.001 s" in line for line in running.lines)  # the option reached the engine
    assert set(statuses) <= {"200", "429"} and statuses.get("200") and level["no_answer"] == 0
    if "429" in statuses:  # a CPU slowed by other work may feed the engine too slowly to queue
        assert level["refused_p99_ms"] < level["p50_ms"]
