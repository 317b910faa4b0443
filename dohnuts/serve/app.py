"""The HTTP server: TypeSafe Jev's `/v1/systemone` over a Predictor, batching concurrent requests.

Endpoints: `POST /v1/systemone` (JSON or multipart with image parts, gzip or zstd bodies),
`GET /v1/models`, `GET /health` (ready once the model is loaded and warmed) and `GET /metrics`
(Prometheus text). A bad request gets a 4xx and never a 5xx: 422 for validation (FastAPI's
`{"detail": [...]}` with the message `predict` would raise), 413 for over-budget input or an
oversized body, 401 for a wrong key, 429 with Retry-After when the queue is full.
"""

from __future__ import annotations

import asyncio
import datetime
import hmac
import io
import json
import time
import uuid
import zlib
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.requests import Request as StarletteRequest

from ..inputs.template import OverBudget
from .batcher import Batcher, Closed, Overloaded
from .wire import WireError, parse_system_one, render_response

ALIAS = "jev-latest"  # the official client's default model name
REQUEST_ID = "x-typesafe-request-id"
MAX_BODY_BYTES = 32 * 2**20  # after decompression
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)


class Metrics:
    """The server's Prometheus metrics, in a registry of its own."""

    def __init__(self):
        self.registry = CollectorRegistry()
        self.requests = Counter("dohnuts_requests", "Decision requests by HTTP status", ["status"],
                                registry=self.registry)
        self.rows = Counter("dohnuts_rows", "Questions answered", registry=self.registry)
        self.batches = Histogram("dohnuts_batch_requests", "Requests per model invocation",
                                 buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=self.registry)
        self.latency = Histogram("dohnuts_request_seconds", "Decision request latency", buckets=LATENCY_BUCKETS,
                                 registry=self.registry)
        self.queue = Gauge("dohnuts_queue_depth", "Requests waiting for the model", registry=self.registry)

    def batch(self, requests: int, rows: int, seconds: float) -> None:
        self.batches.observe(requests)
        self.rows.inc(rows)


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
            decoder = zlib.decompressobj(wbits=47 if encoding != "deflate" else 15)  # 47: gzip or zlib header
            out = decoder.decompress(data, limit + 1)
        elif encoding == "zstd":
            import zstandard

            with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data)) as reader:
                out = reader.read(limit + 1)
        else:
            raise WireError(f"Content-Encoding {encoding!r} is not supported (gzip, zstd)", status=415)
    except (zlib.error, ValueError, OSError) as error:
        if isinstance(error, WireError):
            raise
        raise WireError(f"the {encoding} body cannot be decoded ({error})", status=400) from None
    if len(out) > limit:
        raise WireError(f"the request body is over {limit} bytes", status=413)
    return out


async def _body_and_parts(request: Request, limit: int) -> tuple[object, dict[str, bytes]]:
    """The request's JSON body and its multipart parts (name -> bytes), decompressed."""
    raw = await request.body()
    if len(raw) > limit:
        raise WireError(f"the request body is over {limit} bytes", status=413)
    data = decompressed(raw, request.headers.get("content-encoding", ""), limit)
    content_type = request.headers.get("content-type", "application/json")
    parts: dict[str, bytes] = {}
    if content_type.startswith("multipart/form-data"):
        headers = [(key, value) for key, value in request.scope["headers"] if key.lower() != b"content-encoding"]

        async def receive():
            return {"type": "http.request", "body": data, "more_body": False}

        form = await StarletteRequest({**request.scope, "headers": headers}, receive).form(max_files=64,
                                                                                            max_fields=64)
        for name, value in form.multi_items():
            parts[name] = await value.read() if hasattr(value, "read") else str(value).encode()
        if "request" not in parts:
            raise WireError("a multipart request needs its JSON in a part named 'request'")
        data = parts.pop("request")
    try:
        return json.loads(data), parts
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise WireError(f"the body is not valid JSON ({error})", error_type="json_invalid") from None


