"""A front end's way to the engines: `submit(encoded request)` awaits its logits.

`LocalEngine` runs an `EngineLoop` in the server's own process (one process, or the tests);
`RemoteEngines` speaks to engine processes over ZMQ (`runtime.messages`), one DEALER socket an
engine, choosing an engine by the request's image (so its cached features are found) or by the
fewest requests in flight. An engine that is not ready (starting, or dead and being restarted)
is not sent to; a request whose engine goes down, or that waits past its deadline, fails with
`Unavailable`, never hangs.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
import zlib

import numpy as np

from ..runtime.engine import Closed, EncodedRequest, EngineLoop, Expired, Overloaded
from ..runtime.engine_process import GENERATION, READY, REFUSING, SLOTS, STATE
from ..runtime.metrics import Counting

__all__ = ["Closed", "EngineFailed", "Expired", "LocalEngine", "Overloaded", "RemoteEngines", "Unavailable"]


class Unavailable(RuntimeError):
    """No engine can answer now (starting, restarting after a crash, or too slow): retry later."""


class EngineFailed(RuntimeError):
    """The engine's invocation of the request failed: the server's fault, not the client's."""


class LocalEngine:
    """An `EngineLoop` over a `Predictor`'s engine in this process."""

    def __init__(self, predictor, max_queue: int = 4096, on_invocation=None):
        self.loop = EngineLoop(predictor.engine, predictor.lock, max_queue=max_queue,
                               on_invocation=Counting(predictor.engine, on_invocation))
        self.cancelled = 0  # requests dropped from the queue because their callers went away

    @property
    def ready(self) -> bool:
        return not self.loop.closed

    @property
    def depth(self) -> int:
        return self.loop.depth

    @property
    def refusing(self) -> bool:
        """Whether the loop refuses new requests now (`EngineLoop.refusing`)."""
        return self.loop.refusing

    async def submit(self, request: EncodedRequest) -> np.ndarray:
        """The request's logits [rows, candidates].

        Raises:
            Overloaded, Closed: from the loop; the invocation's own error when it failed.
        """
        running = asyncio.get_running_loop()
        future = running.create_future()

        def reply(result) -> None:  # on the engine's thread
            running.call_soon_threadsafe(_settle, future, result)

        place = self.loop.submit(request, reply)
        try:
            return await _within(future, request.deadline)
        except asyncio.CancelledError:  # the caller went away: its request is not run if it still waits
            if self.loop.cancel(place):
                self.cancelled += 1
            raise
        except (Overloaded, Closed, Expired):
            raise
        except Exception as error:  # noqa: BLE001 - whatever failed in the invocation is the server's
            raise EngineFailed(f"{type(error).__name__}: {error}") from error

    def close(self) -> None:
        self.loop.close()


async def _within(future: asyncio.Future, deadline: float | None, longest: float | None = None):
    """The future's result, waiting until `deadline` (monotonic seconds) and at most `longest`
    seconds; past the request's own deadline, `Expired`.

    Raises:
        Expired: the deadline passed first; TimeoutError: `longest` passed first.
    """
    wait = longest
    if deadline is not None:
        left = deadline - time.monotonic()
        if left <= 0:
            future.cancel()
            raise Expired("the request's deadline passed")
        wait = left if wait is None else min(wait, left)
    try:
        return await asyncio.wait_for(future, wait)
    except TimeoutError:
        if deadline is not None and time.monotonic() >= deadline:
            raise Expired("the request's deadline passed before its answer came") from None
        raise


def _settle(future: asyncio.Future, result) -> None:
    if future.done():  # its caller went away
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)


