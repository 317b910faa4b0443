"""`dohnuts serve` as users run it: two front-end processes and one engine process on the CPU,
answering as `Predictor.predict` does (float32, 1e-5), restarting a killed process while
clients get 503 with Retry-After, never a hang, and stopping on SIGTERM."""

import concurrent.futures
import os
import signal
import time

import httpx2
import pytest
from helpers import saved_pictures
from served import Server
from typesafe_sdk import Image as SdkImage
from typesafe_sdk import TypeSafeClient
from wire_questions import OURS, QUESTIONS

from dohnuts import Predictor

BODY = {"model": "jev-latest", "state": "I was billed twice",
        "questions": {"refund": {"type": "noul", "instructions": "Refund asked?"}}}
@pytest.fixture(scope="module")
def predictor(deployable):
    root, _ = deployable
    return Predictor.from_checkpoint(root / "checkpoint", device="cpu")


@pytest.fixture(scope="module")
def server(deployable):
    root, _ = deployable
    running = Server(root / "checkpoint")
    running.wait_ready()
    yield running
    if running.process.poll() is None:
        running.stop()


def test_two_front_ends_and_an_engine_answer_as_predict_alone(server, predictor, tmp_path):
    states = [{"message": f"ticket {index}: I was billed twice", "plan": "pro"} for index in range(12)]
    pictures = saved_pictures(tmp_path)
    sent = [SdkImage(tmp_path / f"{index}.png") for index in range(3)]

    def ask(state):
        with TypeSafeClient(api_key="local", base_url=server.url) as client:
            return client.system_one(state=state, questions=QUESTIONS)

    with concurrent.futures.ThreadPoolExecutor(max_workers=6) as pool:  # concurrent: they share invocations
        responses = list(pool.map(ask, states))
    with TypeSafeClient(api_key="local", base_url=server.url) as client:
        # Four images, one of them twice: the split server as `predict` with the images in place.
        pictured = client.system_one(state={"photos": [sent[0], sent[1]], "note": "parcel arrived",
                                            "label": sent[2], "again": sent[0]}, questions=QUESTIONS)
    expected = [predictor.predict(state, OURS)["answers"] for state in states]
    expected.append(predictor.predict({"photos": pictures[:2], "note": "parcel arrived", "label": pictures[2],
                                       "again": pictures[0]}, OURS)["answers"])
    for response, alone in zip(responses + [pictured], expected):
        assert response.model == "dohnuts-tiny"
        assert response.nouls["refund"].noul == pytest.approx(alone["refund"]["noul"], abs=1e-5)
        assert dict(response.choices["team"].probabilities) == pytest.approx(alone["team"]["probabilities"], abs=1e-5)
        assert response.scores["urgency"].score == pytest.approx(alone["urgency"]["score"], abs=1e-5)
    metrics = httpx2.get(f"{server.url}/metrics").text  # every process's, added up
    counts = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines() if line.startswith("dohnuts_")}
    assert counts['dohnuts_requests_total{status="200"}'] >= 13
    assert counts["dohnuts_batch_requests_sum"] >= 13  # the engine's count of the requests it ran
    assert counts['dohnuts_stage_seconds_count{stage="encode"}'] >= 13


def test_a_killed_engine_is_restarted_and_meanwhile_clients_get_503(server):
    engine = server.pids()["engine-0"]
    os.kill(engine, signal.SIGKILL)
    statuses, deadline = [], time.monotonic() + 120
    while time.monotonic() < deadline:
        response = httpx2.post(f"{server.url}/v1/systemone", json=BODY, timeout=30)  # a hang fails here
        statuses.append(response.status_code)
        if response.status_code == 503:
            assert response.headers["retry-after"] == "1"
        if response.status_code == 200 and 503 in statuses:
            break
        time.sleep(0.1)
    assert set(statuses) <= {200, 503} and 503 in statuses and statuses[-1] == 200
    assert server.pids()["engine-0"] != engine


