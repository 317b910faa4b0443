"""The HTTP server: TypeSafe Jev's `/v1/systemone` in front of one or several engines.

A front end does HTTP, the key, admission, decompression, JSON, the wire format, image decoding,
validation and the template, sends the engine the encoded request (`engines`), and renders the
answers from the logits that come back. `dohnuts serve` runs several front ends and an engine
process per GPU (`serve.supervisor`); `create_app(predictor, ...)` serves a `Predictor` in one
process.

Endpoints: `POST /v1/systemone` (JSON or multipart with image parts, gzip or zstd bodies),
`GET /v1/models`, `GET /health` (ready once an engine answers) and `GET /metrics` (Prometheus
text, every process's). A bad request gets a 4xx and never a 5xx: 422 for validation (FastAPI's
`{"detail": [...]}` with the message `predict` would raise), 413 for over-budget input or an
oversized body, 401 for a wrong key, 429 with Retry-After when the engine's queue is full; 503
with Retry-After while no engine can answer (loading, restarting) or the server is stopping.
"""

from __future__ import annotations

import asyncio
import datetime
import hmac
import io
import time
import uuid
import zlib
from contextlib import asynccontextmanager
from dataclasses import dataclass

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.requests import Request as StarletteRequest

from ..config import ModelConfig
from ..inputs.template import OverBudget, Template
from ..runtime.metrics import exposition, metrics
from ..runtime.predict import answers_of, candidate_mask, encode_request
from ..schema import parse_request
from ..scoring.calibrator import Calibrator
from .engines import Closed, EngineFailed, Expired, LocalEngine, Overloaded, Unavailable
from .wire import ALIAS, WireError, parse_system_one, render_response, requested_risk

REQUEST_ID = "x-typesafe-request-id"
MAX_BODY_BYTES = 32 * 2**20  # after decompression
RETRY = {"Retry-After": "1", "retry-after-ms": "200"}
MAX_IN_FLIGHT = 1024  # requests a front end holds at once (each engine queues 4,096)
DEADLINE = 60.0  # seconds a request may take unless its header says otherwise
BODY_SECONDS = 1.0  # the least time a request's body may take to arrive, whatever its deadline
DEADLINE_HEADER = "x-dohnuts-deadline-ms"  # a request's own time budget, in milliseconds from its arrival


@dataclass
class Front:
    """What a front end answers with: the template, the model's settings (its token budgets), the
    calibrator, and the engines (`engines.LocalEngine` or `engines.RemoteEngines`)."""

    template: Template
    config: ModelConfig
    calibrator: Calibrator
    engines: object

    async def answer(self, state, questions, deadline: float | None = None, risk: float | None = None) -> dict:
        """The `predict` result of one request, due by `deadline` (`time.monotonic()` seconds),
        each answer marked "abstain" at `risk` when one is given (see `Predictor.predict`).

        Raises:
            TypeError, ValueError (OverBudget among them): an invalid request; Overloaded,
            Unavailable, Closed, Expired, EngineFailed: from the engines.
        """
        stages = metrics().stages
        begun = time.perf_counter()
        request = parse_request(state, questions, self.template.reserved, self.template.max_images)
        if risk is not None:
            self.calibrator.threshold("choice", risk)  # ValueError for a risk not fitted, before any work
        encoded = encode_request(self.template, self.config, request)._replace(deadline=deadline)
        stages.labels("encode").observe(time.perf_counter() - begun)
        logits = await self.engines.submit(encoded)
        begun = time.perf_counter()
        tokens = sum(len(row.input_ids) for row in encoded.rows)
        result = answers_of(logits, candidate_mask([request]), [request], [tokens], self.calibrator, risk=risk)[0]
        stages.labels("answer").observe(time.perf_counter() - begun)
        return result


class RequestId:
    """ASGI middleware: every HTTP response carries a fresh REQUEST_ID header. A plain ASGI
    wrapper, not Starlette's BaseHTTPMiddleware, which costs a task and a stream a request and
    stands between the endpoint and the client's disconnect."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def sending(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()),
                                                  (REQUEST_ID.encode(), uuid.uuid4().hex.encode())]}
            await send(message)

        await self.app(scope, receive, sending)


DISCONNECTED = 499  # the status counted for a request whose client went away (no one reads it)


class Disconnected(Exception):
    """The client closed its connection before its answer was ready."""


class Drained(Exception):
    """The server stopped before the request's answer was ready: its drain ran out."""


