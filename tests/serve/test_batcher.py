"""The batcher's worker: gathering only while traffic is concurrent, deferred work only when no
request waits (and never fatal), and no request lost behind its stop."""

import threading
import time

import pytest

from dohnuts.serve.batcher import Batcher, Closed


class _Echo:
    """Answers each request with its state."""

    def predict_many(self, requests, errors="return"):
        return [state for state, _ in requests]


class _Predictor(_Echo):
    """`_Echo` whose `idle` returns the listed results in turn (False once they run out), each
    call logged with how many requests were waiting."""

    def __init__(self, idle_results=(), fail=False):
        self.idle_results = list(idle_results)
        self.fail = fail
        self.deferred = False
        self.idle_calls = []
        self.batches = []
        self.batcher = None
        self.called = threading.Event()

    def capture_when_idle(self, on=True):
        self.deferred = on

    def idle(self):
        self.idle_calls.append(self.batcher.depth if self.batcher else None)
        self.called.set()
        if self.fail:
            raise RuntimeError("capture failed")
        return self.idle_results.pop(0) if self.idle_results else False

    def predict_many(self, requests, errors="return"):
        self.batches.append(len(requests))
        return super().predict_many(requests)


def _settle(predictor, seconds=0.5):
    """Wait until the worker has stopped calling `idle` (no call for `seconds`)."""
    count = -1
    while count != len(predictor.idle_calls):
        count = len(predictor.idle_calls)
        time.sleep(seconds)


def test_deferred_work_runs_only_after_a_quiet_spell_and_stops_when_done():
    predictor = _Predictor(idle_results=[True, True])
    batcher = Batcher(predictor, max_wait=0.0, idle_after=0.05)
    predictor.batcher = batcher
    try:
        assert predictor.deferred  # the batcher asked for deferred captures
        time.sleep(0.2)
        assert predictor.idle_calls == []  # no request yet: nothing could be pending
        assert batcher.submit("a", {"q": {}}).result(timeout=5) == "a"
        _settle(predictor)
        # Two pieces of work, then the False that says none is left; none while a request waited.
        assert predictor.idle_calls == [0, 0, 0]
        assert batcher.submit("b", {"q": {}}).result(timeout=5) == "b"
        _settle(predictor)
        assert len(predictor.idle_calls) == 4  # each batch may leave work: asked once more
    finally:
        batcher.close()
    assert predictor.batches == [1, 1]
    assert not predictor.deferred  # closed, the batcher no longer runs the work it deferred


def test_requests_during_steady_traffic_are_not_held_by_deferred_work():
    predictor = _Predictor(idle_results=[True] * 100)
    batcher = Batcher(predictor, max_wait=0.0, idle_after=0.5)
    predictor.batcher = batcher
    try:
        for index in range(20):  # a request every 10 ms: never a 500 ms quiet spell
            assert batcher.submit(index, {"q": {}}).result(timeout=5) == index
            time.sleep(0.01)
        assert predictor.idle_calls == []
        assert predictor.called.wait(timeout=5)  # once traffic stops, the work starts
    finally:
        batcher.close()


def test_failing_deferred_work_is_logged_and_the_batcher_keeps_serving(caplog):
    predictor = _Predictor(fail=True)
    batcher = Batcher(predictor, max_wait=0.0, idle_after=0.02)
    predictor.batcher = batcher
    try:
        assert batcher.submit("a", {"q": {}}).result(timeout=5) == "a"
        _settle(predictor, 0.2)
        assert len(predictor.idle_calls) == 1  # a failure ends the work until the next batch
        assert batcher.submit("b", {"q": {}}).result(timeout=5) == "b"
    finally:
        batcher.close()
    assert "idle work failed" in caplog.text


def test_a_predictor_without_deferred_work_is_served_as_before():
    batcher = Batcher(_Echo(), max_wait=0.0, idle_after=0.01)
    try:
        assert batcher.idle is None
        assert batcher.submit("a", {"q": {}}).result(timeout=5) == "a"
    finally:
        batcher.close()


def test_a_lone_request_runs_at_once_and_concurrent_ones_are_gathered():
    class Held(_Echo):
        """Holds the call that answers "b" until the test releases it."""

        def __init__(self):
            self.batches = []
            self.started, self.release = threading.Event(), threading.Event()

        def predict_many(self, requests, errors="return"):
            self.batches.append([state for state, _ in requests])
            if self.batches[-1] == ["b"]:
                self.started.set()
                assert self.release.wait(timeout=10)
            return super().predict_many(requests)

    predictor = Held()
    batcher = Batcher(predictor, max_wait=1.0, idle_after=0.3)
    try:
        # Alone, "a" does not wait the gathering second for company: well within half of it.
        assert batcher.submit("a", {"q": {}}).result(timeout=0.5) == "a"
        b = batcher.submit("b", {"q": {}})
        assert predictor.started.wait(timeout=5)
        c, d = batcher.submit("c", {"q": {}}), batcher.submit("d", {"q": {}})  # they wait while b runs
        predictor.release.set()
        assert b.result(timeout=5) == "b"
        # Traffic is concurrent: c and d's batch waits for e, which comes within the second.
        time.sleep(0.05)
        e = batcher.submit("e", {"q": {}})
        assert [future.result(timeout=5) for future in (c, d, e)] == ["c", "d", "e"]
        # After a quiet spell longer than idle_after, a lone request runs at once again.
        time.sleep(0.5)
        assert batcher.submit("f", {"q": {}}).result(timeout=0.5) == "f"
    finally:
        batcher.close()
    assert predictor.batches == [["a"], ["b"], ["c", "d", "e"], ["f"]]


def test_a_closed_batcher_refuses_new_requests_instead_of_losing_them():
    batcher = Batcher(_Echo())
    queued = batcher.submit("a", {"q": {}})
    batcher.close()
    assert queued.result(timeout=5) == "a"  # queued before the stop: answered
    with pytest.raises(Closed, match="closed"):
        batcher.submit("b", {"q": {}})
    batcher.close()  # a second close returns at once
