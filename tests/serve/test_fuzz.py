"""The server under 10,000 fuzzed requests (`fuzz_bodies`): JSON, bytes, compression, multipart
and images gone wrong as clients send them. Every answer is a 4xx naming the problem or a
correct 200, never a 5xx or a hang, and the server answers as before afterwards."""

import collections
import concurrent.futures
import os

import httpx2
import pytest
from fuzz_bodies import fuzzed
from served import Served
from wire_questions import OURS

from dohnuts import Predictor
from dohnuts.serve.app import create_app

COUNT = int(os.environ.get("DOHNUTS_FUZZ_COUNT", "10000"))


@pytest.fixture(scope="module")
def served(deployable):
    root, _ = deployable
    predictor = Predictor.from_checkpoint(root / "checkpoint", device="cpu")
    server = Served(create_app(predictor, "dohnuts-tiny", max_body_bytes=2**20))
    yield server, predictor
    server.close()


def _send(client: httpx2.Client, request) -> tuple[str, int, object]:
    name, body, headers, files = request
    try:
        if files is not None:
            response = client.post("/v1/systemone", files=files)
        else:
            response = client.post("/v1/systemone", content=body, headers=headers)
    except httpx2.HTTPError as error:  # a dropped connection: the server failed this request
        return name, 599, f"{type(error).__name__}: {error}"
    try:
        detail = response.json().get("detail") if response.status_code != 200 else response.json()["answers"]
    except ValueError:
        detail = None
    return name, response.status_code, detail


def test_fuzzed_requests_get_4xx_or_200_never_5xx(served):
    server, predictor = served
    statuses: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    problems = []
    with httpx2.Client(base_url=server.url, timeout=60) as client, \
            concurrent.futures.ThreadPoolExecutor(8) as pool:
        for name, status, detail in pool.map(lambda request: _send(client, request), fuzzed(COUNT, seed=7)):
            statuses[name][status] += 1
            if status >= 500 or detail is None or (status != 200 and not detail):
                problems.append((name, status, str(detail)[:300]))
    assert not problems, problems[:10]
    assert sum(sum(counter.values()) for counter in statuses.values()) == COUNT
    # Busy, the server refuses any request with 429 and Retry-After before reading its body (its
    # oldest request waited past the queue-delay bound: on a loaded 2-core CI machine, bodies of
    # garbage once met it). A refusal names no mistake, so it is set apart, and stays rare.
    busy = sum(counter[429] for counter in statuses.values())
    assert busy < COUNT / 20, dict(statuses)
    assert statuses["valid"][200] == sum(statuses["valid"].values()) - statuses["valid"][429] > 0
    assert statuses["multipart-valid"][200] > 0 and statuses["multipart-claims-huge"][413] > 0
    assert set(statuses["bytes-garbage"]) <= {400, 413, 415, 422, 429}, statuses["bytes-garbage"]
    refused = sum(count for counter in statuses.values() for status, count in counter.items() if status != 200)
    assert refused > COUNT / 2  # most mutations are mistakes the server must name
    body = {"model": "jev-latest", "state": "a parcel arrived broken", "questions": OURS}
    after = httpx2.post(f"{server.url}/v1/systemone", json=body, timeout=60)
    alone = predictor.predict("a parcel arrived broken", OURS)["answers"]
    assert after.status_code == 200
    assert after.json()["answers"]["refund"]["noul"] == pytest.approx(alone["refund"]["noul"], abs=1e-6)
