"""The load harness: client processes drive a server over HTTP in open and closed loop, and the
level's figures say what the server answered, when, and what its own counters say."""

import copy
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from dohnuts.bench.load import Load, encode_bodies, held, run_level, server_figures, summarise, wire_body
from dohnuts.bench.serving import ServingPlan, serving_record
from dohnuts.bench.traffic import serving_mix

DELAY = 0.005  # seconds the stand-in server takes to answer


class StandIn(BaseHTTPRequestHandler):
    """Answers every request after DELAY, every fifth with 429; serves counters on /metrics."""

    protocol_version = "HTTP/1.1"
    lock = threading.Lock()
    count = 0

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        with StandIn.lock:
            StandIn.count += 1
            number = StandIn.count
        time.sleep(DELAY)
        status = 429 if number % 5 == 0 else 200
        self._reply(status, json.dumps({"answers": dict.fromkeys(body["questions"])}).encode(), "application/json")

    def do_GET(self):
        with StandIn.lock:
            count = StandIn.count
        text = (f"dohnuts_batch_requests_count {count / 2}\ndohnuts_batch_requests_sum {count}\n"
                f'dohnuts_invocations_total{{path="eager"}} 0\n')
        self._reply(200, text.encode(), "text/plain")

    def _reply(self, status: int, data: bytes, kind: str):
        self.send_response(status)
        self.send_header("content-type", kind)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def stand_in():
    server = ThreadingHTTPServer(("127.0.0.1", 0), StandIn)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def bodies():
    return encode_bodies(serving_mix(12, seed=3))


def test_open_loop_sends_at_the_offered_rate_and_counts_every_answer(stand_in, bodies):
    before = StandIn.count
    level = run_level(stand_in, *bodies, Load(2.0, rate=100.0), processes=2, start_after=2.0)
    sent = StandIn.count - before
    assert level["sent"] == sent and 200 - 4 * 15 <= sent <= 200 + 4 * 15  # Poisson: mean 200, sd about 14
    assert level["statuses"]["200"] == level["answered"] and level["statuses"].get("429", 0) > 0
    assert level["answered"] + level["statuses"]["429"] == sent and level["no_answer"] == 0
    assert level["p50_ms"] >= 1000 * DELAY and level["p50_ms"] <= level["p99_ms"] <= level["max_ms"]
    assert 2.0 <= level["span_seconds"] < 2.5  # the last answers come just after the level
    assert level["achieved_requests_per_second"] == pytest.approx(level["answered"] / level["span_seconds"])
    assert level["server"]["mean_batch_requests"] == pytest.approx(2.0) and level["server"]["eager_share"] == 0
    # The schedule starts once every client process is ready, so none starts it late.
    assert 0 <= level["connections"]["latest_start_ms"] < 500


def test_closed_loop_clients_each_wait_for_their_answer(stand_in, bodies):
    level = run_level(stand_in, *bodies, Load(1.0, clients=3), processes=2, start_after=2.0)
    # Three clients, one request each in flight: at most 1 s / DELAY requests each.
    assert 3 <= level["sent"] <= 3 * (1.0 / DELAY + 1)
    assert level["mode"] == "closed" and level["clients"] == 3 and level["no_answer"] == 0
    # Each client keeps its connection: three opened (two processes share the clients), none retried.
    connections = level["connections"]
    assert connections["opened"] == 3 and 0 <= connections["connect_max_ms"] < 1000, connections
    assert 0 <= connections["latest_start_ms"] < 2000
    if Path("/proc/net/netstat").exists():
        assert connections["ListenDrops"] >= 0 and "RetransSegs" in connections


def test_a_level_without_a_server_counts_requests_with_no_answer(bodies):
    level = run_level("http://127.0.0.1:9", *bodies, Load(0.5, rate=20.0), processes=1, timeout=2.0,
                      start_after=2.0)
    assert level["answered"] == 0 and level["no_answer"] == level["sent"] > 0 and level["p99_ms"] is None


def test_decisions_count_the_questions_of_the_answered_requests_only():
    results = [(0.0, 0.010, 200, 0), (0.1, 0.020, 200, 1), (0.2, 0.001, 429, 1), (0.3, 5.0, "no answer: X", 0)]
    level = summarise(results, [3, 5], Load(2.0, rate=2.0))
    assert level["decisions_per_second"] == (3 + 5) / 2.0 and level["answered"] == 2
    assert level["no_answer"] == 1 and level["refused_p99_ms"] == pytest.approx(1.0)


