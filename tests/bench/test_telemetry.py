"""Ceilings measured on the device and telemetry sampled during timed calls."""

import json
import math
import sys
import time
import types

import pytest
import torch

from dohnuts.bench.telemetry import Telemetry, measure_ceilings


def test_cpu_ceilings_are_measured_and_labelled():
    measured = measure_ceilings("cpu", matrix_size=64, copy_bytes=2**20, repeats=2)
    assert measured["method"].startswith("CPU-measured") and measured["device"] == "CPU"
    assert measured["transfer_bytes_per_s"] is None
    assert measured["vector_flops_per_s"] == measured["matrix_flops_per_s"]
    assert all(math.isfinite(measured[key]) and measured[key] > 0
               for key in ("matrix_flops_per_s", "bandwidth_bytes_per_s"))


def test_telemetry_on_the_cpu_reports_absent_counters_and_the_process_rss():
    telemetry = Telemetry("cpu")
    with pytest.raises(RuntimeError, match="closed window"):
        telemetry.summary()
    with telemetry:
        pass
    summary = telemetry.summary()
    assert summary["counters"] == {name: {"absent": "device cpu is not a CUDA device"} for name in
                                   ("power_w", "utilization_percent", "memory_used_mib", "temperature_c",
                                    "sm_clock_mhz")}
    assert summary["process"]["max_rss_mib"] > 0
    assert summary["cuda_memory"] == {"absent": "device cpu is not a CUDA device"}
    assert json.loads(json.dumps(summary)) == summary


@pytest.fixture
def pretend_cuda(monkeypatch):
    """torch.cuda answers as if one GPU of UUID "abc" were present, with fixed peak memory."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: 3 * 2**20)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device: 4 * 2**20)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: types.SimpleNamespace(uuid="abc"))


def test_telemetry_without_pynvml_on_cuda_says_so(pretend_cuda, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` fail
    with Telemetry("cuda:0") as telemetry:
        pass
    summary = telemetry.summary()
    assert summary["counters"]["power_w"] == {"absent": "pynvml (package nvidia-ml-py) is not installed"}
    assert summary["cuda_memory"] == {"peak_allocated_mib": 3.0, "peak_reserved_mib": 4.0}


@pytest.fixture
def fake_nvml(pretend_cuda, monkeypatch):
    """A pynvml whose GPU reports 250 W, utilisation cycling 0, 20, 40 (the list of values it
    gave), 512 MiB used, 1980 MHz, and no temperature sensor."""
    utilisation = []

    class NVMLError(Exception):
        pass

    def utilization_rates(handle):
        assert handle == "handle of GPU-abc"
        utilisation.append(float(len(utilisation) % 3 * 20))
        return types.SimpleNamespace(gpu=utilisation[-1])

    def temperature(handle, sensor):
        raise NVMLError("Not Supported")

    fake = types.SimpleNamespace(
        NVMLError=NVMLError, NVML_TEMPERATURE_GPU=0, NVML_CLOCK_SM=1, nvmlInit=lambda: None,
        nvmlShutdown=lambda: None, nvmlDeviceGetHandleByUUID=lambda uuid: f"handle of {uuid}",
        nvmlDeviceGetPowerUsage=lambda handle: 250_000, nvmlDeviceGetUtilizationRates=utilization_rates,
        nvmlDeviceGetMemoryInfo=lambda handle: types.SimpleNamespace(used=512 * 2**20),
        nvmlDeviceGetTemperature=temperature, nvmlDeviceGetClockInfo=lambda handle, clock: 1980)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    return utilisation


def test_telemetry_samples_nvml_in_the_background_and_marks_unsupported_counters(fake_nvml):
    with Telemetry("cuda:0", interval_s=0.001) as telemetry:
        time.sleep(0.05)
    counters = telemetry.summary()["counters"]
    samples = len(fake_nvml)
    assert samples >= 3
    assert counters["utilization_percent"] == {"mean": pytest.approx(sum(fake_nvml) / samples), "max": 40.0,
                                               "samples": samples}
    assert counters["power_w"] == {"mean": 250.0, "max": 250.0, "samples": samples}
    assert counters["memory_used_mib"]["max"] == 512.0 and counters["sm_clock_mhz"]["mean"] == 1980.0
    assert counters["temperature_c"] == {"absent": "NVML: Not Supported"}

