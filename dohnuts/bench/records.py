"""What every benchmark record carries: calls timed under one protocol, the roofline of a batch,
and the environment it was measured in."""

from __future__ import annotations

import platform
import time

import torch

from ..model.decoder import MIXER_KEEP_TOKENS
from ..ops import kernels
from .roofline import (
    DEVICES,
    Stage,
    bounds,
    efficiencies,
    efficiency,
    geometry_from_batch,
    stages,
    total,
    useful_work,
)
from .telemetry import synchronize


def measure_calls(call, device: torch.device, warmup: int, timed: int,
             counters=None) -> tuple[float, list[float], object, dict]:
    """One cold call, `warmup` warm-up calls, then `timed` calls, each bracketed by syncs.

    Returns (cold ms, timed samples in ms, the cold call's result, how much each of the
    `counters()` counts grew over the timed calls alone)."""
    def once():
        synchronize(device)
        start = time.perf_counter()
        result = call()
        synchronize(device)
        return (time.perf_counter() - start) * 1000.0, result

    cold_ms, result = once()
    for _ in range(warmup):
        once()
    before = dict(counters()) if counters is not None else {}
    samples = [once()[0] for _ in range(timed)]
    grown = {name: value - before[name] for name, value in counters().items()} if counters is not None else {}
    return cold_ms, samples, result, grown

def roofline_record(model, batch, p50_ms: float, ceilings: dict, passes: int = 1, recomputed: bool = False) -> dict:
    """The useful work of `batch` (run `passes` times; vision only for the images it carries
    pixels of), its bounds under the measured `ceilings` (`measure_ceilings`) and under the
    datasheet of the device they were measured on (absent when that device is not in the
    table), efficiency t_lower / p50 against each, and each bound's share of p50. With
    `recomputed`, the work activation checkpointing repeats in the backward pass (a training
    update) is counted apart, as repeated work, never as useful."""
    config = model.backbone.config
    text, vision = config.text_config.to_dict(), config.vision_config.to_dict()
    dtype_bytes = torch.finfo(model.backbone.dtype).bits // 8
    geometry = geometry_from_batch(batch)
    work = useful_work(text, vision, geometry, dtype_bytes)
    for part in ("flops", "bytes"):
        work[part] = {name: passes * value for name, value in work[part].items()}
    layers = stages(text, vision, geometry, dtype_bytes, whole_layers=batch.computed_tokens > MIXER_KEEP_TOKENS)
    parts = [Stage(stage.name, {name: passes * value for name, value in stage.flops.items()}, passes * stage.bytes,
                   stage.recomputed) for stage in layers]
    transfer = sum(tensor.numel() * tensor.element_size() for tensor in batch.device_tensors())
    record = {"work": work, "transfer_bytes": transfer, "bounds": {}, "efficiency": {}, "efficiency_by_bound": {}}
    if recomputed:
        record["repeated_work"] = total(layers, recomputed_only=True)
    device_name = ceilings["device"]
    sheets = {"measured": ceilings}
    sheet = DEVICES.get(device_name)
    if sheet is not None:
        sheets["datasheet"] = sheet
    else:
        record["efficiency"]["datasheet"] = {"absent": f"no datasheet entry for {device_name!r}"}
    for label, limits in sheets.items():
        # A CPU run has no host-device link to cross.
        bound = bounds(work, limits, transfer if device_name != "CPU" else None, parts)
        record["bounds"][label] = bound
        record["efficiency"][label] = efficiency(bound["t_lower_seconds"], p50_ms / 1000.0)
        record["efficiency_by_bound"][label] = efficiencies(bound, p50_ms / 1000.0)
    return record

def environment(predictor) -> dict:
    """The machine and model a record was made on, and every slower path the runtime has taken
    in this process so far, with why (`dohnuts.ops.kernels.slow_paths`)."""
    device = predictor.model.device
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "device_type": device.type, "torch": torch.__version__, "threads": torch.get_num_threads(),
        "dtype": predictor.config.dtype, "base": predictor.config.base,
        "shape_only": predictor.config.base.startswith("shape-only:"), "slow_paths": kernels.slow_paths(),
    }


def mix_ceiling(predictor, requests: list[tuple[object, dict]], ceilings: dict) -> dict:
    """The roofline ceiling of a mix of requests on this device: each request's lower bound
    `t_lower` (its useful work under the measured `ceilings`, each request alone, its images
    encoded), summed; the most requests and decisions a second the device could answer if it
    did only that work, back to back."""
    seconds, decisions, counted = 0.0, 0, 0
    for state, questions in requests:
        batch, _ = predictor.encode(state, questions)
        seconds += roofline_record(predictor.model, batch, 1.0, ceilings)["bounds"]["measured"]["t_lower_seconds"]
        decisions += len(questions)
        counted += 1
    return {"requests": counted, "decisions": decisions, "t_lower_seconds": seconds,
            "requests_per_second": counted / seconds, "decisions_per_second": decisions / seconds}
