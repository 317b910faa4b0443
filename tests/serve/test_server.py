"""The /v1/systemone server on a loopback port, driven by TypeSafe's official client."""

import asyncio
import base64
import concurrent.futures
import gzip
import io
import json
import threading
import time

import httpx2
import numpy as np
import pytest
from helpers import saved_pictures
from PIL import Image
from served import Served
from typesafe_sdk import (
    Choice,
    Noul,
    TypeSafeAuthenticationError,
    TypeSafeClient,
    TypeSafeNotFoundError,
    TypeSafeUnprocessableEntityError,
)
from typesafe_sdk import Image as SdkImage
from wire_questions import OURS, QUESTIONS

from dohnuts import Predictor
from dohnuts.schema import ImageText
from dohnuts.serve.app import Front, create_app, front_app
from dohnuts.serve.wire import choice_confidence, score_confidence

PLACEHOLDERS = ["<image:" + digit * 32 + ">" for digit in "01"]


@pytest.fixture(scope="module")
def predictor(deployable):
    root, _ = deployable
    return Predictor.from_checkpoint(root / "checkpoint", device="cpu")


@pytest.fixture(scope="module")
def served(predictor):
    server = Served(create_app(predictor, "dohnuts-tiny", max_body_bytes=2**20))
    yield server
    server.close()


def _client(server, key="local", **options):
    return TypeSafeClient(api_key=key, base_url=server.url, **options)


def _alone(predictor, state):
    return predictor.predict(state, OURS)["answers"]


def test_the_official_client_parses_noul_choice_and_score_answers(served, predictor):
    with _client(served) as client:
        response = client.system_one(state={"message": "I was billed twice", "plan": "pro"}, questions=QUESTIONS)
    alone = _alone(predictor, {"message": "I was billed twice", "plan": "pro"})
    assert response.nouls["refund"].noul == pytest.approx(alone["refund"]["noul"], abs=1e-9)
    team = response.choices["team"]
    assert team.choice == alone["team"]["choice"] and dict(team.probabilities) == pytest.approx(
        alone["team"]["probabilities"], abs=1e-9)
    assert team.confidence == pytest.approx(choice_confidence(list(alone["team"]["probabilities"].values())))
    urgency = response.scores["urgency"]
    assert urgency.score == pytest.approx(alone["urgency"]["score"], abs=1e-9)
    assert {str(level): text for level, text in urgency.legend.items()} == {"0": "not urgent", "1": "this week",
                                                                            "2": "today"}
    assert urgency.confidence == pytest.approx(score_confidence(list(alone["urgency"]["probabilities"].values())))
    assert response.usage.input_tokens > 0 and response.usage.output_tokens == 0
    assert response.model == "dohnuts-tiny" and response.request_id


def test_images_sent_as_the_client_sends_them(served, predictor, tmp_path):
    """One image, two inside a text, then four (one of them twice, in a list and nested) through
    the official client's multipart form: the answers `predict` gives the same state with the
    images in place."""
    pictures = saved_pictures(tmp_path)
    sent = [SdkImage(tmp_path / f"{index}.png") for index in range(3)]
    # Images inside a text, as the client's documented f-string puts them there (`attach_assets`,
    # then f"Product: {photo}"): a value of the state, and the whole state.
    inline = ImageText(("before ", pictures[0], ", after ", pictures[1], " (same parcel?)"))
    states = [({"photo": sent[0], "note": "parcel arrived"}, {"photo": pictures[0], "note": "parcel arrived"}),
              ({"note": f"before {sent[0]}, after {sent[1]} (same parcel?)", "n": 2}, {"note": inline, "n": 2}),
              (f"before {sent[0]}, after {sent[1]} (same parcel?)", inline),
              ({"photos": [sent[0], sent[1]], "note": "listing", "detail": {"label": sent[2], "again": sent[0]}},
               {"photos": [pictures[0], pictures[1]], "note": "listing",
                "detail": {"label": pictures[2], "again": pictures[0]}})]
    with _client(served) as client, client.attach_assets(sent):  # attached: found inside texts too
        for wire_state, state in states:
            response = client.system_one(state=wire_state, questions=QUESTIONS)
            alone = _alone(predictor, state)
            assert dict(response.choices["team"].probabilities) == pytest.approx(alone["team"]["probabilities"],
                                                                                abs=1e-6)
            assert response.nouls["refund"].noul == pytest.approx(alone["refund"]["noul"], abs=1e-6)
            assert response.usage.input_tokens == predictor.predict(state, OURS)["usage"]["input_tokens"]


