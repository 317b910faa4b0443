"""The serving workload: `dohnuts serve` in processes of its own (front ends and an engine a
device), driven by the load harness's client processes (`load`) over the serving mix
(`traffic.serving_mix`): open loop at each offered rate, then closed loop at each client count.
The server and the clients run on separate CPUs when the machine has enough of them."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from .load import held, sweep
from .traffic import serving_mix


@dataclass(frozen=True)
class ServingPlan:
    """What the serving workload runs: `requests` distinct requests of the mix, open loop at each
    of `rates` (requests/s), closed loop at each count of `clients`, each level `seconds` long
    after `warmup_seconds` of the same load; `workers` front ends; `processes` client processes
    on the last `client_cpus` CPUs (0: no pinning), the server on the others."""

    requests: int = 512
    rates: tuple[float, ...] = ()
    clients: tuple[int, ...] = (1, 8)
    seconds: float = 30.0
    warmup_seconds: float = 5.0
    workers: int = 2
    processes: int = 2
    client_cpus: int = 0


def cpu_split(client_cpus: int) -> tuple[set[int] | None, set[int] | None]:
    """(the server's CPUs, the clients' CPUs): the last `client_cpus` of this process's CPUs for
    the clients, the rest for the server; (None, None) when that leaves the server fewer than two."""
    mine = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if client_cpus < 1 or len(mine) - client_cpus < 2:
        return None, None
    return set(mine[:-client_cpus]), set(mine[-client_cpus:])


class ServerProcess:
    """`python -m dohnuts.cli serve CHECKPOINT` on a free port, pinned to `cpus` when given; its
    log lines are kept (the last ones explain a failure)."""

    def __init__(self, checkpoint: Path, workers: int, cpus: set[int] | None = None):
        import socket

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
        self.process = subprocess.Popen(
            [sys.executable, "-m", "dohnuts.cli", "serve", str(checkpoint), "--port", str(self.port), "--workers",
             str(workers), "--model-name", "dohnuts-benchmark"], stderr=subprocess.PIPE, text=True,
            preexec_fn=pin)
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stderr:
            self.lines = self.lines[-200:] + [line]

    def wait_ready(self, seconds: float = 600.0) -> float:
        """Seconds until /health answered 200 (the engines loaded, captured and warmed up).

        Raises:
            RuntimeError: the server exited or was not ready in time; its last log lines say why.
        """
        started = time.monotonic()
        while time.monotonic() - started < seconds:
            if self.process.poll() is not None:
                break
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as response:
                    if response.status == 200:
                        return time.monotonic() - started
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.25)
        raise RuntimeError("the server did not become ready:\n" + "".join(self.lines[-30:]))

    def stop(self) -> int:
        self.process.terminate()
        try:
            return self.process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()


def serving_record(checkpoint: Path, plan: ServingPlan, seed: int = 0, progress=None, partial=None) -> dict:
    """The serving workload on the deployable `checkpoint` (see the module's docstring).
    `progress(level)` hears of each level as it ends; `partial(record)` gets the record so far
    once the server is ready and after each level (marked "complete": false), so a run cut
    short keeps what it measured."""
    server_cpus, client_cpus = cpu_split(plan.client_cpus)
    server = ServerProcess(checkpoint, plan.workers, server_cpus)
    setup = {"workload": "serving", "workers": plan.workers,
             "server_cpus": sorted(server_cpus) if server_cpus else None,
             "client_cpus": sorted(client_cpus) if client_cpus else None}
    levels = []

    def heard(level):
        levels.append(level)
        if progress is not None:
            progress(level)
        if partial is not None:
            partial({**setup, "levels": levels, "held": held(levels), "complete": False})

    try:
        setup["ready_seconds"] = server.wait_ready()
        if partial is not None:
            partial({**setup, "levels": [], "complete": False})
        record = sweep(server.url, serving_mix(plan.requests, seed), list(plan.rates), list(plan.clients),
                       plan.seconds, plan.warmup_seconds, plan.processes,
                       [client_cpus] if client_cpus else None, heard)
    finally:
        server.stop()
    return {**record, **setup, "complete": True}