def test_held_takes_the_highest_rate_within_each_bound_with_nothing_refused():
    def level(rate, achieved, p99, refused=0):
        return {"mode": "open", "offered_requests_per_second": rate, "achieved_requests_per_second": achieved,
                "decisions_per_second": 10 * achieved, "p50_ms": p99 / 2, "p99_ms": p99, "sent": 100,
                "answered": 100 - refused}
    found = held([level(10, 10, 50), level(20, 20, 90), level(40, 39, 300), level(80, 60, 250, refused=5)])
    assert found["p99_100ms"]["offered_requests_per_second"] == 20
    assert found["p99_500ms"]["offered_requests_per_second"] == 40


def test_server_figures_are_the_counters_growth_over_the_window():
    before = {"dohnuts_batch_requests_count": 10, "dohnuts_batch_requests_sum": 30,
              'dohnuts_invocations_total{path=eager}': 1, "dohnuts_device_busy_seconds_total": 1.0,
              "dohnuts_stage_seconds_sum{stage=run}": 0.5, "dohnuts_stage_seconds_count{stage=run}": 10}
    after = {"dohnuts_batch_requests_count": 20, "dohnuts_batch_requests_sum": 90,
             'dohnuts_invocations_total{path=eager}': 1, "dohnuts_device_busy_seconds_total": 2.5,
             "dohnuts_stage_seconds_sum{stage=run}": 1.5, "dohnuts_stage_seconds_count{stage=run}": 20}
    figures = server_figures(before, after, seconds=3.0)
    assert figures == {"invocations": 10, "mean_batch_requests": 6.0, "eager_share": 0.0,
                       "device_busy_share": 0.5, "stage_mean_ms": {"run": pytest.approx(100.0)}}


def test_a_wire_body_carries_its_image_as_a_placed_asset_and_choices_as_a_mapping():
    state, questions = serving_mix(1, seed=0)[0]
    body = wire_body(state, questions, 7)
    assert "image" not in body["state"] and body["state"]["photo"] == f"<image:{7:032x}>"
    assert body["assets"][body["state"]["photo"]]["format"] == "png"
    assert all(isinstance(question["criteria"], dict) for question in body["questions"].values()
               if question["type"] == "choice")
    assert "image" in state  # the caller's state is left as it was


def test_a_level_says_when_its_slowest_requests_were_due():
    """p99 of each tenth of the level by due time, and the slowest requests with their bodies:
    a stall at 7.5 s shows in the eighth tenth and heads the list."""
    results = [(0.1 * step, 0.010, 200, step % 4) for step in range(100)] + [(7.5, 3.0, 200, 3), (7.6, 2.0, 429, 1)]
    level = summarise(results, [1, 1, 1, 1], Load(10.0, rate=10.0))
    assert level["p99_ms_by_tenth"][7] > 2000 and max(level["p99_ms_by_tenth"][:7]) < 20
    assert level["slowest"][0] == {"due_s": 7.5, "ms": 3000.0, "body": 3} and len(level["slowest"]) == 10
    assert all(entry["ms"] < 3000 for entry in level["slowest"][1:])  # the 429 is no answer's latency


def test_a_serving_run_hands_over_its_record_so_far_after_each_level(deployable):
    """A run cut short keeps what it measured: the record once the server is ready, then after
    each level, before the complete one."""
    root, _ = deployable
    plan = ServingPlan(requests=8, rates=(4.0,), clients=(1,), seconds=1.0, warmup_seconds=0.0, workers=1,
                       processes=1, client_cpus=0)
    heard = []
    record = serving_record(root / "checkpoint", plan, partial=lambda so_far: heard.append(copy.deepcopy(so_far)))
    assert [len(so_far["levels"]) for so_far in heard] == [0, 1, 2]
    assert all(so_far["complete"] is False and so_far["ready_seconds"] > 0 for so_far in heard)
    assert heard[-1]["levels"] == record["levels"] and record["complete"] is True
    assert [level["mode"] for level in record["levels"]] == ["open", "closed"]
    assert record["levels"][0]["answered"] == record["levels"][0]["sent"] > 0