def test_a_large_zstd_or_gzip_body_is_decoded(served, predictor):
    state = {"message": "I was billed twice. " * 150}  # over the client's 1 KiB compression threshold
    with _client(served, compression="zstd") as client:
        response = client.system_one(state=state, questions=QUESTIONS)
    alone = _alone(predictor, state)
    assert response.nouls["refund"].noul == pytest.approx(alone["refund"]["noul"], abs=1e-6)
    body = {"model": "jev-latest", "state": state, "questions": OURS}
    gzipped = httpx2.post(f"{served.url}/v1/systemone", content=gzip.compress(json.dumps(body).encode()),
                          headers={"content-type": "application/json", "content-encoding": "gzip"})
    assert gzipped.status_code == 200 and gzipped.json()["answers"]["refund"]["noul"] == pytest.approx(
        alone["refund"]["noul"], abs=1e-6)
    # A body of several gzip members or zstd frames is decoded whole, as `gzip -d` and `zstd -d` do.
    import zstandard

    text = json.dumps(body).encode()
    halves = text[: len(text) // 2], text[len(text) // 2:]
    for encoding, pack in (("gzip", gzip.compress), ("zstd", zstandard.ZstdCompressor().compress)):
        joined = httpx2.post(f"{served.url}/v1/systemone", content=b"".join(map(pack, halves)),
                             headers={"content-type": "application/json", "content-encoding": encoding})
        assert joined.status_code == 200, (encoding, joined.text)
        assert joined.json()["answers"]["refund"]["noul"] == pytest.approx(alone["refund"]["noul"], abs=1e-6)


class HeldEngines:
    """Engines that answer (zero logits) only once `release` is set: requests stay in flight."""

    ready, depth, refusing = True, 0, False

    def __init__(self):
        self.release = threading.Event()
        self.held = 0  # requests submitted so far
        self.cancelled = 0  # of them, those whose callers went away

    async def submit(self, request):
        self.held += 1
        try:
            while not self.release.is_set():
                await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        return np.zeros((len(request.rows), max(len(row.markers) for row in request.rows)), dtype=np.float32)

    def close(self):
        self.release.set()


def test_a_front_end_refuses_past_its_requests_in_flight_with_429(predictor):
    engines = HeldEngines()
    front = Front(predictor.template, predictor.config, predictor.calibrator, engines)
    held = Served(front_app(front, "dohnuts-tiny", max_in_flight=2))
    body = {"model": "jev-latest", "state": "hello", "questions": {"ok": {"type": "noul"}}}
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
            waiting = [pool.submit(_post, held, body) for _ in range(2)]
            deadline = time.monotonic() + 30
            while engines.held < 2:  # both are held by the engines
                assert time.monotonic() < deadline, "the two requests never reached the engines"
                time.sleep(0.01)
            refused = _post(held, body)
            engines.release.set()
            answered = [future.result().status_code for future in waiting]
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert "2 requests at once" in refused.json()["detail"]["message"]
        assert answered == [200, 200] and _post(held, body).status_code == 200
    finally:
        held.close()


def test_a_front_end_refuses_at_once_while_its_engines_refuse(predictor):
    """While the engines refuse new requests (their queue-delay admission, read from shared
    memory), a front end answers 429 with Retry-After before reading the body: nothing reaches
    the engines, a malformed body included; once they take requests again, it answers."""
    engines = HeldEngines()
    engines.release.set()
    front = Front(predictor.template, predictor.config, predictor.calibrator, engines)
    held = Served(front_app(front, "dohnuts-tiny"))
    body = {"model": "jev-latest", "state": "hello", "questions": {"ok": {"type": "noul"}}}
    try:
        engines.refusing = True
        refused = _post(held, body)
        unread = httpx2.post(f"{held.url}/v1/systemone", content=b"{not json", timeout=30,
                             headers={"content-type": "application/json"})
        assert refused.status_code == unread.status_code == 429 and refused.headers["retry-after"] == "1"
        assert "queue-delay" in refused.json()["detail"]["message"] and engines.held == 0
        engines.refusing = False
        assert _post(held, body).status_code == 200 and engines.held == 1
    finally:
        held.close()


def test_a_client_that_disconnects_has_its_request_withdrawn_from_the_engines(predictor):
    """Its wait for the engines is cancelled (an engine then drops it from its queue: the engine
    tests), and the front end serves on."""
    engines = HeldEngines()
    front = Front(predictor.template, predictor.config, predictor.calibrator, engines)
    held = Served(front_app(front, "dohnuts-tiny"))
    body = {"model": "jev-latest", "state": "hello", "questions": {"ok": {"type": "noul"}}}
    try:
        with pytest.raises(httpx2.TimeoutException):  # the client gives up and closes its connection
            httpx2.post(f"{held.url}/v1/systemone", json=body, timeout=0.5)
        deadline = time.monotonic() + 30
        while engines.cancelled < 1:
            assert time.monotonic() < deadline, "the request was never withdrawn"
            time.sleep(0.01)
        assert engines.held == 1
        engines.release.set()
        answered = _post(held, body)
        assert answered.status_code == 200 and "x-typesafe-request-id" in answered.headers
    finally:
        held.close()


def test_a_request_past_its_deadline_gets_504_and_a_bad_deadline_422(served):
    body = {"model": "jev-latest", "state": "hello", "questions": {"ok": {"type": "noul"}}}
    late = _post(served, body, headers={"x-dohnuts-deadline-ms": "0.001"})  # a microsecond: due before it runs
    assert late.status_code == 504 and "deadline passed" in late.json()["detail"]["message"]
    bad = _post(served, body, headers={"x-dohnuts-deadline-ms": "soon"})
    assert bad.status_code == 422 and "x-dohnuts-deadline-ms" in bad.json()["detail"][0]["msg"]
    assert _post(served, body, headers={"x-dohnuts-deadline-ms": "30000"}).status_code == 200


def test_metrics_need_the_api_key_when_one_is_set(predictor):
    locked = Served(create_app(predictor, "dohnuts-tiny", api_key="s3cret"))
    try:
        assert httpx2.get(f"{locked.url}/metrics").status_code == 401
        answered = httpx2.get(f"{locked.url}/metrics", headers={"authorization": "Bearer s3cret"})
        assert answered.status_code == 200 and "dohnuts_requests_total" in answered.text
    finally:
        locked.close()


def test_an_api_key_is_checked_when_configured_and_ignored_when_not(predictor, served):
    locked = Served(create_app(predictor, "dohnuts-tiny", api_key="s3cret"))
    try:
        with _client(locked, key="wrong") as client, pytest.raises(TypeSafeAuthenticationError):
            client.system_one(state="hello", questions={"ok": Noul(instructions="Is it ok?")})
        raw = httpx2.post(f"{locked.url}/v1/systemone", json={"model": "jev-latest", "state": "s", "questions": OURS})
        assert raw.status_code == 401 and raw.json()["detail"]["error_type"] == "authentication_error"
        with _client(locked, key="s3cret") as client:
            assert client.system_one(state="hello", questions={"ok": Noul(instructions="Is it ok?")}).nouls["ok"]
    finally:
        locked.close()
    with _client(served, key="anything-at-all") as client:  # auth off: any key is accepted
        assert client.system_one(state="hello", questions={"ok": Noul(instructions="Is it ok?")}).nouls["ok"]


def _bomb() -> str:
    """A PNG whose header says 12,000 x 9,000 pixels in about 100 KB: one colour compresses to little."""
    buffer = io.BytesIO()
    Image.new("1", (12000, 9000)).save(buffer, format="PNG", optimize=True)
    return base64.b64encode(buffer.getvalue()).decode()


BOMB = _bomb()


def _post(server, body, **options):
    return httpx2.post(f"{server.url}/v1/systemone", timeout=30, **({"json": body} | options))


def test_a_body_that_stops_coming_gets_408_by_its_deadline_and_a_large_part_is_read(served, predictor):
    """A client that sends part of its body and stops holds its slot only until the request is
    due (408); a multipart `request` part over Starlette's 1 MiB default is read as plain JSON
    of that size would be."""
    import socket

    with socket.create_connection(("127.0.0.1", served.port), timeout=10) as stalled:
        stalled.sendall(b"POST /v1/systemone HTTP/1.1\r\nhost: local\r\ncontent-type: application/json\r\n"
                        b"content-length: 1000\r\nx-dohnuts-deadline-ms: 500\r\n\r\n{\"model\": ")
        begun = time.monotonic()
        answer = stalled.recv(4096).decode()
    assert answer.startswith("HTTP/1.1 408") and "deadline" in answer, answer
    assert time.monotonic() - begun < 5
    padded = ('{"model": "jev-latest", "state": "hello",' + " " * 1_200_000
              + '"questions": {"ok": {"type": "noul"}}}')  # valid JSON of 1.2 MB
    larger = Served(create_app(predictor, "dohnuts-tiny", max_body_bytes=4 * 2**20))
    try:
        response = httpx2.post(f"{larger.url}/v1/systemone", files={"request": (None, padded, "application/json")})
    finally:
        larger.close()
    assert response.status_code == 200, response.text


def test_every_invalid_request_gets_its_4xx_and_the_server_keeps_serving(served):
    good = {"model": "jev-latest", "state": "hello", "questions": {"ok": {"type": "noul"}}}
    cases = [
        (_post(served, None, content=b"{not json", headers={"content-type": "application/json"}), 422),
        (_post(served, {**good, "questions": {}}), 422),
        (_post(served, {**good, "questions": {"q": {"type": "choice", "criteria": {"only": None}}}}), 422),
        (_post(served, {**good, "questions": {"q": {"type": "box", "instructions": "where?"}}}), 422),
        (_post(served, {**good, "state": "word " * 40000}), 413),  # over the 32,768-token budget of a row
        (_post(served, None, content=b"x" * (2**20 + 1), headers={"content-type": "application/json"}), 413),
        (_post(served, {**good, "model": "another-model"}), 404),
        (_post(served, None, content=b"{}", headers={"content-type": "application/json",
                                                     "content-encoding": "br"}), 415),
        (_post(served, None, content=b"(\xb5/\xfd not zstd", headers={"content-type": "application/json",
                                                                    "content-encoding": "zstd"}), 400),
        (_post(served, None, content=gzip.compress(json.dumps(good).encode()) + b"trailing bytes",
               headers={"content-type": "application/json", "content-encoding": "gzip"}), 400),
        (_post(served, None, files={"request": (None, json.dumps(good), "application/json"),
                                    **{f"asset-{i}": (f"{i}.png", b"x", "image/png") for i in range(65)}}),
         400),  # more parts than a request may have: Starlette's refusal, in the wire format's shape
        (_post(served, {**good, "state": "a <|fim_suffix|> b"}), 422),
        (_post(served, {**good, "state": {"a": PLACEHOLDERS[0], "b": PLACEHOLDERS[1]},
                        "assets": {key: {"type": "image", "format": "png", "data_base64": "AA=="}
                                   for key in PLACEHOLDERS}}), 422),  # two images
        (_post(served, None, content=b"[" * 100_000 + b"]" * 100_000,
               headers={"content-type": "application/json"}), 422),  # nested past the parser's depth limit
        (_post(served, {**good, "questions": {f"q{i}": {"type": "noul"} for i in range(2000)}}), 422),
        (_post(served, {**good, "state": {"photo": PLACEHOLDERS[0]},  # 105 KB of PNG, 108 megapixels decoded
                        "assets": {PLACEHOLDERS[0]: {"type": "image", "format": "png", "data_base64": BOMB}}}), 413),
    ]
    for response, status in cases:
        assert response.status_code == status, response.text
        assert "x-typesafe-request-id" in response.headers
        detail = response.json()["detail"]
        assert (isinstance(detail, list) and detail[0]["msg"]) if status == 422 else detail["message"]
    schema = cases[2][0].json()["detail"][0]["msg"]
    assert "question 'q' has 1 candidates" in schema  # the message predict raises
    assert "depth limit" in cases[-3][0].json()["detail"][0]["msg"]
    assert "2000 questions, over the limit of 256" in cases[-2][0].json()["detail"][0]["msg"]
    assert "12000 x 9000 pixels, over this server's limit" in cases[-1][0].json()["detail"]["message"]
    assert _post(served, good).status_code == 200
    with _client(served) as client, pytest.raises(TypeSafeUnprocessableEntityError):
        client.system_one(state="hello", questions={"q": Choice(instructions="Pick", criteria={"only": None})})
    with _client(served, model="not-served") as client, pytest.raises(TypeSafeNotFoundError):
        client.system_one(state="hello", questions={"ok": Noul(instructions="ok?")})


def test_a_255_option_choice_with_descriptions_is_answered_as_the_wire_format_requires(served, predictor):
    """The conformance case: a choice of 255 options, each described, through the official client
    (far over the old 4,096-token budget, within the wire format's 32,768)."""
    options = {f"option {index}": f"the description of option number {index}, which is long enough to count"
               for index in range(255)}
    with _client(served) as client:
        response = client.system_one(state="Which option fits the ticket?",
                                     questions={"pick": Choice(instructions="Pick one.", criteria=options)})
    probabilities = dict(response.choices["pick"].probabilities)
    assert list(probabilities) == list(options) and sum(probabilities.values()) == pytest.approx(1.0)
    alone = predictor.predict("Which option fits the ticket?", {"pick": {"type": "choice", "instructions": "Pick one.",
                                                                           "criteria": options}})
    assert probabilities == pytest.approx(alone["answers"]["pick"]["probabilities"], abs=1e-5)
    assert alone["usage"]["input_tokens"] > 4096


def test_concurrent_requests_are_batched_and_get_their_answers_alone(served, predictor):
    states = [{"message": f"ticket {index}: the app crashes", "plan": "pro"} for index in range(24)]
    expected = [_alone(predictor, state) for state in states]

    def ask(state):
        with _client(served) as client:
            return client.system_one(state=state, questions=QUESTIONS)

    with concurrent.futures.ThreadPoolExecutor(max_workers=12) as pool:
        responses = list(pool.map(ask, states))
    for response, alone in zip(responses, expected):
        assert dict(response.choices["team"].probabilities) == pytest.approx(alone["team"]["probabilities"], abs=1e-5)
        assert response.scores["urgency"].score == pytest.approx(alone["urgency"]["score"], abs=1e-5)
    metrics = httpx2.get(f"{served.url}/metrics").text
    counts = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines() if line.startswith("dohnuts_")}
    single = counts['dohnuts_batch_requests_bucket{le="1.0"}']
    assert counts["dohnuts_batch_requests_count"] > single  # some invocation answered several requests
    assert counts['dohnuts_requests_total{status="200"}'] >= 24


