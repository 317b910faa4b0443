"""Ceilings measured on the device and telemetry sampled during timed calls."""

import json
import math
import sys
import time
import types

import pytest
import torch

from dohnuts.measure.telemetry import Telemetry, measure_ceilings

# D 8, I 16; full attention H 2, Hkv 1, hd 4 (rotary on half: 2 channels); delta rule Hk 1,
# Hv 2, K = V = 4, conv kernel 4 over 2 * 1 * 4 + 2 * 4 = 16 channels.
TEXT = {
    "hidden_size": 8, "intermediate_size": 16, "layer_types": ["linear_attention", "full_attention"],
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4, "linear_num_key_heads": 1,
    "linear_num_value_heads": 2, "linear_key_head_dim": 4, "linear_value_head_dim": 4,
    "linear_conv_kernel_dim": 4, "rope_parameters": {"partial_rotary_factor": 0.5},
}
# Dv 8, Iv 16, 3 channels of 2 x 2 x 2 patches (24 values each), 2 x 2 merge into 8 wide tokens.
VISION = {
    "depth": 1, "hidden_size": 8, "num_heads": 2, "intermediate_size": 16, "in_channels": 3, "patch_size": 2,
    "temporal_patch_size": 2, "spatial_merge_size": 2, "out_hidden_size": 8, "num_position_embeddings": 4,
}

MATRIX_PER_TOKEN = 2 * (
    (8 * 16 + 8 * 4 + 8 * 4 + 8 * 8)  # full attention: q_proj (with its gate half), k_proj, v_proj, o_proj
    + (8 * 16 + 8 * 8 + 8 * 2 + 8 * 2 + 8 * 8)  # delta rule: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj
    + 2 * (8 * 16 + 8 * 16 + 16 * 8)  # gate, up and down projections of both layers
)
ATTENTION_PER_PAIR = 2 * 2 * 2 * 4  # QK^T and PV, 2 heads of 4
RECURRENCE_PER_TOKEN = 7 * 2 * 4 * 4  # 2 value heads of a 4 x 4 state
VECTOR_PER_TOKEN = (
    2 * (2 * 4 * 8 + 2 * 8 + 4 * 16)  # per layer: two RMSNorms, two residual adds, SwiGLU
    + 4 * (8 + 4) + 3 * 2 * (2 + 1) + 4 * 8  # full: q/k norms, rotary of 2 channels on 3 heads, output gate
    + 2 * 4 * 16 + 4 * 16 + 4 * 8 + 4 * 2 * 2 + (4 + 4) * 8  # delta: conv, SiLU, q/k L2, beta and decay, gated norm
    + 4 * 8  # final norm
)
SOFTMAX_PER_PAIR = 4 * 2  # 2 heads
HEAD_PER_CANDIDATE = 2 * 8
PARAMETERS = (
    (8 * 16 + 8 * 4 + 8 * 4 + 8 * 8) + 2 * 4 + 3 * 8 * 16 + 2 * 8  # full: maps, q/k norms, MLP, two layer norms
    + (8 * 16 + 8 * 8 + 8 * 2 + 8 * 2 + 8 * 8) + 16 * 4 + 2 + 2 + 4 + 3 * 8 * 16 + 2 * 8  # delta: maps, conv,
    # A_log, dt_bias, gated norm, MLP, two layer norms
    + 8  # final norm
)
WEIGHT_BYTES = 2 * PARAMETERS + 4 * 8  # bf16 layers, float32 head
STATE_BYTES = 2 * 4 * 4 * 4  # one float32 state of 2 heads of 4 x 4


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

