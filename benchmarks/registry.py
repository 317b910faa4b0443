"""One table of named measurements: name -> the `dohnuts.bench` function that runs it, a summary,
what it needs ("cuda" or "any") and its arguments. `run.py` lists and runs them.

The measurements live in `dohnuts.bench`, which may not import its peer `dohnuts.serve`; this
folder may import any wing, so the entries that drive the server get serve's parts here, as
`stages/benchmark.py` hands the stage its app factory. So does the one that times FLA's own
kernel (only `dohnuts.ops` imports FLA).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from dohnuts.bench import batching, device, first_sight, host, kernel_sweep, load_time, loops, short_rows

WORKLOADS = "benchmark workloads (dohnuts.bench.protocol.workloads)"


@dataclass(frozen=True)
class Argument:
    """One argument of a measurement, given on the command line as `--name VALUE` (several values
    when `many`; its default then a tuple); `required` when it has no default."""

    name: str
    type: type
    default: object = None
    help: str = ""
    many: bool = False
    required: bool = False


@dataclass(frozen=True)
class Measurement:
    """A named measurement: `run(**arguments)` prints its report."""

    run: Callable[..., None]
    summary: str
    needs: str  # "cuda" or "any"
    arguments: tuple[Argument, ...] = ()

    @property
    def function(self) -> Callable[..., None]:
        """The `dohnuts.bench` function behind `run` (whose docstring says what it measures)."""
        return self.run.func if isinstance(self.run, functools.partial) else self.run


def fla_fused_recurrent(*args, **kwargs):
    """FLA's `fused_recurrent_gated_delta_rule`, imported at the first call."""
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    return fused_recurrent_gated_delta_rule(*args, **kwargs)


def workload(default: str) -> Argument:
    return Argument("workload", str, default, f"one of the {WORKLOADS}")


def workloads(*default: str) -> Argument:
    return Argument("workloads", str, default, f"{WORKLOADS}, profiled in order", many=True)