class RemoteEngines:
    """Engine processes at `addresses`, their states in the supervisor's shared array `states`
    (`engine_process.SLOTS` an engine: state, generation, refusing)."""

    def __init__(self, addresses: list[str], states, deadline: float = 120.0):
        import zmq
        import zmq.asyncio

        self.context = zmq.asyncio.Context()
        self.sockets = []
        for address in addresses:
            socket = self.context.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.IMMEDIATE, 1)  # queue only to an engine that is connected
            # Unbounded: a front end holds at most MAX_IN_FLIGHT (1,024) requests, over ZMQ's default
            # of 1,000 queued messages, past which a send would fail as if no engine were there.
            socket.setsockopt(zmq.SNDHWM, 0)
            socket.connect(address)
            self.sockets.append(socket)
        self.states, self.deadline = states, deadline
        self.ids = itertools.count()
        self.waiting: list[dict[int, asyncio.Future]] = [{} for _ in addresses]
        self.generations = [None] * len(addresses)
        self.readers: list[asyncio.Task] = []

    def _state(self, index: int) -> tuple[int, int]:
        return self.states[SLOTS * index + STATE], self.states[SLOTS * index + GENERATION]

    def _refusing(self, index: int) -> bool:
        return bool(self.states[SLOTS * index + REFUSING])

    def _ready(self) -> list[int]:
        """The indices of the engines ready now."""
        return [index for index in range(len(self.sockets)) if self._state(index)[0] == READY]

    @property
    def refusing(self) -> bool:
        """Whether every ready engine refuses new requests now (its queue-delay admission)."""
        ready = self._ready()
        return bool(ready) and all(self._refusing(index) for index in ready)

    @property
    def ready(self) -> bool:
        return bool(self._ready())

    @property
    def depth(self) -> int:
        return sum(len(waiting) for waiting in self.waiting)

    def _start(self) -> None:
        if not self.readers:
            self.readers = [asyncio.get_running_loop().create_task(self._read(index))
                            for index in range(len(self.sockets))]
            self.readers.append(asyncio.get_running_loop().create_task(self._watch()))

    async def _read(self, index: int) -> None:
        from ..runtime.messages import unpack_reply

        socket, waiting = self.sockets[index], self.waiting[index]
        while True:
            request_id, result = unpack_reply(await socket.recv())
            future = waiting.pop(request_id, None)
            if future is None or future.done():
                continue  # answered after its caller gave up, or by an engine since restarted
            if isinstance(result, tuple):
                kind, message = result
                error = {"overloaded": Overloaded, "closed": Unavailable, "expired": Expired}.get(kind, EngineFailed)
                future.set_exception(error(message))
            else:
                future.set_result(result)

    async def _watch(self) -> None:
        while True:
            for index in range(len(self.sockets)):
                self._sync(index)
            await asyncio.sleep(0.05)

    def _sync(self, index: int) -> None:
        """Fail the requests sent to engine `index` if it went down or restarted since."""
        state, generation = self._state(index)
        current = generation if state == READY else None
        if current == self.generations[index]:
            return
        self.generations[index] = current
        lost = list(self.waiting[index].values())
        self.waiting[index].clear()
        for future in lost:
            if not future.done():
                future.set_exception(Unavailable("the engine restarted: retry"))

    def _choose(self, request: EncodedRequest) -> int:
        ready = self._ready()
        if not ready:
            raise Unavailable("no engine is ready yet")
        if request.images:  # the same first image, the same engine: its features are cached there
            return ready[zlib.crc32(request.images[0].key.encode()) % len(ready)]
        return min(ready, key=lambda index: (self._refusing(index), len(self.waiting[index])))

    async def submit(self, request: EncodedRequest) -> np.ndarray:
        """The request's logits [rows, candidates].

        Raises:
            Unavailable: no engine ready, or its engine went down or passed the deadline.
            Overloaded: the engine's queue is full.
        """
        import zmq

        from ..runtime.messages import pack_cancel, pack_request

        self._start()
        index = self._choose(request)
        self._sync(index)
        request_id = next(self.ids)
        future = asyncio.get_running_loop().create_future()
        self.waiting[index][request_id] = future
        try:
            # Never waits: with no engine connected (one that just died) the request fails now.
            await self.sockets[index].send(pack_request(request_id, request), flags=zmq.NOBLOCK)
        except zmq.Again as error:
            self.waiting[index].pop(request_id, None)
            raise Unavailable("the engine is not connected: retry") from error
        try:
            return await _within(future, request.deadline, self.deadline)
        except TimeoutError as error:
            raise Unavailable(f"no answer from the engine in {self.deadline:.0f} s") from error
        except asyncio.CancelledError:  # the caller went away: the engine drops it if it still waits
            with contextlib.suppress(zmq.ZMQError):
                sent = self.sockets[index].send_multipart(pack_cancel(request_id), flags=zmq.NOBLOCK)
                sent.add_done_callback(lambda done: done.cancelled() or done.exception())  # seen, never raised
            raise
        finally:
            self.waiting[index].pop(request_id, None)

    def close(self) -> None:
        for task in self.readers:
            task.cancel()
        for socket in self.sockets:
            socket.close()
        self.context.term()
