"""Servers for the tests that drive one: an app on a loopback port in a background thread
(`Served`), and `dohnuts serve` in its own processes (`Server`)."""

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx2
import uvicorn


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Served:
    """A server in a background thread; `url` is its base URL."""

    def __init__(self, app):
        self.port = _free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"

    def close(self):
        self.server.should_exit = True
        self.thread.join(timeout=30)


STARTED = re.compile(r"started dohnuts-(engine|front)-(\d+) \(pid (\d+)\)")


class Server:
    """`python -m dohnuts.cli serve` in a subprocess; its log lines are collected as they come."""

    def __init__(self, checkpoint, workers: int = 2, options: tuple[str, ...] = ()):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "dohnuts.cli", "serve", str(checkpoint), "--port", str(self.port), "--workers",
             str(workers), "--model-name", "dohnuts-tiny", *options], stderr=subprocess.PIPE, text=True,
            env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.process.stderr:
            self.lines.append(line)

    def pids(self) -> dict[str, int]:
        """The latest pid of each child by name ("engine-0", "front-1")."""
        found = {}
        for line in list(self.lines):
            if match := STARTED.search(line):
                found[f"{match[1]}-{match[2]}"] = int(match[3])
        return found

    def wait_ready(self, seconds: float = 120.0) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            assert self.process.poll() is None, "".join(self.lines[-30:])
            try:
                if httpx2.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx2.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError("the server did not become ready:\n" + "".join(self.lines[-30:]))

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=60)
