"""The load-time measurement (`bench.load_time`) on the CPU: the tests' tiny deployable loaded
twice, each in a process of its own, sharing a kernel cache folder."""

import pytest

from dohnuts.bench.load_time import STEPS, load_time_record


def test_each_load_runs_in_its_own_process_and_times_every_step(deployable, tmp_path):
    root, _ = deployable
    seen = []
    record = load_time_record(root / "checkpoint", "cpu", runs=2, cache=tmp_path / "triton",
                              settings=("graphs.WARM_UPS=1",), on_run=seen.append)
    assert record["workload"] == "load_time" and record["runs"] == seen and len(seen) == 2
    # The CPU compiles no Triton kernel: the cache folder stays empty, so both loads find it cold.
    assert [run["kernel_cache"] for run in record["runs"]] == ["cold", "cold"]
    for run in record["runs"]:
        assert run["settings"]["graphs.WARM_UPS"] == 1  # applied in the load's own process
        assert list(run["seconds"]) == list(STEPS) and list(run["triton_compiles"]) == list(STEPS)
        assert run["seconds"]["read"] > 0 and run["seconds"]["first request"] > 0
        assert run["total_seconds"] == pytest.approx(sum(run["seconds"].values()))
        assert run["process_seconds"] > run["total_seconds"]  # Python's start and the imports too
        assert run["buckets"] == run["failed_bucket_captures"] == sum(run["triton_compiles"].values()) == 0
        assert run["capture_failures"] == []


def test_a_loads_failed_captures_say_why(monkeypatch):
    """A load's record names each distinct error its bucket captures failed on, with the count of
    buckets it stopped, most frequent first."""
    from dohnuts.bench import load_time
    from dohnuts.ops import backends

    monkeypatch.setattr(backends, "_SLOW", {})
    for bucket, error in (("a", "CompilationError: `_` typed twice"), ("b", "CompilationError: `_` typed twice"),
                          ("c", "OutOfMemoryError: no room")):
        backends.slow_path(f"bucket-capture-{bucket}", f"the CUDA graphs of {bucket} failed to capture, so its "
                                                       f"batches run eagerly: {error}")
    backends.slow_path("bucket-memory", "the bucket graphs reached 40% of the device's memory")
    assert load_time.capture_failures() == [{"error": "CompilationError: `_` typed twice", "buckets": 2},
                                            {"error": "OutOfMemoryError: no room", "buckets": 1}]
    line = load_time._line({"kernel_cache": "cold", "total_seconds": 1.0, "process_seconds": 2.0,
                            "seconds": {"read": 1.0}, "triton_compiles": {"read": 0}, "buckets": 1,
                            "failed_bucket_captures": 3, "reserved_gib": 0.5,
                            "capture_failures": load_time.capture_failures()})
    assert "2 failed on: CompilationError: `_` typed twice" in line and "1 failed on: OutOfMemoryError" in line


def test_a_load_finding_kernels_in_the_cache_is_warm(deployable, tmp_path):
    root, _ = deployable
    (tmp_path / "triton" / "a-kernel").mkdir(parents=True)
    record = load_time_record(root / "checkpoint", "cpu", runs=1, cache=tmp_path / "triton")
    assert record["runs"][0]["kernel_cache"] == "warm"


def test_a_load_that_fails_is_reported_with_its_error(tmp_path):
    with pytest.raises(RuntimeError, match=r"(?s)load 1 of 1 failed \(exit code 1\).*no-such-checkpoint"):
        load_time_record(tmp_path / "no-such-checkpoint", "cpu", runs=1)
