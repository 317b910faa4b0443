"""The load harness: client processes apart from the server's, open loop (Poisson arrivals at
an offered rate) and closed loop (a fixed number of clients each sending its next request when
answered), over distinct wire requests; offered against achieved rate, latency percentiles,
status counts and what the server's /metrics say of the same window.

Latency is measured from when a request was due, not when it went out, so a client that falls
behind its schedule counts the wait (no coordinated omission). Requests are pre-encoded JSON
bodies, spread over the processes; each process runs one asyncio loop with one aiohttp session.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import multiprocessing
import os
import random
import statistics
import time
import urllib.request
from dataclasses import dataclass

from .traffic import percentile

ENDPOINT = "/v1/systemone"
NO_ANSWER = "no answer"  # the status of a request that got no HTTP answer (connection error, timeout)


def wire_body(state, questions: dict, index: int) -> dict:
    """The wire request a client sends for (state, questions): an image under "image" goes as a
    base64 PNG asset placed under "photo", choices as the official client's mapping."""
    state = dict(state) if isinstance(state, dict) else state
    assets = {}
    if isinstance(state, dict) and "image" in state:
        buffer = io.BytesIO()
        state.pop("image").save(buffer, format="PNG")
        key = f"<image:{index:032x}>"
        state["photo"] = key
        assets[key] = {"type": "image", "format": "png", "data_base64": base64.b64encode(buffer.getvalue()).decode()}
    questions = {qid: {**question, "criteria": dict.fromkeys(question["criteria"])}
                 if question["type"] == "choice" else question for qid, question in questions.items()}
    return {"model": "jev-latest", "state": state, "questions": questions, **({"assets": assets} if assets else {})}


@dataclass(frozen=True)
class Load:
    """One level of load: `rate` requests/s offered in open loop, or `clients` in closed loop."""

    seconds: float
    rate: float | None = None
    clients: int | None = None

    def __post_init__(self):
        if (self.rate is None) == (self.clients is None):
            raise ValueError(f"a load level is open (a rate) or closed (clients), not both or neither: {self}")
        if self.seconds <= 0 or (self.rate is not None and self.rate <= 0) or (self.clients is not None
                                                                                 and self.clients < 1):
            raise ValueError(f"a load level needs seconds > 0 and a rate > 0 or clients >= 1: {self}")


def _share(load: Load, process: int, processes: int) -> Load:
    """This process's part of a level: its share of the rate or of the clients."""
    if load.rate is not None:
        return Load(load.seconds, rate=load.rate / processes)
    clients = load.clients // processes + (process < load.clients % processes)
    return Load(load.seconds, clients=clients) if clients else None


async def _send(session, url: str, body: bytes, due: float, timeout: float) -> tuple[float, float, object]:
    """(due time, latency from it, HTTP status or the connection error's name) of one request."""
    import aiohttp

    try:
        async with session.post(url, data=body, headers={"content-type": "application/json"},
                                timeout=aiohttp.ClientTimeout(total=timeout)) as response:
            await response.read()
            status = response.status
    except (TimeoutError, aiohttp.ClientError, OSError) as error:
        status = f"{NO_ANSWER}: {type(error).__name__}"
    return due, time.perf_counter() - due, status


async def _drive(url: str, bodies: list[bytes], load: Load, seed: int, timeout: float,
                 begin: float) -> tuple[list[tuple], list[float], float]:
    """Run one process's share of a level from the wall-clock time `begin` (every process's
    schedule starts there, a late one catching up); returns (due, latency, status, body index)
    per request, due in seconds after `begin`, the seconds each new connection took to open,
    and how late the schedule started (seconds)."""
    import aiohttp

    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    results, cursor, connects = [], [0], []
    tracing = aiohttp.TraceConfig()

    async def opening(session, context, params):
        context.opened = time.perf_counter()

    async def opened(session, context, params):
        connects.append(time.perf_counter() - context.opened)

    tracing.on_connection_create_start.append(opening)
    tracing.on_connection_create_end.append(opened)

    def next_body() -> int:
        index = cursor[0] % len(bodies)
        cursor[0] += 1
        return index

    async with aiohttp.ClientSession(connector=connector, trace_configs=[tracing]) as session:
        start = time.perf_counter() - (time.time() - begin)  # `begin` on this process's clock
        late = time.perf_counter() - start
        end = start + load.seconds
        if load.rate is not None:  # open loop: Poisson arrivals, each request its own task
            rng, due, tasks = random.Random(seed), start, []
            while True:
                due += rng.expovariate(load.rate)
                if due >= end:
                    break
                await asyncio.sleep(max(0.0, due - time.perf_counter()))  # behind: still lets answers in
                index = next_body()
                tasks.append((index, asyncio.ensure_future(_send(session, url, bodies[index], due, timeout))))
            for index, task in tasks:
                results.append((*await task, index))
        else:  # closed loop: each client sends its next request when the last is answered

            async def client():
                while time.perf_counter() < end:
                    index = next_body()
                    results.append((*await _send(session, url, bodies[index], time.perf_counter(), timeout), index))

            await asyncio.gather(*(client() for _ in range(load.clients)))
    return [(due - start, latency, status, index) for due, latency, status, index in results], connects, late


