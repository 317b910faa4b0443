"""Log lines of long load-time work: a count done of a total, at most one line every PERIOD
seconds, then one when it ends. Capturing the CUDA graphs of every shape bucket takes about a
minute on a fresh H200 (two on a fresh machine with the kernels' caches cold), and a server or a
predictor that says nothing for that long looks hung."""

from __future__ import annotations

import logging
import time

PERIOD = 10.0  # seconds between two lines while the work goes on


class Progress:
    """Counts `total` items of `what` as they are done (`step`) and logs, at INFO on `log`, a line
    when it starts, at most one a `period` while it goes on, and one at its `end`."""

    def __init__(self, what: str, total: int, log: logging.Logger, period: float = PERIOD, clock=time.perf_counter):
        self.what, self.total, self.log, self.period, self.clock = what, total, log, period, clock
        self.done = 0
        self.start = self.last = clock()
        log.info("%s: %d to capture", what, total)

    def step(self, count: int = 1) -> None:
        """`count` more items done; a line when `period` has passed since the last one."""
        self.done += count
        now = self.clock()
        if now - self.last >= self.period and self.done < self.total:
            self.last = now
            self.log.info("%s: %d of %d after %.0f s", self.what, self.done, self.total, now - self.start)

    def end(self, ready: int) -> float:
        """Logs how many of the total are `ready` and the seconds taken; returns those seconds."""
        seconds = self.clock() - self.start
        self.log.info("%s: %d of %d ready in %.1f s", self.what, ready, self.total, seconds)
        return seconds