async def unless_disconnected(request: Request, work, drained: asyncio.Event | None = None):
    """The result of the coroutine `work`, unless the client disconnects first (`Disconnected`)
    or `drained` is set first (`Drained`): `work` is then cancelled (an engine drops the request
    if it still waits). Call it once the body has been read: it listens for the client's next
    message, its disconnect."""
    task = asyncio.ensure_future(work)
    waiters = {task, asyncio.ensure_future(_disconnect(request.receive))}
    stop = asyncio.ensure_future(drained.wait()) if drained is not None else None
    if stop is not None:
        waiters.add(stop)
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        for waiter in waiters:
            waiter.cancel()
        raise
    for waiter in waiters - {task}:
        waiter.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.wait({task})  # its cancellation runs now: the engine hears of it
    if stop is not None and stop.done() and not stop.cancelled():
        raise Drained("the server is stopping")
    raise Disconnected("the client went away")


async def _disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _error(status: int, error_type: str, message: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"detail": {"error_type": error_type, "message": message}}, status_code=status, headers=headers)


def _invalid(message: str, loc=("body",), kind: str = "value_error") -> JSONResponse:
    return JSONResponse({"detail": [{"loc": list(loc), "msg": message, "type": kind}]}, status_code=422)


def decompressed(data: bytes, encoding: str, limit: int) -> bytes:
    """The body decoded from its Content-Encoding (identity, gzip, zstd), at most `limit` bytes.

    Raises:
        WireError: an unknown encoding (415), a corrupt body (400) or one over the limit (413).
    """
    encoding = encoding.strip().lower()
    try:
        if encoding in ("", "identity"):
            out = data
        elif encoding in ("gzip", "x-gzip", "deflate"):
            out = _inflated(data, 47 if encoding != "deflate" else 15, limit)  # 47: gzip or zlib header
        elif encoding == "zstd":
            import zstandard

            try:  # every frame, as `zstd -d` reads a file of several
                with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data), read_across_frames=True) as reader:
                    out = reader.read(limit + 1)
            except zstandard.ZstdError as error:  # not a ValueError: a corrupt body was a 500
                raise ValueError(str(error)) from None
        else:
            raise WireError(f"Content-Encoding {encoding!r} is not supported (gzip, zstd)", status=415)
    except (zlib.error, ValueError, OSError) as error:
        if isinstance(error, WireError):
            raise
        raise WireError(f"the {encoding} body cannot be decoded ({error})", status=400) from None
    if len(out) > limit:
        raise WireError(f"the request body is over {limit} bytes", status=413)
    return out


def _inflated(data: bytes, wbits: int, limit: int) -> bytes:
    """A gzip or zlib body decompressed, every member of a gzip file of several (as `gzip -d`
    reads them), up to `limit` + 1 bytes.

    Raises:
        zlib.error: a corrupt or cut member, or bytes after the last that are not one.
    """
    out, rest = b"", data
    while rest and len(out) <= limit:
        decoder = zlib.decompressobj(wbits=wbits)
        out += decoder.decompress(rest, limit + 1 - len(out))
        if decoder.unconsumed_tail:  # over the limit: the caller refuses it
            break
        if not decoder.eof:
            raise zlib.error("the compressed body ends before its end")
        rest = decoder.unused_data
    return out


