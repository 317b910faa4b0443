"""`dohnuts serve`: front-end processes and one engine process a device, kept running.

The supervisor listens on the port itself and hands the socket to every front end, so the
port stays open while a front end restarts. Engines listen on ZMQ sockets in a private folder;
their states (starting, ready, down), generations and whether they refuse new requests (their
queue-delay admission) sit in a shared array the front ends read for every request: a request an
engine would refuse is answered 429 before its body is read. A process that dies is started
again after a pause that doubles with each death in a row (0.5 s to 30 s); while an engine is
down its requests are answered 503 with Retry-After. SIGTERM or SIGINT stops the front ends
first (they finish what they hold), then the engines; a child whose supervisor is gone (killed)
exits by itself. Each process writes its Prometheus metrics in the private folder, and a front
end's /metrics adds them up.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..runtime.engine import MAX_WAIT
from ..runtime.engine_process import DOWN, GENERATION, REFUSING, SLOTS, STARTING, STATE, EngineSettings

LOG = logging.getLogger(__name__)
RESTART_PAUSES = (0.5, 30.0)  # the first pause after a death, and the longest
FRONT_EXIT = 5.0  # seconds a front end may take to exit once its drain is over
DRAIN_MARGIN = 1.0  # seconds uvicorn waits past the drain: what is left has been answered 503 by then
ENGINE_GRACE = 30.0  # seconds an engine may take to stop once its front ends are gone


@dataclass(frozen=True)
class ServeSettings:
    """What `dohnuts serve` runs: the deployable `checkpoint` on `devices` (one engine each),
    `workers` front ends listening on host:port, answering as `model_name`."""

    checkpoint: str
    model_name: str
    host: str = "127.0.0.1"
    port: int = 8000
    workers: int = 1
    devices: tuple[str, ...] = ("cpu",)
    api_key: str | None = None
    release_date: str | None = None
    deadline: float = 120.0  # seconds a front end waits for an engine's answer
    max_wait: float | None = MAX_WAIT  # seconds an engine's oldest request may wait before new ones get 429
    drain: float = 30.0  # seconds SIGTERM gives the front ends to answer what they hold


def _orphan_guard() -> None:
    """In a child: leave the terminal's process group (Ctrl-C reaches the supervisor alone, which
    stops the children in order), and exit when the supervisor is gone, killed or not."""
    os.setpgrp()
    parent = multiprocessing.parent_process()

    def watch():
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="dohnuts-orphan-guard", daemon=True).start()


# Seconds a front end keeps an idle connection open: longer than clients and load balancers keep
# theirs (aiohttp 15 s, common balancers 60 s), so the client closes first. With uvicorn's 5 s,
# a client reusing a connection the server was closing got no answer (ServerDisconnectedError:
# 6 requests of an open-loop run on the H200, counted as lost).
KEEP_ALIVE = 75


def draining_server(app, drain: float, **config):
    """A uvicorn server of a `front_app` whose first SIGTERM or SIGINT also starts the app's
    drain: the requests still in flight `drain` seconds later are answered 503 with Retry-After
    (uvicorn alone would cancel them at its graceful timeout and answer 500)."""
    import uvicorn

    class Draining(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            drain_after = getattr(app.state, "drain_after", None)  # None before the app has started
            if drain_after is not None and not self.should_exit:
                drain_after(drain)
            super().handle_exit(sig, frame)

    return Draining(uvicorn.Config(app, timeout_graceful_shutdown=drain + DRAIN_MARGIN, **config))


def front_main(settings: ServeSettings, listening: socket.socket, addresses: list[str], states) -> None:
    """A front-end process: the template, uvicorn on the supervisor's socket, the remote engines."""
    _orphan_guard()

    from ..runtime.checkpoint import load_front
    from ..runtime.engine import settle_heap
    from .app import Front, front_app
    from .engines import RemoteEngines

    template, model_config, calibrator = load_front(Path(settings.checkpoint))
    front = Front(template, model_config, calibrator, None)
    settle_heap()  # a full collection would stop the event loop: what loading made is never looked at again

    def start():
        front.engines = RemoteEngines(addresses, states, settings.deadline)
        return front.engines

    app = front_app(front, settings.model_name, settings.api_key, settings.release_date, start=start)
    server = draining_server(app, settings.drain, log_level="warning", timeout_keep_alive=KEEP_ALIVE)
    server.run(sockets=[listening])


def engine_main(settings: EngineSettings, states) -> None:
    """An engine process (`runtime.engine_process.serve_engine`)."""
    from ..runtime.engine_process import serve_engine

    _orphan_guard()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine %(process)d %(levelname)s %(message)s")
    serve_engine(settings, states)