def _process(url, bodies, offset, load, seed, timeout, cpus, ready, go, out) -> None:
    """A client process: pinned to `cpus`, it says it is `ready` (imported, its bodies in
    hand), takes the common start time from `go`, runs its share over `bodies` (the whole list
    rotated by `offset`) from then, and puts its results on `out`, each with the body's index
    in the whole list."""
    if cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cpus)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    import aiohttp  # noqa: F401 - imported before the start, not on the schedule

    ready.put(os.getpid())
    begin = go.get()
    time.sleep(max(0.0, begin - time.time()))
    results, connects, late = asyncio.run(_drive(url, bodies, load, seed, timeout, begin))
    out.put(([(due, latency, status, (index + offset) % len(bodies)) for due, latency, status, index in results],
             connects, late))


def scrape(url: str) -> dict[str, float]:
    """The server's Prometheus counters and gauges by name (labels folded into the name), or {}
    when it serves none."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
            text = response.read().decode()
    except OSError:
        return {}
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{key}={value}" for key, value in sorted(sample.labels.items()) if key != "le")
            if "le" in sample.labels:
                continue  # histogram buckets: their _sum and _count say enough here
            values[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return values


def _grown(before: dict, after: dict, name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def server_figures(before: dict, after: dict, seconds: float) -> dict:
    """What the server's own counters say of one level's window: invocations, mean batch
    (requests an invocation), the share of invocations that ran eagerly, GPU busy time, and
    each stage's mean time a request (the engine's counters; absent ones are left out)."""
    invocations = _grown(before, after, "dohnuts_batch_requests_count")
    figures = {"invocations": invocations}
    if invocations:
        figures["mean_batch_requests"] = _grown(before, after, "dohnuts_batch_requests_sum") / invocations
        eager = _grown(before, after, "dohnuts_invocations_total{path=eager}")
        figures["eager_share"] = eager / invocations
    busy = _grown(before, after, "dohnuts_device_busy_seconds_total")
    if busy:
        figures["device_busy_share"] = busy / seconds
    stages = {}
    for name in after:
        if name.startswith("dohnuts_stage_seconds_sum{stage="):
            stage = name[len("dohnuts_stage_seconds_sum{stage="):-1]
            count = _grown(before, after, f"dohnuts_stage_seconds_count{{stage={stage}}}")
            if count:
                stages[stage] = 1000 * _grown(before, after, name) / count
    if stages:
        figures["stage_mean_ms"] = stages
    return figures


def run_level(url: str, bodies: list[bytes], decisions: list[int], load: Load, processes: int = 2,
              cpus: list[set[int]] | None = None, seed: int = 0, timeout: float = 60.0,
              start_after: float = 0.5) -> dict:
    """One level of load from `processes` client processes (each pinned to its set of `cpus`
    when given), whose schedules all start `start_after` seconds after the last of them is
    ready (started, imported, its bodies received: on a busy host that took 14 s, and a
    schedule that began before would count the wait as latency): offered, sent and achieved
    rate, decisions/s, latency percentiles of the answered requests, status counts, and the
    server's own figures for the window.

    Args:
        url: the server, e.g. "http://127.0.0.1:8000".
        bodies: encoded wire bodies, taken in turn (each process starts at its own offset);
            decisions: the questions of each.
    """
    context = multiprocessing.get_context("spawn")
    out, ready, go = context.Queue(), context.Queue(), context.Queue()
    workers = []
    for process in range(processes):
        share = _share(load, process, processes)
        if share is None:  # fewer closed-loop clients than processes
            continue
        offset = process * len(bodies) // processes
        pinned = cpus[process % len(cpus)] if cpus else None
        workers.append(context.Process(target=_process, daemon=True, args=(
            url + ENDPOINT, bodies[offset:] + bodies[:offset], offset, share, seed * 1000 + process, timeout, pinned,
            ready, go, out)))
    for worker in workers:
        worker.start()
    for _ in workers:
        ready.get(timeout=300)
    begin = time.time() + start_after  # every process's schedule starts here
    for _ in workers:
        go.put(begin)
    before, counted = scrape(url), tcp_counters()
    results, connects, late = [], [], 0.0
    for _ in workers:
        found, opened, behind = out.get(timeout=load.seconds + timeout + 120)
        results.extend(found)
        connects.extend(opened)
        late = max(late, behind)
    after, recounted = scrape(url), tcp_counters()
    for worker in workers:
        worker.join(timeout=30)
    level = summarise(results, decisions, load, before, after)
    level["connections"] = {"opened": len(connects),
                            "connect_p99_ms": 1000 * percentile(connects, 0.99) if connects else None,
                            "connect_max_ms": 1000 * max(connects) if connects else None,
                            "latest_start_ms": 1000 * late,
                            **{name: recounted[name] - counted.get(name, 0) for name in recounted}}
    return level


def tcp_counters() -> dict[str, int]:
    """This host's TCP counters that tell of dropped or retried connections (Linux: listen
    queue overflows and drops, retransmitted segments); {} elsewhere. Client and server share
    the host in the harness, so a level's growth in them is its own or the server's."""
    wanted = {"TcpExt": ("ListenOverflows", "ListenDrops", "TCPTimeouts"), "Tcp": ("RetransSegs",)}
    found = {}
    for path in ("/proc/net/netstat", "/proc/net/snmp"):
        try:
            with open(path) as file:
                lines = file.read().splitlines()
        except OSError:
            continue
        for names, values in zip(lines[::2], lines[1::2]):
            kind, names = names.split(":")
            if kind in wanted:
                table = dict(zip(names.split(), values.split(":")[1].split()))
                found.update({name: int(table[name]) for name in wanted[kind] if name in table})
    return found


def summarise(results: list[tuple], decisions: list[int], load: Load, before: dict | None = None,
              after: dict | None = None) -> dict:
    """A level's figures from its requests' (due, latency, status, body index)."""
    answered = [(latency, index) for _, latency, status, index in results if status == 200]
    latencies = [latency for latency, _ in answered]
    # Rates over the level or, when answers came after it, until the last: a server that falls
    # behind shows a lower rate, not the offered one delayed.
    span = max([load.seconds] + [due + latency for due, latency, status, _ in results if status == 200])
    statuses: dict[str, int] = {}
    for _, _, status, _ in results:
        statuses[str(status)] = statuses.get(str(status), 0) + 1
    refused = [latency for _, latency, status, _ in results if status == 429]
    level = {
        "mode": "open" if load.rate is not None else "closed", "seconds": load.seconds,
        "offered_requests_per_second": load.rate, "clients": load.clients, "sent": len(results),
        "answered": len(answered), "statuses": statuses,
        "no_answer": sum(count for status, count in statuses.items() if status.startswith(NO_ANSWER)),
        "sent_requests_per_second": len(results) / load.seconds,
        "span_seconds": span, "achieved_requests_per_second": len(answered) / span,
        "decisions_per_second": sum(decisions[index] for _, index in answered) / span,
    }
    for name, q in (("p50_ms", 0.5), ("p95_ms", 0.95), ("p99_ms", 0.99)):
        level[name] = 1000 * percentile(latencies, q) if latencies else None
    level["mean_ms"] = 1000 * statistics.fmean(latencies) if latencies else None
    level["max_ms"] = 1000 * max(latencies) if latencies else None
    level["refused_p99_ms"] = 1000 * percentile(refused, 0.99) if refused else None
    # Where the tail lies in time: p99 of each tenth of the level by due time (a tail only at
    # the start is first sight; one throughout, something recurring), and the slowest requests.
    timed = sorted((due, latency, index) for due, latency, status, index in results if status == 200)
    tenths = [[latency for due, latency, _ in timed if part * load.seconds / 10 <= due < (part + 1) * load.seconds / 10]
              for part in range(10)]
    level["p99_ms_by_tenth"] = [round(1000 * percentile(part, 0.99), 1) if part else None for part in tenths]
    level["slowest"] = [{"due_s": round(due, 3), "ms": round(1000 * latency, 1), "body": index}
                        for due, latency, index in sorted(timed, key=lambda found: -found[1])[:10]]
    if before is not None and after:
        level["server"] = server_figures(before, after, span)
    return level


def encode_bodies(requests: list[tuple[object, dict]]) -> tuple[list[bytes], list[int]]:
    """(JSON bodies, questions of each) of (state, questions) pairs, as clients send them."""
    bodies = [json.dumps(wire_body(state, questions, index)).encode() for index, (state, questions)
              in enumerate(requests)]
    return bodies, [len(questions) for _, questions in requests]


def sweep(url: str, requests: list[tuple[object, dict]], rates: list[float], clients: list[int],
          seconds: float = 30.0, warmup_seconds: float = 5.0, processes: int = 2,
          cpus: list[set[int]] | None = None, progress=None) -> dict:
    """Open-loop levels at each offered rate, then closed-loop levels at each client count,
    each after `warmup_seconds` of the same load (untimed). `progress(level)` hears each."""
    bodies, decisions = encode_bodies(requests)
    levels = []
    loads = [Load(seconds, rate=rate) for rate in rates] + [Load(seconds, clients=count) for count in clients]
    for load in loads:
        if warmup_seconds:
            run_level(url, bodies, decisions, Load(warmup_seconds, load.rate, load.clients), processes, cpus, seed=1)
        level = run_level(url, bodies, decisions, load, processes, cpus)
        levels.append(level)
        if progress is not None:
            progress(level)
    return {"workload": "serving_load", "requests": len(bodies), "questions_per_request":
            statistics.fmean(decisions), "images": sum(b'"assets"' in body for body in bodies),
            "processes": processes, "levels": levels, "held": held(levels)}


def held(levels: list[dict]) -> dict:
    """The highest open-loop rate whose p99 stayed within 100 ms and 500 ms (with every request
    answered), in requests/s and decisions/s."""
    found = {}
    for bound in (100, 500):
        kept = [level for level in levels if level["mode"] == "open" and level["p99_ms"] is not None
                and level["p99_ms"] <= bound and level["answered"] == level["sent"]]
        best = max(kept, key=lambda level: level["achieved_requests_per_second"], default=None)
        found[f"p99_{bound}ms"] = None if best is None else {
            key: best[key] for key in ("offered_requests_per_second", "achieved_requests_per_second",
                                       "decisions_per_second", "p50_ms", "p99_ms")}
    return found


def describe_level(level: dict) -> str:
    """One line for a level: its load, what was achieved, the tail, the statuses."""
    load = (f"open {level['offered_requests_per_second']:g}/s" if level["mode"] == "open"
            else f"closed {level['clients']} clients")
    tail = "no answer" if level["p50_ms"] is None else f"p50 {level['p50_ms']:.1f} p99 {level['p99_ms']:.1f} ms"
    server = level.get("server", {})
    batch = f" batch {server['mean_batch_requests']:.1f}" if "mean_batch_requests" in server else ""
    batch += f" eager {server['eager_share']:.0%}" if "eager_share" in server else ""
    batch += f" busy {server['device_busy_share']:.0%}" if "device_busy_share" in server else ""
    stages = " ".join(f"{name} {ms:.1f}" for name, ms in server.get("stage_mean_ms", {}).items())
    return (f"{load}: {level['achieved_requests_per_second']:.1f} requests/s {level['decisions_per_second']:.0f} "
            f"decisions/s {tail}{batch} {level['statuses']}" + (f" (ms a request: {stages})" if stages else "")
            + (f"; p99 ms by tenth {level['p99_ms_by_tenth']}" if level.get("p99_ms_by_tenth") else "")
            + (f"; connections {level['connections']}" if level.get("connections") else ""))
