"""A server's engine process: one device's model behind a ZMQ socket.

It loads the deployable folder's network (no tokenizer), captures its CUDA graphs, warms up,
says it is ready, then answers encoded requests from any front end (`messages`) through an
`EngineLoop`: requests from every front end join the same invocations, and an image sent by
several front ends is encoded once (the feature cache is here). It parses no HTTP or JSON and
decodes and tokenises nothing; transformers' model classes import Pillow and tokenizers of
their own accord, never called here.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import signal
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..inputs.batch import Row
from .checkpoint import load_engine
from .engine import MAX_WAIT, Closed, EncodedRequest, Engine, EngineLoop, Expired, Overloaded, settle_heap
from .messages import pack_error, pack_logits, unpack_cancel, unpack_request
from .metrics import Counting, metrics

LOG = logging.getLogger(__name__)
STARTING, READY, DOWN = 0, 1, 2  # an engine's state, as the supervisor and the front ends read it
# An engine's slots in the supervisor's shared array (SLOTS an engine): its state, its generation
# (a restart adds one) and whether it refuses new requests now (`EngineLoop.refusing`), so that
# front ends refuse them before reading a body.
STATE, GENERATION, REFUSING = 0, 1, 2
SLOTS = 3


@dataclass(frozen=True)
class EngineSettings:
    """Where an engine reads its model and listens: the deployable `checkpoint`, the `device`
    ("cuda:0", "cpu"), its ZMQ `address` ("ipc:///tmp/...") and its slot in the shared states."""

    checkpoint: str
    device: str
    address: str
    index: int = 0
    max_queue: int = 4096
    max_wait: float | None = MAX_WAIT  # seconds the oldest request may wait before new ones get 429


def _loaded(settings: EngineSettings, device: torch.device):
    """(the engine of the checkpoint on `device`, prepared and warmed up, its pixel settings).

    On the CPU this runs in a thread of its own that ends before the loop's starts, so the loop
    thread's is the process's only OpenMP team: with a second one alive (the main thread's, made
    by the load), each parallel region in the loop ran as slowly as with libgomp's spinning off
    (GOMP_SPINCOUNT=0), and the tiny checkpoint's forward took 31 ms in the served loop against
    16 ms on a main thread (this project's two cores). The main thread does no parallel work
    after this. An error raised loading is raised here."""
    def load():
        model, _, pixels = load_engine(Path(settings.checkpoint), device)
        text = model.backbone.config.text_config
        pad_id = text.pad_token_id if text.pad_token_id is not None else text.eos_token_id
        engine = Engine(model, pad_id=pad_id, image_pad_id=model.backbone.config.image_token_id)
        engine.prepare(pixels)
        warm_up(engine)
        return engine, pixels

    if device.type != "cpu":
        return load()
    outcome: dict = {}

    def load_apart():
        try:
            outcome["loaded"] = load()
        except BaseException as error:  # noqa: BLE001 - raised again in the calling thread
            outcome["error"] = error

    loader = threading.Thread(target=load_apart, name="dohnuts-engine-load")
    loader.start()
    loader.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["loaded"]


def warm_up(engine: Engine) -> None:
    """One small request through the engine, so kernels load and tune before the first user's."""
    row = Row(tuple(range(1, 17)), (15,), None)
    engine.run([EncodedRequest([row])])


def serve_engine(settings: EngineSettings, states=None, stop: threading.Event | None = None) -> None:
    """Load, warm up and serve until `stop` is set (or SIGTERM). `states` (a shared array of
    SLOTS an engine) gets READY once this engine answers, and its REFUSING slot follows
    `EngineLoop.refusing` after every message and reply."""
    import zmq

    device = torch.device(settings.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    LOG.info("engine %d loading %s on %s", settings.index, settings.checkpoint, device)
    engine, pixels = _loaded(settings, device)
    settle_heap()
    replies: queue.SimpleQueue = queue.SimpleQueue()
    context = zmq.Context.instance()
    wake_address = f"inproc://replies-{os.getpid()}"
    wake_in = context.socket(zmq.PULL)
    wake_in.bind(wake_address)
    local = threading.local()

    # (front end, id) -> the request's place in the loop's queue until it is answered, for a cancel;
    # an answer that comes before its place is kept leaves its key in `early` instead.
    queued: dict[tuple[bytes, int], object] = {}
    early: set[tuple[bytes, int]] = set()
    places = threading.Lock()

    def answer(identity: bytes, request_id: int):
        def reply(result) -> None:
            with places:
                if queued.pop((identity, request_id), None) is None:
                    early.add((identity, request_id))
            if isinstance(result, Expired):
                message = pack_error(request_id, "expired", str(result))
            elif isinstance(result, Closed):  # the loop stopped (a device error): a 503, retried elsewhere
                message = pack_error(request_id, "closed", str(result))
            elif isinstance(result, BaseException):
                message = pack_error(request_id, "failed", f"{type(result).__name__}: {result}")
            else:
                message = pack_logits(request_id, np.asarray(result))
            replies.put((identity, message))
            if not hasattr(local, "wake"):  # the loop's thread: its own socket
                local.wake = context.socket(zmq.PUSH)
                local.wake.connect(wake_address)
            with contextlib.suppress(zmq.Again):  # a full pipe of wakes already wakes the reader
                local.wake.send(b"", zmq.NOBLOCK)
        return reply

    loop = EngineLoop(engine, max_queue=settings.max_queue, on_invocation=Counting(engine),
                      max_wait=settings.max_wait)
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 2000)  # the last replies still go out on close
    # Unbounded: past its high-water mark a ROUTER drops replies unsaid; a front end has at most
    # MAX_IN_FLIGHT (1,024) requests here, over ZMQ's default of 1,000 messages.
    router.setsockopt(zmq.SNDHWM, 0)
    router.setsockopt(zmq.RCVHWM, 0)
    router.bind(settings.address)
    stop = stop or threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    slots = SLOTS * settings.index
    if states is not None:
        states[slots + STATE] = READY
    LOG.info("engine %d ready on %s (%s); new requests refused while one has waited over %s s", settings.index,
             settings.address, device, settings.max_wait)
    counted = metrics()
    poller = zmq.Poller()
    poller.register(router, zmq.POLLIN)
    poller.register(wake_in, zmq.POLLIN)
    try:
        while not stop.is_set():
            if loop.fatal is not None or not loop.thread.is_alive():
                raise SystemExit(f"the engine loop stopped ({loop.fatal!r}): exiting so that it is started again")
            ready = dict(poller.poll(100))
            if router in ready:
                while True:
                    try:
                        identity, *frames = router.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    try:
                        cancelled = unpack_cancel(frames)
                        if cancelled is not None:  # its caller went away: dropped if it still waits
                            with places:
                                place = queued.get((identity, cancelled))
                            if place is not None and loop.cancel(place):  # else its answer comes and is dropped
                                with places:
                                    queued.pop((identity, cancelled), None)
                                counted.cancelled.inc()
                            continue
                        request_id, request = unpack_request(frames[0], pixels)
                    except Exception as error:  # noqa: BLE001 - dropped (its sender times out), never fatal
                        LOG.warning("an unreadable request message: %s: %s", type(error).__name__, error)
                        continue
                    try:
                        place = loop.submit(request, answer(identity, request_id))
                        with places:
                            if (identity, request_id) in early:
                                early.discard((identity, request_id))
                            else:
                                queued[(identity, request_id)] = place
                    except Overloaded as error:
                        router.send_multipart([identity, pack_error(request_id, "overloaded", str(error))])
                    except Closed as error:
                        router.send_multipart([identity, pack_error(request_id, "closed", str(error))])
            counted.queue.set(loop.depth)
            if states is not None:
                states[slots + REFUSING] = int(loop.refusing)
            if wake_in in ready:
                while True:
                    try:
                        wake_in.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
            while True:
                try:
                    identity, message = replies.get_nowait()
                except queue.Empty:
                    break
                router.send_multipart([identity, message])
    finally:
        loop.close()
        while not replies.empty():
            router.send_multipart(list(replies.get_nowait()))
        router.close()
        wake_in.close()
        if states is not None:
            states[slots + STATE], states[slots + REFUSING] = DOWN, 0