def test_a_killed_front_end_is_restarted_while_the_other_answers(server):
    front = server.pids()["front-0"]
    os.kill(front, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while server.pids()["front-0"] == front:
        assert time.monotonic() < deadline, "the front end was not restarted"
        time.sleep(0.1)
    answered = [httpx2.post(f"{server.url}/v1/systemone", json=BODY, timeout=30).status_code for _ in range(6)]
    assert answered == [200] * 6


def test_sigterm_stops_every_process(deployable):
    root, _ = deployable
    running = Server(root / "checkpoint", workers=1)
    running.wait_ready()
    children = running.pids().values()
    assert running.stop() == 0
    for pid in children:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_children_exit_when_their_supervisor_is_killed(deployable):
    root, _ = deployable
    running = Server(root / "checkpoint", workers=1)
    running.wait_ready()
    children = list(running.pids().values())
    running.process.kill()  # SIGKILL: no chance to stop them
    running.process.wait(timeout=30)
    deadline = time.monotonic() + 30
    for pid in children:
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            assert time.monotonic() < deadline, f"child {pid} outlived its supervisor"
            time.sleep(0.1)


def test_sigterm_drains_the_requests_in_flight(deployable):
    """SIGTERM stops the front ends first, which finish what they hold, then the engine: every
    request that reached the server is answered 200, and the server exits within its grace."""
    root, _ = deployable
    running = Server(root / "checkpoint", workers=1)
    running.wait_ready()
    heavy = {"model": "jev-latest", "state": "I was billed twice for one parcel. " * 40,
             "questions": {f"q{index}": {"type": "noul", "instructions": f"Is it about {index}?"}
                           for index in range(40)}}

    def send():
        try:
            response = httpx2.post(f"{running.url}/v1/systemone", json=heavy, timeout=60)
        except httpx2.ConnectError:  # never reached the server: not in flight
            return "not connected"
        return 200 if response.status_code == 200 else (response.status_code, response.text)

    with concurrent.futures.ThreadPoolExecutor(max_workers=16) as pool:
        sent = [pool.submit(send) for _ in range(16)]
        time.sleep(0.5)
        stopped = time.monotonic()
        running.process.send_signal(signal.SIGTERM)
        outcomes = [future.result() for future in sent]
    code = running.process.wait(timeout=60)
    assert set(outcomes) <= {200, "not connected"} and outcomes.count(200) >= 8, outcomes
    assert code == 0 and time.monotonic() - stopped < 30


def test_front_ends_read_which_engines_refuse_from_the_shared_states(tmp_path):
    """A front end refuses at once only while every ready engine refuses (its queue-delay
    admission, in its REFUSING slot of the supervisor's shared array), and sends a request to an
    engine that still takes them."""
    from types import SimpleNamespace

    from dohnuts.runtime.engine_process import READY, REFUSING, SLOTS, STARTING, STATE
    from dohnuts.serve.engines import RemoteEngines

    states = [0] * (2 * SLOTS)
    states[STATE] = states[SLOTS + STATE] = READY
    engines = RemoteEngines([f"ipc://{tmp_path}/a", f"ipc://{tmp_path}/b"], states)
    text = SimpleNamespace(images=())
    try:
        assert not engines.refusing
        states[REFUSING] = 1
        assert not engines.refusing and engines._choose(text) == 1  # the other still takes requests
        states[SLOTS + REFUSING] = 1
        assert engines.refusing
        states[SLOTS + REFUSING], states[SLOTS + STATE] = 0, STARTING
        assert engines.refusing  # the one ready engine refuses
        states[REFUSING] = 0
        assert not engines.refusing and engines._choose(text) == 0
    finally:
        engines.close()


def test_a_cpu_engine_loads_in_a_thread_that_ends_and_its_errors_reach_the_caller(deployable, monkeypatch):
    """On the CPU the engine process loads, prepares and warms up in a thread of its own, over
    before the loop's starts (so the loop's OpenMP team is the only one: `_loaded`); what fails
    there is raised in the caller as it was."""
    import threading

    import torch

    from dohnuts.io import IntegrityError
    from dohnuts.runtime import engine_process

    root, _ = deployable
    seen = []
    real = engine_process.load_engine

    def recording(*args, **kwargs):
        seen.append(threading.current_thread())
        return real(*args, **kwargs)

    monkeypatch.setattr(engine_process, "load_engine", recording)
    settings = engine_process.EngineSettings(str(root / "checkpoint"), "cpu", "ipc:///unused")
    engine, _ = engine_process._loaded(settings, torch.device("cpu"))
    assert engine.stats["requests"] == 1  # warmed up
    assert len(seen) == 1 and seen[0] is not threading.main_thread() and not seen[0].is_alive()
    with pytest.raises(IntegrityError, match="no manifest.json"):
        engine_process._loaded(engine_process.EngineSettings("/nonexistent", "cpu", "ipc:///unused"),
                               torch.device("cpu"))


def test_what_a_drain_leaves_unanswered_is_answered_503_not_500():
    """A request still in flight when a front end's drain runs out gets 503 with Retry-After
    (uvicorn alone cancels it at its graceful timeout and answers a plain 500), and the front
    end then exits."""
    import asyncio
    import socket
    import threading
    from types import SimpleNamespace

    from dohnuts.serve.app import front_app
    from dohnuts.serve.supervisor import draining_server

    asked = threading.Event()

    class Waiting:  # the engines: ready, never answering
        refusing, ready, depth = False, True, 0

        def close(self):
            pass

    class Front:
        template, engines = SimpleNamespace(max_images=8), None

        async def answer(self, state, questions, deadline=None, risk=None):
            asked.set()
            await asyncio.sleep(3600)

    front = Front()
    app = front_app(front, "tiny", start=lambda: setattr(front, "engines", Waiting()))
    listening = socket.create_server(("127.0.0.1", 0))
    server = draining_server(app, 0.5, log_level="critical")
    serving = threading.Thread(target=server.run, kwargs={"sockets": [listening]}, daemon=True)
    serving.start()
    while not server.started:
        time.sleep(0.02)
    url = f"http://127.0.0.1:{listening.getsockname()[1]}/v1/systemone"
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        sent = pool.submit(httpx2.post, url, json=BODY | {"model": "tiny"}, timeout=30)
        assert asked.wait(10)
        stopped = time.monotonic()
        server.handle_exit(signal.SIGTERM, None)  # what the front end's SIGTERM handler calls
        response = sent.result()
    serving.join(10)
    assert response.status_code == 503 and response.headers["retry-after"] == "1", response.text
    assert "drain" in response.json()["detail"]["message"]
    assert 0.4 < time.monotonic() - stopped < 5 and not serving.is_alive()


def test_when_an_engine_loop_dies_what_waits_is_answered_closed(deployable, monkeypatch, tmp_path):
    """A device error that stops an engine's loop fails the invocation it hit ("failed": 500)
    and answers the requests waiting behind it "closed" (503 with Retry-After at the front end,
    retried once the engine is back), and the engine process exits to be started again."""
    import threading

    import zmq

    from dohnuts.runtime import engine_process
    from dohnuts.runtime.checkpoint import load_front
    from dohnuts.runtime.engine_process import READY, SLOTS, STATE, EngineSettings
    from dohnuts.runtime.messages import pack_request, unpack_reply
    from dohnuts.runtime.predict import encode_request
    from dohnuts.schema import parse_request

    root, _ = deployable
    real = engine_process.EngineLoop

    def dying(engine, **settings):
        def launch(*args, **kwargs):
            time.sleep(0.5)  # the others arrive meanwhile and wait
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        engine.launch = engine.run = launch
        return real(engine, **settings)

    monkeypatch.setattr(engine_process, "EngineLoop", dying)
    template, config, _ = load_front(root / "checkpoint")
    address, states, replies = f"ipc://{tmp_path}/engine", [0] * SLOTS, []

    def client():
        while states[STATE] != READY:
            time.sleep(0.02)
        socket = zmq.Context.instance().socket(zmq.DEALER)
        socket.connect(address)
        for index in range(3):
            request = parse_request(f"ticket {index}", {"q": {"type": "noul"}}, template.reserved)
            socket.send(pack_request(index, encode_request(template, config, request)))
            time.sleep(0.1)
        while len(replies) < 3 and socket.poll(20_000):
            replies.append(unpack_reply(socket.recv()))
        socket.close()

    asking = threading.Thread(target=client, daemon=True)
    asking.start()
    previous = signal.getsignal(signal.SIGTERM)  # serve_engine sets its own
    try:
        with pytest.raises(SystemExit, match="engine loop stopped"):
            engine_process.serve_engine(EngineSettings(str(root / "checkpoint"), "cpu", address, max_wait=None),
                                        states)
    finally:
        signal.signal(signal.SIGTERM, previous)
    asking.join(30)
    kinds = sorted(result[0] for _, result in replies)
    assert kinds == ["closed", "closed", "failed"], replies


def test_serve_on_a_taken_port_says_so_without_a_traceback(deployable):
    import socket

    from click.testing import CliRunner

    from dohnuts.cli import main

    root, _ = deployable
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        result = CliRunner().invoke(main, ["serve", str(root / "checkpoint"), "--port", str(port)])
    assert result.exit_code == 1 and f"cannot listen on 127.0.0.1:{port}" in result.output, result.output
    assert "Traceback" not in result.output