MEASUREMENTS: dict[str, Measurement] = {
    # Where a repeated request's host time goes.
    "encode_host": Measurement(
        host.encode_host, "host steps of one request with no device: parse, template, pack, answers", "any",
        (workload("distinct_text_50q"), Argument("blocks", int, 5, "blocks of calls per step"),
         Argument("calls", int, 300, "timed calls a block"))),
    "encode_first_sight": Measurement(
        host.encode_first_sight, "host steps of real-traffic requests on first sight, images new: image vs text",
        "any", (Argument("count", int, 60, "real-traffic requests"), Argument("seed", int, 37, "their seed"),
                Argument("rounds", int, 3, "passes over them"))),
    "host_first_sight": Measurement(
        host.host_first_sight, "host steps of real-traffic requests on first sight as a bucket serves them", "any",
        (Argument("count", int, 80, "real-traffic requests"), Argument("seed", int, 37, "their seed"),
         Argument("rounds", int, 3, "passes over them"))),
    "real_traffic_steps": Measurement(
        host.real_traffic_steps, "real-traffic first sights a bucket serves: each host step timed in place", "cuda",
        (Argument("count", int, 60, "timed requests (10 others warm up first)"),
         Argument("seed", int, 37, "the generator's seed"))),
    "host_steps": Measurement(
        host.host_steps, "host time of each step of a graph-replayed predict", "cuda",
        (workloads("distinct_text_1q", "vision_protocol_image_1q"),)),
    "host_profile": Measurement(
        host.host_profile, "predict alone vs under Telemetry, then cProfile of 100 calls", "cuda",
        (workloads("distinct_text_1q", "vision_protocol_image_1q", "distinct_text_50q"),
         Argument("rounds", int, 4, "alternations of 30 calls alone and under Telemetry"))),
    "telemetry_overhead": Measurement(
        host.telemetry_overhead, "predict p50/p95 without telemetry and with NVML sampled at 10 and 100 ms", "cuda",
        (workload("distinct_text_50q"), Argument("calls", int, 200, "timed calls a window"))),
    # Device-side profiles.
    "profile_predict": Measurement(
        device.profile_predict, "predict p50, then torch.profiler's table by device time", "cuda",
        (workload("distinct_text_50q"), Argument("calls", int, 20, "timed calls"),
         Argument("profiled", int, 3, "calls under the profiler"), Argument("rows", int, 45, "rows of the table"))),
    "predict_breakdown": Measurement(
        device.predict_breakdown, "p50 of each part of predict: encode, copy, embeddings, replay...", "cuda",
        (workload("distinct_text_50q"),)),
    "kernel_profile": Measurement(
        device.kernel_profile, "the kernels a workload's graph replays, by device time", "cuda",
        (workloads("distinct_text_50q", "distinct_text_1q", "vision_protocol_image_1q"),)),
    "long_row_profile": Measurement(
        device.long_row_profile, "a long one-question request's bucket graph: span, busy, gaps, kernels", "cuda",
        (Argument("lengths", int, (1500, 3000), "input tokens of each request", many=True),
         Argument("replays", int, 50, "replays timed"), Argument("top", int, 40, "kernels listed"),
         Argument("firsts", int, 8, "first sights of new texts timed, then profiled"),
         Argument("settings", str, (), "runtime settings changed first, NAME=VALUE (bench.settings.KNOWN)",
                  many=True))),
    "real_traffic_host": Measurement(
        device.real_traffic_host, "real-traffic first sights under cProfile: the host's functions by own time",
        "cuda", (Argument("count", int, 40, "profiled requests (10 others warm up first)"),
                 Argument("seed", int, 37, "the generator's seed"), Argument("rows", int, 40, "functions listed"),
                 Argument("kind", str, "all", "the requests profiled: all, text or image"))),
    "real_traffic_profile": Measurement(
        device.real_traffic_profile, "real-traffic first sights under the profiler: wall vs device busy, kernels",
        "cuda", (Argument("count", int, 80, "timed requests (10 others warm up first)"),
                 Argument("seed", int, 37, "the generator's seed"), Argument("top", int, 30, "kernels listed"))),
    "copy_trace": Measurement(
        device.copy_trace, "every tensor copy of one eager forward, and the line that asked for it", "cuda",
        (workload("distinct_text_1q"),)),
    # Studies of runtime choices.
    "first_sight": Measurement(
        first_sight.first_sight, "first-seen requests: eager forward by delta-rule route, an image miss", "cuda",
        (Argument("count", int, 80, "varied requests whose text ones run eagerly (0 skips that part)"),)),
    "real_traffic": Measurement(
        first_sight.real_traffic_measurement, "real-traffic requests on first sight: p50/p99/max, compiles, HF", "any",
        (Argument("count", int, 80, "timed requests (10 others warm up first)"),
         Argument("seed", int, 37, "the generator's seed"),
         Argument("out", str, None, "a file for the record (JSON)"),
         Argument("settings", str, (), "runtime settings changed first, NAME=VALUE (bench.settings.KNOWN), as "
                  "swiglu.BY_ROWS=1", many=True),
         Argument("mix", str, "real", "the requests: real (issue 37's) or serving (the load harness's mix)"))),
    "long_context": Measurement(
        first_sight.long_context_measurement, "8k to 64k-token requests: latency, tokens/s, peak memory", "any",
        (Argument("lengths", int, (8192, 32768, 65536), "input tokens of each request", many=True),
         Argument("out", str, None, "a file for the record (JSON)"),
         Argument("settings", str, (), "runtime settings changed first, NAME=VALUE (bench.settings.KNOWN), as "
                  "swiglu.BY_ROWS=1", many=True))),
    "load_time": Measurement(
        load_time.load_time_measurement, "an engine's load step by step, Triton's kernel cache cold then warm", "any",
        (Argument("runs", int, 2, "loads, each in a process of its own (the first with an empty kernel cache)"),
         Argument("checkpoint", str, None, "a deployable folder (the shape-only 0.8B by default)"),
         Argument("out", str, None, "a file for the record (JSON)"),
         Argument("settings", str, (), "runtime settings changed first, NAME=VALUE (bench.settings.KNOWN), as "
                  "graphs.WARM_UPS=1", many=True))),
    "delta_rule_short_rows": Measurement(
        functools.partial(short_rows.delta_rule_short_rows, fused_recurrent=fla_fused_recurrent),
        "the 50q request's short rows' delta rule: FLA chunked, recurrent, ours", "cuda"),
    "elementwise_sweep": Measurement(
        kernel_sweep.elementwise_sweep, "a long row's convolution, SwiGLU and gate kernels by launch setting", "cuda",
        (Argument("lengths", int, (1500, 3000), "tokens of the one sequence", many=True),
         Argument("replays", int, 100, "graph replays timed a setting"))),
    "walk_resources": Measurement(
        kernel_sweep.walk_resources, "the 64-token walk's registers, spills, shared memory for sm_90 (Triton's ptxas)",
        "any", (Argument("values", int, (16, 32), "value columns a program", many=True),
                Argument("warps", int, 4, "warps a program"))),
    "delta_rule_prefixes": Measurement(
        short_rows.delta_rule_prefixes, "the whole-sequence scan on prefixes alone and together, by path",
        "cuda", (Argument("lengths", int, (256, 1024, 2048), "prefix lengths", many=True),
                 Argument("together", int, (1, 2, 4, 8), "counts of prefixes run together", many=True),
                 Argument("sets", str, (), "sequences of unequal lengths run together, as 700,200,90", many=True),
                 Argument("only", str, (), "only the paths whose names contain one of these", many=True))),
    "evaluation_profile": Measurement(
        loops.evaluation_profile, "evaluation: plan, each batch's build, copy, forward; whole passes", "cuda"),
    "training_graphs": Measurement(
        loops.training_graphs, "the training update eager and through training graphs", "cuda",
        (Argument("varied", int, 16, "more updates of distinct layouts"),
         Argument("modes", str, ("eager", "graphs"), "eager, graphs or both", many=True))),
    "stage_records": Measurement(
        loops.stage_records, "the benchmark stage's records and summary without the serving workload", "cuda",
        (Argument("out", str, help="folder for records.jsonl and summary.json", required=True),
         Argument("warmup", int, 3, "warm-up calls a workload"), Argument("timed", int, 20, "timed calls a workload"),
         Argument("varied_requests", int, 60, "requests of the varied-traffic workload"))),
    # The server's batching (serve's parts handed in here).
    "batched_vs_alone": Measurement(
        batching.batched_vs_alone,
        "largest probability difference of requests batched together vs each alone", "cuda",
        (Argument("count", int, 32, "requests of the serving mix in the batch"),)),
    "invocation_profile": Measurement(
        batching.invocation_profile, "the serving mix's requests alone and together: times, then top kernels", "cuda",
        (Argument("batch", int, 8, "requests an invocation"), Argument("groups", int, 4, "groups of each"),
         Argument("top", int, 25, "kernels listed"),
         Argument("settings", str, (), "runtime settings changed first, NAME=VALUE (bench.settings.KNOWN)",
                  many=True))),
    "serving_ceiling": Measurement(
        batching.serving_ceiling, "the serving mix's roofline ceiling on the H200 (encodes only) as JSON", "any",
        (Argument("requests", int, 512, "requests of the serving mix"),
         Argument("matrix_tflops", float, 800.0, "matrix rate, TFLOP/s"),
         Argument("bandwidth_tbps", float, 4.3, "memory bandwidth, TB/s"))),
    "bucket_padding": Measurement(
        batching.bucket_padding, "the padding share of the serving mix's invocations in the bucket ladders", "any",
        (Argument("requests", int, 512, "requests of the serving mix"),
         Argument("depths", int, (1, 8, 32), "queue depths the engine takes invocations from", many=True))),
    "serving_workload": Measurement(
        batching.serving_workload,
        "dohnuts serve in its own processes under the load harness: the serving record as JSON", "cuda",
        (Argument("requests", int, 512, "distinct requests of the serving mix"),
         Argument("rates", float, (), "open-loop offered requests/s", many=True),
         Argument("clients", int, (1, 8, 64), "closed-loop client counts", many=True),
         Argument("seconds", float, 30.0, "seconds a level"),
         Argument("warmup_seconds", float, 5.0, "warm-up seconds before each level"),
         Argument("workers", int, 4, "front-end processes"),
         Argument("processes", int, 4, "client processes"),
         Argument("client_cpus", int, 4, "CPUs kept for the clients"),
         Argument("out", str, None, "a file for the record, rewritten after each level"))),
}