@dataclass
class Child:
    """One supervised process: how to start it, the running one, and its deaths in a row."""

    name: str
    target: object
    args: tuple
    on_start: object = None  # called before each start (an engine's state goes to STARTING)
    process: multiprocessing.Process | None = None
    deaths: int = 0
    due: float = 0.0  # when a dead one may start again
    started: float = field(default_factory=time.monotonic)

    def start(self, context) -> None:
        if self.on_start is not None:
            self.on_start()
        self.process = context.Process(target=self.target, args=self.args, name=self.name, daemon=False)
        self.process.start()
        self.started = time.monotonic()
        LOG.info("started %s (pid %d)", self.name, self.process.pid)


class Supervisor:
    """Starts and keeps the processes of `settings` (see the module's docstring)."""

    def __init__(self, settings: ServeSettings):
        self.settings = settings
        self.listening = socket.create_server((settings.host, settings.port), backlog=4096)  # first: it may fail
        self.port = self.listening.getsockname()[1]
        self.folder = Path(tempfile.mkdtemp(prefix="dohnuts-serve-"))
        metrics = self.folder / "metrics"
        metrics.mkdir()
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(metrics)  # every child inherits it
        self.context = multiprocessing.get_context("spawn")
        self.states = self.context.Array("q", SLOTS * len(settings.devices), lock=False)
        addresses = [f"ipc://{self.folder}/engine-{index}" for index in range(len(settings.devices))]
        self.engines = [Child(f"dohnuts-engine-{index}", engine_main,
                              (EngineSettings(settings.checkpoint, device, address, index,
                                                              max_wait=settings.max_wait), self.states),
                              on_start=lambda index=index: self._starting(index))
                        for index, (device, address) in enumerate(zip(settings.devices, addresses))]
        self.fronts = [Child(f"dohnuts-front-{index}", front_main, (settings, self.listening, addresses, self.states))
                       for index in range(settings.workers)]
        self.stopping = False

    def _starting(self, index: int) -> None:
        self.states[SLOTS * index + STATE] = STARTING
        self.states[SLOTS * index + GENERATION] += 1  # a new generation: requests sent to the last one fail at once
        self.states[SLOTS * index + REFUSING] = 0

    @property
    def children(self) -> list[Child]:
        return self.engines + self.fronts

    def start(self) -> None:
        for child in self.children:
            child.start(self.context)

    def watch(self, timeout: float = 0.2) -> None:
        """Restart what died; wait at most `timeout` seconds for a death."""
        alive = [child.process.sentinel for child in self.children if child.process is not None]
        multiprocessing.connection.wait(alive, timeout=timeout)
        now = time.monotonic()
        for index, child in enumerate(self.children):
            process = child.process
            if process is not None and not process.is_alive():
                if index < len(self.engines):
                    self.states[SLOTS * index + STATE] = DOWN
                calm = now - child.started > 60  # a long life resets the count of deaths in a row
                child.deaths = 1 if calm else child.deaths + 1
                pause = min(RESTART_PAUSES[1], RESTART_PAUSES[0] * 2 ** (child.deaths - 1))
                LOG.warning("%s (pid %d) died with exit code %s; starting it again in %.1f s", child.name,
                            process.pid, process.exitcode, pause)
                if "PROMETHEUS_MULTIPROC_DIR" in os.environ:
                    from prometheus_client import multiprocess

                    multiprocess.mark_process_dead(process.pid)
                child.process, child.due = None, now + pause
            if child.process is None and not self.stopping and now >= child.due:
                child.start(self.context)

    def stop(self) -> None:
        """Front ends first (they answer what they hold for up to the settings' `drain` seconds),
        then engines; a front end still running a few seconds past its drain, or an engine
        ENGINE_GRACE seconds after the front ends, is killed. The private folder goes."""
        self.stopping = True
        for group, grace in ((self.fronts, self.settings.drain + FRONT_EXIT), (self.engines, ENGINE_GRACE)):
            for child in group:
                if child.process is not None and child.process.is_alive():
                    child.process.terminate()
            deadline = time.monotonic() + grace
            for child in group:
                if child.process is not None:
                    child.process.join(max(0.0, deadline - time.monotonic()))
                    if child.process.is_alive():
                        child.process.kill()
                        child.process.join()
        self.listening.close()
        shutil.rmtree(self.folder, ignore_errors=True)

    def run(self) -> None:
        """Start, watch until SIGTERM or SIGINT, stop."""
        received = []
        for name in (signal.SIGTERM, signal.SIGINT):
            signal.signal(name, lambda number, frame: received.append(number))
        try:
            self.start()
            LOG.info("serving %s on http://%s:%d: %d front ends, engines on %s", self.settings.checkpoint,
                     self.settings.host, self.port, self.settings.workers, ", ".join(self.settings.devices))
            while not received:
                self.watch()
        finally:
            self.stop()