def create_app(predictor, model_name: str, api_key: str | None = None, release_date: str | None = None,
               max_wait: float = 0.003, max_rows: int = 512, max_queue: int = 1024,
               max_body_bytes: int = MAX_BODY_BYTES, on_batch=None) -> FastAPI:
    """The server over `predictor`: requests named `model_name` or `jev-latest`, checked against
    `api_key` when one is given (a Bearer token is accepted and ignored when not). The batcher's
    `max_wait`, `max_rows` and `max_queue` bound how requests are gathered; `on_batch(requests,
    rows, seconds)` also hears of every model invocation (the benchmark counts batch sizes)."""
    metrics = Metrics()
    state = {"ready": False, "batcher": None}
    released = release_date or datetime.date.today().isoformat()

    @asynccontextmanager
    async def lifespan(app):
        def batched(requests: int, rows: int, seconds: float) -> None:
            metrics.batch(requests, rows, seconds)
            if on_batch is not None:
                on_batch(requests, rows, seconds)

        batcher = Batcher(predictor, max_wait, max_rows, max_queue, on_batch=batched)
        # Warm up: the first call loads kernels and tunes them, before /health says ready.
        await asyncio.wrap_future(batcher.submit("warm-up", {"ok": {"type": "noul", "instructions": "Ready?"}}))
        state.update(ready=True, batcher=batcher)
        yield
        state["ready"] = False
        await asyncio.to_thread(batcher.close)

    app = FastAPI(title="Dohnuts /v1/systemone", lifespan=lifespan)

    @app.middleware("http")
    async def request_id(request: Request, call_next):
        response = await call_next(request)
        response.headers[REQUEST_ID] = uuid.uuid4().hex
        return response

    def authorised(request: Request) -> bool:
        if api_key is None:
            return True
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())

    @app.post("/v1/systemone")
    async def system_one(request: Request):
        started = time.monotonic()
        response = await _answer(request)
        metrics.requests.labels(str(response.status_code)).inc()
        metrics.latency.observe(time.monotonic() - started)
        return response

    async def _answer(request: Request) -> Response:
        if not authorised(request):
            return _error(401, "authentication_error", "a valid API key is required: Authorization: Bearer <key>")
        batcher = state["batcher"]
        if batcher is None:
            return _error(503, "overloaded_error", "the model is still loading", {"Retry-After": "1"})
        try:
            body, parts = await _body_and_parts(request, max_body_bytes)
            state_value, questions, model = parse_system_one(body, parts)
        except WireError as error:
            if error.status == 422:
                return _invalid(str(error), error.loc, error.error_type)
            return _error(error.status, "invalid_request_error", str(error))
        if model not in (model_name, ALIAS):
            return _error(404, "not_found_error", f"model {model!r} is not served here; this server serves "
                                                  f"{model_name!r} (or {ALIAS!r})")
        try:
            future = batcher.submit(state_value, questions)
        except Overloaded as error:
            return _error(429, "rate_limit_error", f"the server is busy ({error}); retry shortly",
                          {"Retry-After": "1", "retry-after-ms": "200"})
        except Closed:
            return _error(503, "overloaded_error", "the server is shutting down", {"Retry-After": "1"})
        metrics.queue.set(batcher.depth)
        try:
            result = await asyncio.wrap_future(future)
        except OverBudget as error:
            return _error(413, "request_too_large", str(error))
        except (TypeError, ValueError) as error:  # the schema's own message, as `predict` raises it
            return _invalid(str(error), ("body",))
        return JSONResponse(render_response(result, questions, model_name))

    @app.get("/v1/models")
    async def models():
        return {"models": [{"name": model_name, "description": "a Dohnuts decision model (choice, noul, score)",
                            "release_date": released}]}

    @app.get("/health")
    async def health():
        if not state["ready"]:
            return JSONResponse({"status": "loading"}, status_code=503)
        return {"status": "ready", "model": model_name}

    @app.get("/metrics")
    async def prometheus():
        if state["batcher"] is not None:
            metrics.queue.set(state["batcher"].depth)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