async def _body_and_parts(request: Request, limit: int) -> tuple[object, dict[str, bytes]]:
    """The request's JSON body and its multipart parts (name -> bytes), decompressed; a body over
    `limit` bytes (as declared, as read, or decompressed) is refused as soon as that is known."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise WireError(f"the request body is {int(declared)} bytes, over {limit}", status=413)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise WireError(f"the request body is over {limit} bytes", status=413)
        chunks.append(chunk)
    raw = b"".join(chunks)
    data = decompressed(raw, request.headers.get("content-encoding", ""), limit)
    content_type = request.headers.get("content-type", "application/json")
    parts: dict[str, bytes] = {}
    if content_type.startswith("multipart/form-data"):
        headers = [(key, value) for key, value in request.scope["headers"] if key.lower() != b"content-encoding"]

        async def receive():
            return {"type": "http.request", "body": data, "more_body": False}

        # A part may be as large as the body (the official client sends `request`, the JSON, as
        # a field: Starlette's default of 1 MiB a part refused a body that plain JSON may send).
        try:
            form = await StarletteRequest({**request.scope, "headers": headers}, receive).form(
                max_files=64, max_fields=64, max_part_size=limit)
        except HTTPException as error:  # Starlette's own 400 (a malformed body, too many parts)
            raise WireError(f"the multipart body cannot be read: {error.detail}", status=400) from None
        for name, value in form.multi_items():
            parts[name] = await value.read() if hasattr(value, "read") else str(value).encode()
        if "request" not in parts:
            raise WireError("a multipart request needs its JSON in a part named 'request'")
        data = parts.pop("request")
    try:  # orjson refuses nesting past 1,024 levels: a deep body is a 422, never a RecursionError
        return orjson.loads(data), parts
    except orjson.JSONDecodeError as error:
        raise WireError(f"the body is not valid JSON ({error})", error_type="json_invalid") from None


def create_app(predictor, model_name: str, api_key: str | None = None, release_date: str | None = None,
               max_queue: int = 4096, max_body_bytes: int = MAX_BODY_BYTES, on_invocation=None) -> FastAPI:
    """The server over `predictor` in this process: an `EngineLoop` on its engine (`max_queue`
    requests may wait; `on_invocation(requests, rows, waits)` hears of each model invocation),
    the rest as `front_app`."""
    front = Front(predictor.template, predictor.config, predictor.calibrator, None)

    def start():
        # The first call loads kernels and tunes them: before /health says ready.
        predictor.predict("warm-up", {"ok": {"type": "noul", "instructions": "Ready?"}})
        front.engines = LocalEngine(predictor, max_queue=max_queue, on_invocation=on_invocation)
        return front.engines

    return front_app(front, model_name, api_key, release_date, max_body_bytes, start)


def front_app(front: Front, model_name: str, api_key: str | None = None, release_date: str | None = None,
              max_body_bytes: int = MAX_BODY_BYTES, start=None, max_in_flight: int = MAX_IN_FLIGHT,
              deadline: float = DEADLINE) -> FastAPI:
    """A front end: requests named `model_name` or `jev-latest`, checked against `api_key` when
    one is given (a Bearer token is accepted and ignored when not). `start()`, when given, makes
    the engines at startup (returning them); they are closed at shutdown. Past `max_in_flight`
    requests at once, a request is refused with 429 and Retry-After before any work. A request
    is due `deadline` seconds after it arrives, or as its DEADLINE_HEADER (milliseconds) says:
    past it, it is answered 504 and its work dropped if it has not started. Once running,
    `app.state.drain_after(seconds)` (safe from a signal handler) answers what is still in flight
    that many seconds later with 503 and Retry-After, its work dropped: a stop's drain."""
    state = {"stopping": False, "in_flight": 0}
    released = release_date or datetime.date.today().isoformat()
    counted = metrics()
    drained = asyncio.Event()  # set once a stop's drain has run out (`drain_after`)

    @asynccontextmanager
    async def lifespan(app):
        loop = asyncio.get_running_loop()

        def drain_after(seconds: float) -> None:
            # From a signal handler or another thread: the loop sets the event in `seconds`.
            loop.call_soon_threadsafe(loop.call_later, seconds, drained.set)

        app.state.drain_after = drain_after
        if start is not None:
            start()
        yield
        state["stopping"] = True
        if front.engines is not None:
            front.engines.close()

    app = FastAPI(title="Dohnuts /v1/systemone", lifespan=lifespan)
    app.add_middleware(RequestId)

    def authorised(request: Request) -> bool:
        if api_key is None:
            return True
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())

    @app.post("/v1/systemone")
    async def system_one(request: Request):
        started = time.monotonic()
        if state["in_flight"] >= max_in_flight:
            response = _error(429, "rate_limit_error", f"the server holds {max_in_flight} requests at once on this "
                                                       f"front end; retry shortly", RETRY)
        else:
            state["in_flight"] += 1
            try:
                response = await _answer(request)
            finally:
                state["in_flight"] -= 1
        counted.requests.labels(str(response.status_code)).inc()
        counted.latency.observe(time.monotonic() - started)
        return response

    def due(request: Request) -> float:
        """When the request is due (time.monotonic()), from its header or the server's default.

        Raises:
            WireError: a header that is not a positive number of milliseconds.
        """
        header = request.headers.get(DEADLINE_HEADER)
        if header is None:
            return time.monotonic() + deadline
        try:
            milliseconds = float(header)
        except ValueError:
            milliseconds = -1.0
        if not 0 < milliseconds < float("inf"):
            raise WireError(f"{DEADLINE_HEADER} must be a positive number of milliseconds, got {header!r}",
                            loc=("header", DEADLINE_HEADER))
        return time.monotonic() + milliseconds / 1000

    async def _answer(request: Request) -> Response:
        if not authorised(request):
            return _error(401, "authentication_error", "a valid API key is required: Authorization: Bearer <key>")
        engines = front.engines
        if state["stopping"] or engines is None:
            return _error(503, "overloaded_error", "the server is stopping" if state["stopping"] else
                          "the model is still loading", RETRY)
        if engines.refusing:  # what the engine would answer, before any work on the body
            return _error(429, "rate_limit_error", "the server is busy (its requests have waited past its queue-delay "
                                                   "bound for the device); retry shortly", RETRY)
        try:
            due_at = due(request)
            # A body that stops coming holds its slot only until the request is due (a second at
            # least: a body sent whole is read even when its deadline is near, and answered 504).
            body, parts = await asyncio.wait_for(_body_and_parts(request, max_body_bytes),
                                                 max(BODY_SECONDS, due_at - time.monotonic()))
            if parts or (isinstance(body, dict) and body.get("assets")):  # images decode off the event loop
                state_value, questions, model = await asyncio.to_thread(parse_system_one, body, parts,
                                                                        front.template.max_images)
            else:
                state_value, questions, model = parse_system_one(body, parts, front.template.max_images)
            risk = requested_risk(body)
        except WireError as error:
            if error.status == 422:
                return _invalid(str(error), error.loc, error.error_type)
            return _error(error.status, "invalid_request_error", str(error))
        except TimeoutError:
            return _error(408, "invalid_request_error", "the request body did not arrive before the request's "
                                                        "deadline")
        except ClientDisconnect:  # gone while sending its body: no one to answer
            return Response(status_code=DISCONNECTED)
        if model not in (model_name, ALIAS):
            return _error(404, "not_found_error", f"model {model!r} is not served here; this server serves "
                                                  f"{model_name!r} (or {ALIAS!r})")
        try:
            result = await unless_disconnected(request, front.answer(state_value, questions, due_at, risk), drained)
        except Disconnected:  # no one to answer; its work was dropped if it had not started
            return Response(status_code=DISCONNECTED)
        except Drained:
            return _error(503, "overloaded_error", "the server stopped before this request was answered (its "
                                                   "drain ran out); retry", RETRY)
        except OverBudget as error:
            return _error(413, "request_too_large", str(error))
        except (TypeError, ValueError) as error:  # the schema's own message, as `predict` raises it
            return _invalid(str(error), ("body",))
        except Overloaded as error:
            return _error(429, "rate_limit_error", f"the server is busy ({error}); retry shortly", RETRY)
        except (Unavailable, Closed) as error:
            return _error(503, "overloaded_error", f"the model cannot answer now ({error}); retry shortly", RETRY)
        except Expired as error:
            return _error(504, "timeout_error", f"{error}: not answered in time")
        except EngineFailed as error:
            return _error(500, "api_error", f"the model failed on this request ({error})")
        return JSONResponse(render_response(result, questions, model_name))

    @app.get("/v1/models")
    async def models():
        return {"models": [{"name": model_name, "description": "a Dohnuts decision model (choice, noul, score)",
                            "release_date": released}]}

    @app.get("/health")
    async def health():
        if state["stopping"] or front.engines is None or not front.engines.ready:
            return JSONResponse({"status": "loading"}, status_code=503, headers=RETRY)
        return {"status": "ready", "model": model_name}

    @app.get("/metrics")
    async def prometheus(request: Request):
        if not authorised(request):  # the same key as the API's, when one is set
            return _error(401, "authentication_error", "a valid API key is required: Authorization: Bearer <key>")
        if front.engines is not None:
            counted.in_flight.set(front.engines.depth)
        text, kind = exposition()
        return Response(text, media_type=kind)

    return app
