"""Measured ceilings and telemetry: what the device reaches and what it reports while timed."""

from __future__ import annotations

import resource
import threading
import time

import torch


def synchronize(device: torch.device) -> None:
    """Wait for the device (no-op off CUDA): timings bracket the work they measure."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rate(call, work: float, device: torch.device, repeats: int) -> float:
    """work / second of `call`, timed over `repeats` back-to-back calls after two warm-ups."""
    for _ in range(2):
        call()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    synchronize(device)
    return work * repeats / (time.perf_counter() - start)


def measure_ceilings(device, matrix_size: int | None = None, copy_bytes: int | None = None,
                     repeats: int = 5) -> dict:
    """Ceilings measured in this process: a square matmul and a device copy.

    On CUDA: a bf16 matmul (default 8192^3) for the matrix rate, a float32 matmul with TF32 off
    (CUDA cores, an upper estimate of float32 vector work) for the vector rate, a clone (bytes
    read + written) for bandwidth and a pinned host-to-device copy for the transfer rate. On the
    CPU: one float32 matmul (default 1024^3) serves matrix and vector work (the same SIMD units),
    a clone measures memory bandwidth, and there is no host link.

    Args:
        device: the device to measure.
        matrix_size: n of the n x n x n matmul.
        copy_bytes: bytes of the cloned tensor.
        repeats: timed calls of each measurement.

    Returns:
        {"matrix_flops_per_s", "vector_flops_per_s", "bandwidth_bytes_per_s",
         "transfer_bytes_per_s" (None on the CPU), "method", "device"}.
    """
    device = torch.device(device)
    if device.type == "cuda":
        size, length = matrix_size or 8192, (copy_bytes or 2**30) // 4
        matrix = _matmul_rate(size, torch.bfloat16, device, repeats)
        precision = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("highest")
        try:
            vector = _matmul_rate(size // 2, torch.float32, device, repeats)
        finally:
            torch.set_float32_matmul_precision(precision)
        source = torch.empty(length, dtype=torch.float32, device=device)
        host = torch.empty(length, dtype=torch.float32, pin_memory=True)
        transfer = _rate(lambda: source.copy_(host, non_blocking=True), 4 * length, device, repeats)
        name = torch.cuda.get_device_name(device)
        method = (f"measured on CUDA: bf16 {size}^3 matmul, float32 {size // 2}^3 matmul with TF32 off, "
                  f"clone of {4 * length} bytes (read + written), pinned host-to-device copy; {repeats} timed calls")
    else:
        size, length = matrix_size or 1024, (copy_bytes or 64 * 2**20) // 4
        matrix = vector = _matmul_rate(size, torch.float32, device, repeats)
        source, transfer, name = torch.empty(length, dtype=torch.float32), None, "CPU"
        method = (f"CPU-measured: float32 {size}^3 matmul (matrix and vector), clone of {4 * length} bytes "
                  f"(read + written); {repeats} timed calls")
    bandwidth = _rate(lambda: source.clone(), 2 * 4 * length, device, repeats)
    return {"matrix_flops_per_s": matrix, "vector_flops_per_s": vector, "bandwidth_bytes_per_s": bandwidth,
            "transfer_bytes_per_s": transfer, "method": method, "device": name}


def _matmul_rate(size: int, dtype: torch.dtype, device: torch.device, repeats: int) -> float:
    left = torch.randn(size, size, dtype=dtype, device=device)
    right = torch.randn(size, size, dtype=dtype, device=device)
    return _rate(lambda: left @ right, 2 * size**3, device, repeats)


COUNTERS = ("power_w", "utilization_percent", "memory_used_mib", "temperature_c", "sm_clock_mhz")


def _open_nvml(device: torch.device):
    """(pynvml, handle) of `device`, or the reason NVML cannot be sampled."""
    if device.type != "cuda":
        return f"device {device} is not a CUDA device"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    try:
        import pynvml
    except ImportError:
        return "pynvml (package nvidia-ml-py) is not installed"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as error:
        return f"NVML did not initialise: {error}"
    index = device.index if device.index is not None else torch.cuda.current_device()
    # NVML numbers every GPU of the host and CUDA_VISIBLE_DEVICES renumbers CUDA's; the UUID is shared.
    uuid = f"GPU-{torch.cuda.get_device_properties(index).uuid}"
    try:
        return pynvml, pynvml.nvmlDeviceGetHandleByUUID(uuid)
    except pynvml.NVMLError as error:
        pynvml.nvmlShutdown()
        return f"NVML found no GPU {uuid} (CUDA device {index}): {error}"


def _readers(pynvml) -> dict:
    return {
        "power_w": lambda handle: pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0,  # reported in mW
        "utilization_percent": lambda handle: float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu),
        "memory_used_mib": lambda handle: pynvml.nvmlDeviceGetMemoryInfo(handle).used / 2**20,
        "temperature_c": lambda handle: float(pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)),
        "sm_clock_mhz": lambda handle: float(pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)),
    }


# The sampling interval. The sampler is a thread of the timed process, so each sample takes the
# interpreter lock from the calls being timed: at 10 ms, the 50-question request's p50 on the H200
# (7.1 to 7.4 ms without telemetry) measured 7.3 and 8.3 ms while sampled, and 7.1 at 100 ms
# (2026-12-02's telemetry overhead, docs/changelog.md).
INTERVAL_S = 0.1


class Telemetry:
    """Device and process counters while the context is open.

    With a CUDA device and pynvml, a background thread samples NVML (power, GPU utilisation,
    memory used, temperature, SM clock) every `interval_s`; otherwise, and for any counter the
    device does not support, the counter is absent with its reason, never zero. On exit it also
    reads the process's peak RSS and, on CUDA, the peak allocated and reserved memory since
    entry (entering resets CUDA's peak statistics).
    """

    def __init__(self, device=None, interval_s: float = INTERVAL_S):
        self.device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
        self.interval_s = interval_s
        self._samples = {name: [] for name in COUNTERS}
        self._failures: dict[str, str] = {}
        self._absent: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed: dict | None = None

    def _cuda(self) -> bool:
        return self.device.type == "cuda" and torch.cuda.is_available()

    def __enter__(self) -> Telemetry:
        if self._cuda():
            torch.cuda.reset_peak_memory_stats(self.device)
        opened = _open_nvml(self.device)
        if isinstance(opened, str):
            self._absent = opened
        else:
            self._nvml, self._handle = opened
            self._read = _readers(self._nvml)
            self._thread = threading.Thread(target=self._run, name="telemetry", daemon=True)
            self._thread.start()
        self._start = time.perf_counter()
        return self

    def _sample(self) -> None:
        for name, read in self._read.items():
            if name in self._failures:
                continue
            try:
                self._samples[name].append(read(self._handle))
            except self._nvml.NVMLError as error:
                # An unsupported counter stays unsupported: stop asking.
                self._failures[name] = f"NVML: {error}"

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval_s)

    def __exit__(self, *exception) -> bool:
        duration = time.perf_counter() - self._start
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._sample()  # the window's end, so even a short window has a sample
            self._nvml.nvmlShutdown()
        memory = {"absent": f"device {self.device} is not a CUDA device"}
        if self._cuda():
            memory = {"peak_allocated_mib": torch.cuda.max_memory_allocated(self.device) / 2**20,
                      "peak_reserved_mib": torch.cuda.max_memory_reserved(self.device) / 2**20}
        # ru_maxrss is in KiB on Linux: the process's peak, not only this window's.
        self._closed = {"duration_s": duration, "cuda_memory": memory,
                        "process": {"max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}}
        return False

    def summary(self) -> dict:
        """Counters of the closed window.

        Returns:
            {"interval_s", "duration_s", "counters": {name: {"mean", "max", "samples"} or
             {"absent": reason}}, "process": {"max_rss_mib"}, "cuda_memory": {"peak_allocated_mib",
             "peak_reserved_mib"} or {"absent": reason}}.
        """
        if self._closed is None:
            raise RuntimeError("Telemetry.summary() needs a closed window: use it after the with block")
        counters = {}
        for name in COUNTERS:
            values = self._samples[name]
            if self._absent is not None:
                counters[name] = {"absent": self._absent}
            elif name in self._failures:
                counters[name] = {"absent": self._failures[name]}
            else:
                counters[name] = {"mean": sum(values) / len(values), "max": max(values), "samples": len(values)}
        return {"interval_s": self.interval_s, **self._closed, "counters": counters}
