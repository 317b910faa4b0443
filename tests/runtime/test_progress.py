"""Load-time progress lines (`runtime.progress`), timed by a clock the test moves."""

import logging

from dohnuts.runtime.progress import Progress


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_a_line_at_start_at_most_one_a_period_and_one_at_the_end(caplog):
    clock, log = Clock(), logging.getLogger("progress-test")
    with caplog.at_level(logging.INFO, logger="progress-test"):
        progress = Progress("graphs", 5, log, period=10.0, clock=clock)
        clock.now += 4
        progress.step()  # 4 s: within the period, no line
        clock.now += 7
        progress.step()  # 11 s: a line
        clock.now += 3
        progress.step()  # 3 s after the last line: none
        clock.now += 20
        progress.step(2)  # all five done: the end's line says so, not this one
        seconds = progress.end(4)
    assert [record.getMessage() for record in caplog.records] == [
        "graphs: 5 to capture", "graphs: 2 of 5 after 11 s", "graphs: 4 of 5 ready in 34.0 s"]
    assert seconds == 34.0
