"""Concurrent requests gathered into one model invocation, run by one worker thread."""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)


class Overloaded(RuntimeError):
    """More requests are waiting than the batcher queues: the caller should retry later."""


class Closed(RuntimeError):
    """The batcher was closed: it takes no more requests."""


@dataclass
class _Pending:
    state: object
    questions: dict
    future: Future = field(default_factory=Future)
    enqueued: float = field(default_factory=time.monotonic)

    @property
    def rows(self) -> int:
        return len(self.questions) if isinstance(self.questions, dict) else 1


class Batcher:
    """Runs `Predictor.predict_many` on one worker thread over the requests that arrive together.

    The worker takes the first waiting request, then gathers what else is waiting and, while
    traffic is concurrent (the last invocation answered several requests, or others waited as
    it ran, and no quiet spell of `idle_after` seconds came since), more for up to `max_wait`
    seconds, until `max_rows` question rows; a lone client's request runs at once instead of
    waiting for company that is not coming (3 ms of its latency by default). It answers them
    in one forward pass; every request still computes its own shared prefix once (the
    runtime's several-prefixes path), and its answers equal those it gets alone. An invalid
    request fails alone. Nothing else touches the model, so nothing races. At most `max_queue`
    requests wait; beyond, `submit` refuses.

    `on_batch(requests, rows, seconds)` is called after every invocation (metrics), before its
    callers get their answers.

    A predictor with deferred work (`Predictor.capture_when_idle` and `idle`: the CUDA graphs
    of layouts that recur) is asked to do it only once no request has come for `idle_after`
    seconds, one piece at a time, until it has none left; so no request waits for a capture
    unless it arrives during one, and a server under steady load captures nothing.
    """

    def __init__(self, predictor, max_wait: float = 0.003, max_rows: int = 512, max_queue: int = 1024,
                 on_batch=None, idle_after: float = 0.05):
        self.predictor = predictor
        self.max_wait, self.max_rows, self.max_queue = max_wait, max_rows, max_queue
        self.on_batch = on_batch
        self.concurrent = False  # whether the last invocation met concurrent traffic...
        self.finished = float("-inf")  # ...and when it ended
        self.idle_after = idle_after
        self.idle = getattr(predictor, "idle", None)
        if self.idle is not None:
            predictor.capture_when_idle()
        self.waiting: queue.Queue = queue.Queue()
        self.closing, self.closed = threading.Lock(), False  # nothing is queued behind the stop
        self.thread = threading.Thread(target=self._run, name="dohnuts-batcher", daemon=True)
        self.thread.start()

    @property
    def depth(self) -> int:
        """Requests waiting for the worker."""
        return self.waiting.qsize()

    def submit(self, state, questions) -> Future:
        """Queue one request; its future gets the `predict` result, or the request's error.

        Raises:
            Overloaded: `max_queue` requests are already waiting.
            Closed: the batcher was closed (a request queued behind its stop would never run).
        """
        with self.closing:
            if self.closed:
                raise Closed("the batcher is closed: it takes no more requests")
            if self.waiting.qsize() >= self.max_queue:
                raise Overloaded(f"{self.max_queue} requests are waiting")
            pending = _Pending(state, questions)
            self.waiting.put(pending)
        return pending.future

    def close(self) -> None:
        """Stop the worker once the requests already queued are answered (later ones are refused
        with `Closed`); a predictor asked to defer work to the batcher's idle time no longer does."""
        with self.closing:
            if self.closed:
                return
            self.closed = True
            self.waiting.put(None)
        self.thread.join()
        if self.idle is not None:
            self.predictor.capture_when_idle(False)

    def _gather(self, first: _Pending) -> tuple[list[_Pending], bool]:
        batch, rows = [first], first.rows
        # Concurrent traffic, unless a quiet spell (idle_after) came between it and this request.
        concurrent = self.concurrent and first.enqueued - self.finished < self.idle_after
        deadline = time.monotonic() + (self.max_wait if concurrent else 0.0)
        while rows < self.max_rows:
            try:
                # Whatever is already waiting joins at once; then up to the deadline.
                item = self.waiting.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if item is None:
                return batch, True
            batch.append(item)
            rows += item.rows
        return batch, False

    def _next(self, idle_work: bool) -> tuple[_Pending | None, bool]:
        """(the next request, or None to stop; whether idle work may remain). While some may,
        waiting `idle_after` seconds with no request runs one piece of it."""
        while idle_work:
            try:
                return self.waiting.get(timeout=self.idle_after), True
            except queue.Empty:
                try:
                    idle_work = bool(self.idle())
                except Exception:  # noqa: BLE001 - deferred work is an optimisation: its failure is logged, never fatal
                    logger.exception("the predictor's idle work failed; the batcher goes on without it")
                    idle_work = False
        return self.waiting.get(), False

    def _run(self) -> None:
        stop, idle_work = False, False
        while not stop:
            first, idle_work = self._next(idle_work)
            if first is None:
                break
            batch, stop = self._gather(first)
            idle_work = self.idle is not None  # each batch may leave deferred work
            started = time.monotonic()
            try:
                results = self.predictor.predict_many([(p.state, p.questions) for p in batch], errors="return")
            except Exception as error:  # noqa: BLE001 - the batch fails as a whole: every caller hears why
                results = [error] * len(batch)
            self.concurrent, self.finished = len(batch) > 1 or self.waiting.qsize() > 0, time.monotonic()
            try:
                # Counted before any caller hears its answer, so a caller that has every answer
                # also finds every invocation counted (the serving benchmark reads both).
                if self.on_batch is not None:
                    self.on_batch(len(batch), sum(p.rows for p in batch), time.monotonic() - started)
            finally:
                for pending, result in zip(batch, results):
                    if isinstance(result, BaseException):
                        pending.future.set_exception(result)
                    else:
                        pending.future.set_result(result)
