"""The engine: encoded requests in, candidate logits out, in invocations planned by computed
tokens and run back to back.

An encoded request is what the template made of a request (its rows and its image's RGB bytes
or cache key); the engine knows nothing of HTTP, JSON, images' files or tokenizers. It plans
invocations of several requests: while they fit a captured bucket when the first does (the
invocation replays CUDA graphs), else up to `budget` computed tokens (each shared prefix counted
once; it runs eagerly); a request over the budget is split by rows, each part with its prefix,
and its logits reassembled. Invocations run back to back: the next is packed, padded and copied
while the device runs the one before, whose logits come back to pinned host memory on the same
stream, read once its event has passed.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from ..inputs.batch import SHARED_MIN, Batch, EncodedImage, Row, pack_rows
from ..inputs.pixels import PixelSettings
from .buckets import Shape, bucket_for, smallest_fit
from .cuda_graphs import GraphedScores
from .vision_graphs import vision_buckets

LOG = logging.getLogger(__name__)
DEFAULT_BUDGET = 16384  # computed tokens an invocation holds where no bucket says otherwise
STAGES = ("queue", "prepare", "run", "finish")  # where an invocation's requests spend their time
# Seconds without a request before the serving loop makes a deferred capture. A capture holds the
# engine for a few hundred milliseconds or more, and Poisson arrivals at 80 requests/s leave a
# 50 ms gap (the bound before) about once a second: captures then fell among the traffic. Raising
# it did not remove the open-loop tails measured on the H200 (p99 of seconds at 80 requests/s,
# benchmarks/ledger.jsonl): their cause is not found yet.
IDLE_AFTER = 1.0
# Seconds the oldest waiting request may have waited before new ones are refused (`Overloaded`,
# a 429): past the device's rate the queue then holds about this much work, the device stays busy,
# and the excess is refused at once instead of waiting for a deadline it cannot meet.
MAX_WAIT = 1.0
# An invocation's device time that does not grow with its tokens, in tokens' worth (`Engine.cost`):
# a one-row bucket's graph replayed in 6.28 ms for 1,500 tokens and 11.68 for 3,000 on one H100
# (ledger run 2026-12-05-f56102e-h100-dense-1), 3.6 us a token and 0.88 ms more: about 245 tokens.
INVOCATION_TOKENS = 256


class EncodedRequest(NamedTuple):
    """One request as the engine takes it: its rows in question order, its distinct images (the
    rows' `images` index them) and its deadline (`time.monotonic()` seconds, the same clock for
    every process of a host; None: none). The rows' `question` may be None: the engine reads
    only tokens and markers."""

    rows: list[Row]
    images: tuple[EncodedImage, ...] = ()
    deadline: float | None = None


# The longest sequence of the warm-up: past the gradient bound of the delta rule's walk
# (`scan.SCAN_TOKENS`) and the longest prefix a bucket holds, as the longest requests run.
WARM_UP_TOKENS = 4200
# A long shared prefix of the warm-up: one sequence alone in 64-token steps, keeping its final
# state (`scan.ALONE_FROM` to `ALONE_TO`), as an eager request's long state runs.
WARM_UP_PREFIX = 1600


def settle_heap() -> None:
    """Collect garbage, then move every object alive into the collector's permanent generation
    (`gc.freeze`), once loading is done: a full collection traverses every tracked object, about
    410,000 after loading the Qwen3.5-0.8B shape, and stopped the process for about 90 ms on the
    H200's host (200 ms on this project's CPU) on whichever request it fell; what loading made
    lives as long as the process, so no collection need look at it again. Cycles among frozen
    objects are never collected; a predictor dropped later is still freed, by reference counts
    (its model is in no cycle: held on the H200, 2026-12-04)."""
    gc.collect()
    gc.freeze()


def warm_up_batches(image_pad_id: int) -> list[Batch]:
    """Text batches that between them take every eager route of the forward: a short row of one
    marker; a shared prefix forked into rows of at most 16, 32, 48 and 64 tokens (the delta
    rule's rows kernel, compiled for each count of 16-token parts it unrolls), or into a longer
    row too (the scan from forked states, parts then walk); four prefixes, each forked into a
    short and a long row (the scan's one-kernel walk, from zero and from forked states); rows
    run whole, one and five of them (both scan paths from zero states); one long sequence; one
    long prefix alone (walked in 64-token steps, keeping its final state).
    Markers: 1, 2 and several a row. The token ids are arbitrary (prefixes differ by their
    start): only the shapes and routes matter."""
    def ids(count: int, start: int = 1) -> tuple[int, ...]:  # ids below 100: in any vocabulary
        return tuple(1 + (start + index) % 97 for index in range(count))

    def row(own: int, markers: int, prefix: tuple[int, ...] = ()) -> Row:
        tokens = prefix + ids(own, 500)
        return Row(tokens, tuple(range(len(tokens) - markers, len(tokens))), None, len(prefix))

    prefix = ids(SHARED_MIN + 36)
    shapes = [
        [row(16, 1)],
        [row(10, 2, prefix), row(40, 3, prefix), row(64, 1, prefix)],
        *[[row(own // 2, 2, prefix), row(own, 1, prefix)] for own in (16, 32, 48)],
        [row(10, 2, prefix), row(150, 5, prefix)],
        [row(own, 2 + index, ids(SHARED_MIN + 10 * index, 1000 * index + 1))
         for index in range(4) for own in (10, 100 + 20 * index)],
        [row(300, 3)],
        [row(90 + 37 * index, 2) for index in range(5)],
        [row(WARM_UP_TOKENS, 2)],
        [row(10, 2, ids(WARM_UP_PREFIX, 7)), row(20, 1, ids(WARM_UP_PREFIX, 7))],
    ]
    return [pack_rows(rows, [], image_pad_id) for rows in shapes]


def request_shape(request: EncodedRequest, rows: Sequence[int] | None = None) -> Shape:
    """The shape (`buckets.Shape`) of a request's rows (all, or those at `rows`) in a batch: their
    shared beginning once when at least two share one of SHARED_MIN tokens (as
    `batch.prefix_groups` plans it), then each row's own tokens."""
    chosen = request.rows if rows is None else [request.rows[index] for index in rows]
    lengths = [len(row.input_ids) for row in chosen]
    candidates = max(len(row.markers) for row in chosen)
    split = min(min(row.shared, min(row.markers, default=0)) for row in chosen)
    if len(chosen) < 2 or split < SHARED_MIN:
        return Shape(0, 0, sum(lengths), len(lengths), max(lengths), candidates)
    own = [length - split for length in lengths]
    return Shape(split, 1, sum(own), len(own), max(own), candidates)


@dataclass
class Piece:
    """Rows of one request in an invocation: `rows` of request `request`."""

    request: int
    rows: list[int]


@dataclass
class Invocation:
    """One model call: its pieces, the batch made of them, and its logits once back."""

    pieces: list[Piece]
    batch: Batch | None = None
    logits: torch.Tensor | None = None  # [B, K] on the host (pinned on CUDA), valid after `done`
    done: torch.cuda.Event | None = None
    started: torch.cuda.Event | None = None


def parts_of(request: EncodedRequest, admits: Callable[[Shape, Shape], bool]) -> list[list[int]]:
    """The request's rows in groups of consecutive rows, each admitted alone by `admits(shape,
    shape)` (a lone row that is not, alone): the whole request when it is."""
    groups, current = [], []
    for index in range(len(request.rows)):
        if current:
            joined = request_shape(request, current + [index])
            if not admits(joined, joined):
                groups.append(current)
                current = []
        current.append(index)
    return groups + [current]


def bucket_cost(shape: Shape, ladder) -> int | None:
    """What a batch of `shape` costs the device in tokens' worth: its smallest bucket's tokens of
    `ladder` (padding included) and INVOCATION_TOKENS; None when no bucket holds it."""
    bucket = smallest_fit(shape, ladder)
    return None if bucket is None else bucket.tokens + INVOCATION_TOKENS


def densest(shapes: Sequence[Shape], cost: Callable[[Shape], int | None] | None) -> int:
    """How many requests an invocation takes of those admitted (`shapes[k]`: the first k + 1
    joined): as many as keep the most useful tokens per token of cost (`Engine.cost`, None for a
    shape it cannot price: then all), the most requests among equals. Padding is charged whole:
    a bucket past a rung computes its padding too, so four requests of the serving mix whose
    bucket doubles when the fourth joins do less for the device than three, the fourth leading the
    next invocation (`bench.batching.bucket_padding`)."""
    if cost is None or len(shapes) < 2:
        return len(shapes)
    best, taken = -1.0, len(shapes)
    for count, shape in enumerate(shapes, 1):
        value = cost(shape)
        if value is None:  # an unpriced shape (no bucket holds it): every request admitted
            return len(shapes)
        if shape.tokens / value >= best:  # among equals, the more requests
            best, taken = shape.tokens / value, count
    return taken


def plan(requests: Sequence[EncodedRequest], admits: Callable[[Shape, Shape], bool],
         cost: Callable[[Shape], int | None] | None = None) -> list[list[Piece]]:
    """Invocations in order: requests taken whole while `admits(the invocation's first request's
    shape, the joined shape)` (`Engine.admits`), then as many of those as `densest` keeps by
    `cost`; a request not admitted even alone goes alone, split by rows (`parts_of`)."""
    invocations: list[list[Piece]] = []
    index = 0
    while index < len(requests):
        own = request_shape(requests[index])
        if not admits(own, own):
            invocations += [[Piece(index, rows)] for rows in parts_of(requests[index], admits)]
            index += 1
            continue
        shapes = [own]
        for request in requests[index + 1:]:
            alone = request_shape(request)
            joined = shapes[-1].join(alone)
            if not admits(alone, alone) or not admits(own, joined):
                break
            shapes.append(joined)
        taken = densest(shapes, cost)
        invocations.append([Piece(at, list(range(len(requests[at].rows)))) for at in range(index, index + taken)])
        index += taken
    return invocations


class Engine:
    """Runs encoded requests on a model through `GraphedScores` (CUDA graphs of captured layouts
    and shape buckets on CUDA, eagerly elsewhere), in invocations `plan` makes with `admits`
    (a captured bucket, or `budget` computed tokens: DEFAULT_BUDGET unless given), pipelined on
    CUDA. Its CUDA work goes to the model's device, whichever device the calling thread is on.

    Not thread-safe on its own: one caller at a time (`Predictor` holds a lock, `EngineLoop`
    has one thread). `stats` counts requests, invocations, rows and requests split;
    `stage_seconds` sums each of STAGES (`run`: on CUDA the device time from an invocation's
    start to its end event, on the CPU the call).
    """

    def __init__(self, model, pad_id: int, image_pad_id: int, budget: int | None = None):
        self.model = model
        self.image_pad_id = image_pad_id
        self.scores = GraphedScores(model, pad_id=pad_id)
        self.fixed_budget = budget
        self.stats = {"invocations": 0, "requests": 0, "rows": 0, "split_requests": 0}
        self.deferrers = 0  # serving loops that make the captures in their idle time (`defer_captures`)
        self.stage_seconds = dict.fromkeys(STAGES, 0.0)

    def defer_captures(self, on: bool) -> None:
        """With `on`, a layout that recurs gets its CUDA graph not on the request that brings it
        back but in a serving loop's idle time (`GraphedScores.deferred`): no request waits for a
        capture. Each loop that asked turns it off again when it stops; once all have, the third
        sighting captures on the request again and nothing stays pending."""
        self.deferrers = max(0, self.deferrers + (1 if on else -1))
        self.scores.deferred = self.deferrers > 0  # off, it drops what was pending

    def prepare(self, pixels: PixelSettings | None, buckets=None) -> int:
        """Capture the CUDA graphs of the shape buckets (`buckets.all_buckets` by default) and of
        the vision tower's patch buckets for the pixel policy `pixels` (`vision_graphs`), so that
        requests and image sizes met for the first time replay one: a few seconds, once, on a
        CUDA device; nothing on the CPU. Returns how many language buckets are ready."""
        device = self.model.device
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            ready = self.scores.prepare(buckets)
            if pixels is not None:
                self.model.vision_graphs.prepare(self.model.backbone.visual,
                                                 vision_buckets(pixels.max_pixels, pixels.patch, pixels.merge))
            if device.type == "cuda":
                self.warm_up()
        return ready

    @torch.no_grad()
    def warm_up(self) -> int:
        """Run the eager forward once on each of `warm_up_batches`, so the kernel variants a
        request met for the first time can reach are compiled at load, not on the request (a
        bucket's graph covers only the shapes it fixes); then those of one row through their
        buckets' graphs from the host, as a first sight runs. Returns the batches run eagerly."""
        batches = warm_up_batches(self.image_pad_id)
        for batch in batches:
            moved = batch.to(self.model.device)
            self.model.scores(self.model.embeddings(moved), moved)
        # The host's side of a first sight too: padding to a bucket, pinned copies, the replay
        # (a short row's bucket and a one-row bucket's).
        for batch in batches:
            if len(batch.markers) == 1 and bucket_for(batch, self.scores.ladder) is not None:
                self.scores(batch)
        return len(batches)

    @property
    def budget(self) -> int:
        """Computed tokens an eager invocation may hold: the fixed budget, else DEFAULT_BUDGET."""
        return self.fixed_budget if self.fixed_budget is not None else DEFAULT_BUDGET

    def graphed(self, shape: Shape) -> bool:
        """Whether a batch of `shape` fits a captured bucket (and so replays its graphs)."""
        return bool(self.scores.buckets) and smallest_fit(shape, self.scores.ladder) is not None

    def cost(self, shape: Shape) -> int | None:
        """`bucket_cost` over the captured buckets; None when none holds `shape` (`densest` then
        takes every request admitted)."""
        return bucket_cost(shape, self.scores.ladder) if self.scores.buckets else None

    def admits(self, first: Shape, joined: Shape) -> bool:
        """Whether an invocation whose first request has shape `first` may grow to `joined`: while
        it fits a captured bucket when `first` does (it replays graphs), else while it is within
        the budget (it runs eagerly: the more requests an invocation, the fewer launches each)."""
        if self.graphed(first):
            return self.graphed(joined)
        return joined.tokens <= self.budget

    def _cached(self, image: EncodedImage) -> EncodedImage:
        """The image as a batch takes it: without pixels when its features are cached."""
        if image.pixel_values is None:
            return image
        grid = self.model.image_cache.grid(image.key)
        return EncodedImage(None, grid, image.key) if grid is not None else image

    def collate(self, requests: Sequence[EncodedRequest], pieces: list[Piece]) -> Batch:
        """The batch of an invocation's pieces: their rows in order, each distinct image once."""
        rows, images, seen = [], [], {}
        for piece in pieces:
            request = requests[piece.request]
            slots = []
            for image in request.images:
                if image.key not in seen:
                    seen[image.key] = len(images)
                    images.append(self._cached(image))
                slots.append(seen[image.key])
            for index in piece.rows:
                row = request.rows[index]
                own = tuple(slots[image] for image in row.images)
                rows.append(row if row.images == own else row._replace(images=own))
        return pack_rows(rows, images, self.image_pad_id)

    def launch(self, requests: Sequence[EncodedRequest], pieces: list[Piece]) -> Invocation:
        """Pack, pad and start one invocation; on CUDA its logits are on their way to pinned host
        memory when this returns, and `finish` waits for them."""
        invocation = Invocation(pieces)
        begun = time.perf_counter()
        invocation.batch = self.collate(requests, pieces)
        collated = time.perf_counter()
        device = self.model.device
        if device.type != "cuda":  # the CPU computes as the call runs
            with torch.no_grad():
                invocation.logits = self.scores(invocation.batch)
            self._count("prepare", collated - begun)
            self._count("run", time.perf_counter() - collated)
            return invocation
        with torch.cuda.device(device), torch.no_grad():
            stream = torch.cuda.current_stream(device)
            invocation.started = torch.cuda.Event(enable_timing=True)
            invocation.started.record(stream)
            logits = self.scores(invocation.batch)
            # Back to pinned memory on the same stream: the next invocation queues behind it.
            invocation.logits = torch.empty(logits.shape, dtype=logits.dtype, pin_memory=True)
            invocation.logits.copy_(logits, non_blocking=True)
            invocation.done = torch.cuda.Event(enable_timing=True)
            invocation.done.record(stream)
        self._count("prepare", time.perf_counter() - begun)  # on CUDA the launches are host work too
        return invocation

    def finish(self, invocation: Invocation) -> np.ndarray:
        """The invocation's logits [B, K] float32 on the host, its pieces' rows in order, once the
        device has them."""
        begun = time.perf_counter()
        if invocation.done is not None:
            invocation.done.synchronize()
            self._count("run", invocation.started.elapsed_time(invocation.done) / 1000.0)
        logits = invocation.logits.float().numpy()
        self.stats["invocations"] += 1
        self.stats["rows"] += logits.shape[0]
        self._count("finish", time.perf_counter() - begun)
        return logits

    def _count(self, stage: str, seconds: float) -> None:
        self.stage_seconds[stage] += seconds

    def run(self, requests: Sequence[EncodedRequest]) -> np.ndarray:
        """The logits of every request's rows, stacked in request order [rows, K] float32 (K: the
        most candidates of a row), from the invocations `plan` makes, each launched while the
        one before runs."""
        invocations = plan(requests, self.admits, self.cost)
        self.stats["requests"] += len(requests)
        whole = len(invocations) == 1 and len(invocations[0]) == len(requests)
        if whole:  # the common case: one invocation of every request whole, in order
            return self.finish(self.launch(requests, invocations[0]))
        starts = np.cumsum([0] + [len(request.rows) for request in requests])
        out = np.zeros((int(starts[-1]), max(len(row.markers) for request in requests for row in request.rows)),
                       dtype=np.float32)
        running = None
        for pieces in invocations + [None]:
            launched = self.launch(requests, pieces) if pieces is not None else None
            if running is not None:
                logits, row = self.finish(running), 0
                for piece in running.pieces:
                    for index in piece.rows:
                        out[starts[piece.request] + index, : logits.shape[1]] = logits[row]
                        row += 1
            running = launched
        self.stats["split_requests"] += len({pieces[0].request for pieces in invocations if len(pieces) == 1
                                             and len(pieces[0].rows) < len(requests[pieces[0].request].rows)})
        return out


def per_request(logits: np.ndarray, requests: Sequence[EncodedRequest]) -> list[np.ndarray]:
    """Stacked logits [rows, K] cut into each request's rows [rows_i, its most candidates] (views)."""
    out, start = [], 0
    for request in requests:
        rows = len(request.rows)
        out.append(logits[start:start + rows, : max(len(row.markers) for row in request.rows)])
        start += rows
    return out


@dataclass
class _Waiting:
    request: EncodedRequest
    reply: Callable[[np.ndarray | BaseException], None]
    enqueued: float = field(default_factory=time.monotonic)
    waited: float = 0.0  # seconds in the queue, once taken


class EngineLoop:
    """An engine serving a stream of requests on one thread: the next invocation takes every
    request waiting while the engine admits the joined shape (`Engine.admits`), and is launched
    while the last one runs, so under load the device runs back to back and each invocation is
    as full as the queue allows; a lone request runs at once. Requests that need several
    invocations (over a bucket or the budget alone) run in them together. When no request has
    come for `idle_after` seconds, it does the deferred captures
    (`GraphedScores.capture_pending`), one at a time: no request waits for a capture.

    `submit(request, reply)` queues a request (`cancel` drops it while it waits);
    `reply(logits or error)` is called on the loop's thread, after `on_invocation(requests, rows,
    each request's seconds in the queue)`. At most `max_queue` requests wait, and none is
    queued while the oldest has waited over `max_wait` seconds: `submit` then raises
    `Overloaded`. `lock` is held while the
    engine works (a `Predictor` over the same engine passes its own).
    """

    def __init__(self, engine: Engine, lock: threading.RLock | None = None, max_queue: int = 4096,
                 idle_after: float = IDLE_AFTER, on_invocation=None, max_wait: float | None = MAX_WAIT):
        self.engine = engine
        self.lock = lock or threading.RLock()
        self.max_queue, self.idle_after, self.max_wait = max_queue, idle_after, max_wait
        self.on_invocation = on_invocation
        self.waiting: list[_Waiting] = []
        self.condition = threading.Condition()
        self.closed = False
        self.fatal: BaseException | None = None  # what stopped the loop, if anything did
        self.cancelled = 0  # requests dropped from the queue because their callers went away
        with self.lock:
            self.engine.defer_captures(True)
        self.thread = threading.Thread(target=self._run, name="dohnuts-engine", daemon=True)
        self.thread.start()

    @property
    def depth(self) -> int:
        """Requests waiting for an invocation."""
        return len(self.waiting)

    @property
    def refusing(self) -> bool:
        """Whether `submit` refuses new requests now: its queue is full, or its oldest request has
        waited over `max_wait` (what front ends read to refuse before doing any work)."""
        with self.condition:
            return len(self.waiting) >= self.max_queue or self._behind()

    def _behind(self) -> bool:
        return (self.max_wait is not None and bool(self.waiting)
                and time.monotonic() - self.waiting[0].enqueued > self.max_wait)

    def submit(self, request: EncodedRequest, reply: Callable[[np.ndarray | BaseException], None]) -> _Waiting:
        """Queue one request. Returns its place in the queue, for `cancel`.

        Raises:
            Overloaded: `max_queue` requests already wait.
            Closed: the loop is closed.
        """
        with self.condition:
            if self.closed:
                raise Closed("the engine is closed: it takes no more requests")
            if len(self.waiting) >= self.max_queue:
                raise Overloaded(f"{self.max_queue} requests are waiting")
            if self._behind():
                raise Overloaded(f"requests have waited over {self.max_wait:g} s for the device")
            waiting = _Waiting(request, reply)
            self.waiting.append(waiting)
            self.condition.notify()
            return waiting

    def cancel(self, waiting: _Waiting) -> bool:
        """Drop a request `submit` queued whose caller went away, if no invocation has taken it
        yet: it is never run or answered. Returns whether it was dropped."""
        with self.condition:
            for index, queued in enumerate(self.waiting):
                if queued is waiting:
                    del self.waiting[index]
                    self.cancelled += 1
                    return True
            return False

    def close(self) -> None:
        """Stop once the requests already queued are answered; later ones are refused."""
        with self.condition:
            self.closed = True
            self.condition.notify()
        self.thread.join()
        with self.lock:
            self.engine.defer_captures(False)

    def _take(self, block: bool) -> list[_Waiting] | None:
        """The requests of the next invocation (at least one): of those waiting while the joined
        shape is admitted, as many as `densest` keeps; [] when none waits and `block` is off;
        None once closed with none waiting."""
        with self.condition:
            while True:
                self._drop_expired()
                if self.waiting:
                    break
                if self.closed:
                    return None
                if not block:
                    return []
                if not self.condition.wait(timeout=self.idle_after) and not self.waiting:
                    self._idle()
            shapes: list[Shape] = []
            for waiting in self.waiting:
                own = request_shape(waiting.request)
                joined = shapes[-1].join(own) if shapes else own
                if shapes and not self.engine.admits(shapes[0], joined):
                    break
                shapes.append(joined)
            taken = densest(shapes, self.engine.cost)
            batch, self.waiting = self.waiting[:taken], self.waiting[taken:]
            return batch

    def _drop_expired(self) -> None:
        """Drop the waiting requests whose deadline has passed (the condition is held)."""
        self.waiting = self._unexpired(self.waiting)

    def _unexpired(self, batch: list[_Waiting]) -> list[_Waiting]:
        """`batch` without the requests whose deadline has passed, which are answered `Expired`:
        their work is dropped before it starts."""
        now = time.monotonic()
        expired = [waiting for waiting in batch if waiting.request.deadline is not None
                   and waiting.request.deadline <= now]
        if not expired:
            return batch
        self._reply(expired, Expired("the request's deadline passed before it ran"))
        gone = set(map(id, expired))
        return [waiting for waiting in batch if id(waiting) not in gone]

    def _idle(self) -> None:
        """One deferred capture, the condition's lock released meanwhile (submit goes on). A
        capture that fails is logged and dropped: it is an optimisation, never fatal."""
        self.condition.release()
        try:
            with self.lock:
                self.engine.scores.capture_pending()
        except Exception:  # noqa: BLE001 - see the docstring
            LOG.exception("an idle capture failed; its layout runs as it did")
        finally:
            self.condition.acquire()

    def _run(self) -> None:
        if self.engine.model.device.type == "cuda":
            torch.cuda.set_device(self.engine.model.device)  # this thread's events and streams
        try:
            self._serve()
        except BaseException as error:  # noqa: BLE001 - the loop's own failure: every waiting request hears it
            LOG.exception("the engine loop stopped")
            self.fatal = error
            with self.condition:
                self.closed = True
                lost, self.waiting = self.waiting, []
            self._reply(lost, Closed(f"the engine stopped: {type(error).__name__}: {error}"))

    def _serve(self) -> None:
        running = None  # (invocation or its error, its requests) launched and not yet answered
        while self.fatal is None:
            batch = self._take(block=running is None)
            if batch is None and running is None:
                return
            launched = None
            if batch:
                with self.lock:  # held from the last deadline check to the launch
                    batch = self._unexpired(batch)
                    now = time.monotonic()
                    for waiting in batch:
                        waiting.waited = now - waiting.enqueued
                    requests = [waiting.request for waiting in batch]
                    invocations = self._guarded(plan, requests, self.engine.admits) if batch else []
                    several = isinstance(invocations, BaseException) or len(invocations) > 1
                    if batch and not several:
                        launched = self._guarded(self.engine.launch, requests, invocations[0]), batch
                if several:  # over one invocation: the one running is answered first
                    if running is not None:
                        self._finish(*running)
                        running = None
                    results = invocations if isinstance(invocations, BaseException) else self._guarded(
                        self.engine.run, requests)
                    self._answer(batch, results)
                    continue
            if running is not None:
                self._finish(*running)
            running = launched
        if running is not None:
            self._finish(*running)
        raise self.fatal

    def _guarded(self, work, *arguments):
        """`work(*arguments)` under the engine's lock, or its error: an invocation that fails
        fails its requests, never the loop; one that leaves the device unusable stops the loop."""
        try:
            with self.lock:
                return work(*arguments)
        except Exception as error:  # noqa: BLE001 - see the docstring
            if device_lost(error):
                self.fatal = error
            return error

    def _finish(self, invocation, batch: list[_Waiting]) -> None:
        if not isinstance(invocation, BaseException):
            invocation = self._guarded(self.engine.finish, invocation)
        self._answer(batch, invocation)

    def _answer(self, batch: list[_Waiting], results) -> None:
        """Count an invocation's requests and reply to each with its logits or the error; after
        a failure of several requests, try them again in halves (`_retry`)."""
        if isinstance(results, Exception) and len(batch) > 1 and self.fatal is None:
            self._retry(batch)
            return
        requests = [waiting.request for waiting in batch]
        self.engine.stats["requests"] += len(requests)
        self.engine._count("queue", sum(waiting.waited for waiting in batch))
        if self.on_invocation is not None:
            try:
                self.on_invocation(len(batch), sum(len(request.rows) for request in requests),
                                   [waiting.waited for waiting in batch])
            except Exception:  # noqa: BLE001 - counting must not lose answers
                LOG.exception("on_invocation failed")
        if isinstance(results, BaseException):
            self._reply(batch, results)
            return
        for waiting, logits in zip(batch, per_request(results, requests)):
            self._reply([waiting], logits)

    def _retry(self, batch: list[_Waiting]) -> None:
        """Run a failed invocation's requests again, each half on its own, down to single requests:
        one bad request then fails alone and the others are answered, and a batch too large for
        the device's memory runs in smaller parts."""
        half = len(batch) // 2
        for part in (batch[:half], batch[half:]):
            self._answer(part, self._guarded(self.engine.run, [waiting.request for waiting in part]))

    @staticmethod
    def _reply(batch: list[_Waiting], result) -> None:
        for waiting in batch:
            with contextlib.suppress(Exception):  # a caller gone away cannot stop the loop
                waiting.reply(result)


def device_lost(error: BaseException) -> bool:
    """Whether an error leaves the CUDA device unusable for this process (an illegal access, an
    uncorrectable error: CUDA's sticky errors), so only a new process can go on."""
    text = str(error)
    return isinstance(error, RuntimeError) and "CUDA" in text and any(
        marker in text for marker in ("illegal memory access", "unspecified launch failure", "uncorrectable",
                                      "device-side assert", "misaligned address", "illegal instruction"))


class Overloaded(RuntimeError):
    """More requests wait than the engine queues: the caller should retry later."""


class Closed(RuntimeError):
    """The engine was closed: it takes no more requests."""


class Expired(RuntimeError):
    """The request's deadline passed before the engine ran it: its work was dropped."""