def test_health_models_and_metrics(served):
    assert httpx2.get(f"{served.url}/health").json() == {"status": "ready", "model": "dohnuts-tiny"}
    with _client(served) as client:
        models = client.models.list()
    assert [model.name for model in models.models] == ["dohnuts-tiny"] and models.models[0].release_date
    metrics = httpx2.get(f"{served.url}/metrics")
    assert metrics.status_code == 200 and "dohnuts_request_seconds_bucket" in metrics.text


def test_the_server_leaves_graph_captures_to_its_idle_time(served, predictor):
    """The engine loop defers recurring layouts' captures to its idle time (on the CPU there is
    never one to capture)."""
    assert httpx2.get(f"{served.url}/health").json()["status"] == "ready"
    assert predictor.scores.deferred and predictor.engine.deferrers == 1


def test_x_risk_asks_for_abstentions_that_the_official_client_ignores(served, predictor):
    """A request with "x_risk" gets each answer's "x_abstain" as `predict(risk=...)` marks it; the
    official client still parses it; a plain request gets the format's response exactly; a risk
    that is not a number or not fitted is a 422 naming it."""
    state = {"message": "I was billed twice", "plan": "pro"}
    body = {"model": "jev-latest", "state": state, "questions": OURS}  # OURS: the wire form of QUESTIONS
    plain = _post(served, body)
    assert plain.status_code == 200 and all("x_abstain" not in answer for answer in plain.json()["answers"].values())
    marked = predictor.predict(state, OURS, risk=0.05)["answers"]
    response = _post(served, {**body, "x_risk": 0.05})
    assert response.status_code == 200
    for qid, answer in response.json()["answers"].items():
        assert answer["x_abstain"] is marked[qid]["abstain"]
        assert {key: value for key, value in answer.items() if key != "x_abstain"} == plain.json()["answers"][qid]
    with _client(served) as client:  # the client sends extra fields through extra_body, and ignores x_abstain
        parsed = client.system_one(state=state, questions=QUESTIONS, extra_body={"x_risk": 0.05})
    assert parsed.choices["team"].choice == marked["team"]["choice"]
    for risk, message in (("high", "x_risk must be a number"), (True, "x_risk must be a number"),
                          (0.2, "risk 0.2 was not fitted for this checkpoint")):
        refused = _post(served, {**body, "x_risk": risk})
        assert refused.status_code == 422 and message in json.dumps(refused.json()), refused.text
