"""Device-side profiles of one benchmark workload's `predict`: the profiler's table, a breakdown
of its parts, the kernels its graph replays, and the tensor copies of one eager forward; of a
long one-question request's bucket graph and of real traffic's first sights, the kernels and
the host's share (cProfile)."""

from __future__ import annotations

import os
import statistics
import time
import traceback
from collections import Counter, defaultdict

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

from ..runtime.buckets import bucket_for, pad_to_bucket
from ..runtime.cuda_graphs import layout_key
from . import settings as runtime_settings
from .host import (
    SHAPE,
    chosen_workloads,
    cprofiled,
    real_traffic_warmed,
    require_cuda,
    timed_samples,
    traffic_kind,
    warm_up,
    warmed_predictor,
)
from .long_context import exact_request
from .shapes import shape_only_predictor
from .telemetry import Telemetry
from .traffic import percentile


def profile_predict(workload: str = "distinct_text_50q", calls: int = 20, profiled: int = 3, rows: int = 45) -> None:
    """Profile one benchmark workload's `predict` on the GPU.

        python benchmarks/run.py profile_predict --workload distinct_text_50q > profile.txt

    It builds the shape-only Qwen3.5-0.8B predictor the benchmark stage times (random weights,
    bf16), warms it up (so CUDA graphs are captured), prints the p50 of `calls` calls, then the
    torch.profiler key averages of `profiled` calls sorted by device time (`rows` rows).
    """
    predictor, state, questions = warmed_predictor(workload)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        predictor.predict(state, questions)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    print(f"# {workload}: p50 of {calls} calls {statistics.median(times):.2f} ms; profile of {profiled} calls")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(profiled):
            predictor.predict(state, questions)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=70))


def _timed(label: str, call, calls: int = 50) -> None:
    samples = timed_samples(call, calls)
    print(f"{label:34s} p50 {statistics.median(samples):7.3f} ms  min {min(samples):7.3f}", flush=True)


@torch.no_grad()
def predict_breakdown(workload: str = "distinct_text_50q") -> None:
    """Where the time of one benchmark workload's `predict` goes on the GPU.

        python benchmarks/run.py predict_breakdown --workload distinct_text_50q > breakdown.txt

    It builds the shape-only Qwen3.5-0.8B predictor the benchmark stage times (random weights,
    bf16), warms it up (so the request's CUDA graph is captured), then prints the p50 and minimum
    of 50 calls of: the whole `predict`, its host encoding, the batch's copy to the device, the
    input embeddings, the graph's replay alone (the device time of the forward with its launch
    gaps), the replay with its input copies, the layout key, and `predict` again with the
    benchmark's NVML sampler running.
    """
    predictor, state, questions = warmed_predictor(workload)
    _timed("predict", lambda: predictor.predict(state, questions))
    _timed("encode", lambda: predictor.encode(state, questions))
    batch, _ = predictor.encode(state, questions)
    device = predictor.model.device
    _timed("batch.to", lambda: batch.to(device))
    moved = batch.to(device)
    _timed("embeddings", lambda: predictor.model.embeddings(moved))
    graph = predictor.scores.graphs[layout_key(moved)]
    _timed("graph.replay only", graph.graph.replay)
    embeds = predictor.model.embeddings(moved)
    _timed("replay with input copies", lambda: graph.replay(embeds, moved))
    _timed("layout_key", lambda: layout_key(moved))
    with Telemetry(device):
        _timed("predict under Telemetry", lambda: predictor.predict(state, questions))
    _timed("predict again", lambda: predictor.predict(state, questions))


PROFILED = 5  # graph replays under the profiler, per workload


def _kernels(prof) -> list[tuple[str, float, float]]:
    """(name, start us, end us) of every device kernel the profile saw."""
    found = []
    for event in prof.profiler.kineto_results.events():
        if event.device_type() == torch.autograd.DeviceType.CUDA and "memcpy" not in event.name().lower():
            start = event.start_ns() / 1e3
            found.append((event.name(), start, start + event.duration_ns() / 1e3))
    return found


def _busy(intervals) -> float:
    """Microseconds covered by the union of (start, end) intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted((s, e) for _, s, e in intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


@torch.no_grad()
def _kernel_report(predictor, name: str, state, questions) -> None:
    warm_up(predictor, state, questions)
    batch, _ = predictor.encode(state, questions)
    moved = batch.to(predictor.model.device)
    graph = predictor.scores.graphs.get(layout_key(moved))
    call = lambda: predictor.predict(state, questions)  # noqa: E731
    whole = statistics.median(timed_samples(call, 50))
    if graph is None:  # a bucket serves it: its kernels are those of whole calls, embeddings included
        print(f"## {name}: predict p50 {whole:.3f} ms; no exact graph, whole calls profiled", flush=True)
    else:
        replay = statistics.median(timed_samples(graph.graph.replay, 50))
        print(f"## {name}: predict p50 {whole:.3f} ms, graph replay alone p50 {replay:.3f} ms", flush=True)
        call = graph.graph.replay
    kernels = _kernels_of(call)
    summed = sum(end - start for _, start, end in kernels)
    print(f"kernels a call {len(kernels) / PROFILED:.0f}; device time a call: summed "
          f"{summed / PROFILED / 1e3:.3f} ms, busy (union) {_busy(kernels) / PROFILED / 1e3:.3f} ms")
    _kernel_table(kernels)


def _kernels_of(call) -> list[tuple[str, float, float]]:
    """The kernels (`_kernels`) of PROFILED calls of `call` under the profiler."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED):
            call()
        torch.cuda.synchronize()
    return _kernels(prof)


def _kernel_table(kernels, top: int | None = None, calls: int = PROFILED, per: str = "call") -> None:
    """Kernels of `calls` calls grouped by name, by device time a call (the `top` first; all by
    default); `per` names what a call is."""
    by_name = defaultdict(lambda: [0, 0.0])
    for kernel, start, end in kernels:
        by_name[kernel][0] += 1
        by_name[kernel][1] += end - start
    print(f"{'us a ' + per:>12} {'calls':>6} {'us each':>8}  kernel")
    for kernel, (count, total) in sorted(by_name.items(), key=lambda item: -item[1][1])[:top]:
        print(f"{total / calls:12.1f} {count / calls:6.1f} {total / count:8.2f}  {kernel[:110]}")
    print(flush=True)


def kernel_profile(workloads: tuple[str, ...] = ("distinct_text_50q", "distinct_text_1q",
                                                 "vision_protocol_image_1q")) -> None:
    """Which kernels one benchmark workload's forward runs, and for how long, on the GPU.

        python benchmarks/run.py kernel_profile --workloads distinct_text_50q distinct_text_1q

    For each workload it builds (once) the benchmark's shape-only Qwen3.5-0.8B predictor (random
    weights, bf16), warms the workload up until its CUDA graph is captured, and prints:
    - the p50 of 50 `predict` calls and of 50 replays of the graph alone;
    - from a profile of 5 replays (5 whole calls where a bucket serves the workload): kernels a
      call, the device time a call summed over kernels and as their union (busy), and the table
      of kernels by device time a call, grouped by name.
    """
    table = chosen_workloads(workloads)
    predictor, _, _ = warmed_predictor(workloads[0])
    for name, (state, questions) in table.items():
        _kernel_report(predictor, name, state, questions)


COPIES = ("copy_", "clone", "cat", "index.Tensor", "_to_copy")  # the ATen operations that copy
# Where a copy is asked for: the innermost frame in the package, not counting this module's own.
THIS = os.path.abspath(__file__)
PACKAGE = os.path.dirname(os.path.dirname(THIS)) + os.sep


def _asked_from() -> str:
    """'module.py:line function' of the innermost frame of the package that is not this module."""
    for frame in reversed(traceback.extract_stack()):
        path = os.path.abspath(frame.filename)
        if path.startswith(PACKAGE) and path != THIS:
            return f"{path[len(PACKAGE):]}:{frame.lineno} {frame.name}"
    return "?"


class Copies(TorchDispatchMode):
    """Counts each copying ATen operation by (name, shapes and strides, innermost dohnuts line)."""

    def __init__(self):
        super().__init__()
        self.seen = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket.__name__) + "." + func._overloadname
        if any(copy in name for copy in COPIES):
            shapes = [(tuple(a.shape), a.stride()) for a in args if isinstance(a, torch.Tensor)]
            self.seen[(name, str(shapes)[:150], _asked_from())] += 1
        return func(*args, **(kwargs or {}))


@torch.no_grad()
def copy_trace(workload: str = "distinct_text_1q") -> None:
    """Which tensor copies one eager forward of a benchmark workload makes, and where from.

        python benchmarks/run.py copy_trace --workload distinct_text_1q

    It builds the benchmark's shape-only Qwen3.5-0.8B predictor (random weights, bf16), encodes the
    workload, runs `model.scores` eagerly once under a dispatch mode, and prints every copying ATen
    operation (copy_, clone, contiguous copies, cat, index) with its shapes, strides and the
    innermost `dohnuts` line that asked for it, counted.
    """
    state, questions = chosen_workloads([workload])[workload]
    predictor = shape_only_predictor(SHAPE, graphs=False)
    batch, _ = predictor.encode(state, questions)
    moved = batch.to(predictor.model.device)
    embeds = predictor.model.embeddings(moved)
    predictor.model.scores(embeds, moved)  # compiles and tunes outside the trace
    with Copies() as mode:
        predictor.model.scores(embeds, moved)
    for (op, shapes, where), count in mode.seen.most_common():
        print(f"{count:4d}  {op:28s} {where:60s} {shapes}")


@torch.no_grad()
def real_traffic_profile(count: int = 80, seed: int = 37, top: int = 30) -> None:
    """Where a real-traffic request's first sight goes on the GPU (issue 37): the workload of
    `real_traffic` on the shape-only Qwen3.5-0.8B predictor (graphs prepared as a server loads,
    10 warm-up requests), each timed request once under the profiler (device kernels only).

        python benchmarks/run.py real_traffic_profile --count 80

    Prints the p50 of each request's wall time, its kernels' device time as their union (busy)
    and the rest (host, launches, waits), for all requests and by kind (text or image, with a
    shared prefix or rows alone); then the kernels by device time a request, summed over the
    requests, for all and for each kind (its `top` // 3 first). The profiler slows the host a
    little: the wall times here are above `real_traffic`'s."""
    predictor, requests = real_traffic_warmed(count, seed)
    rows, seen = [], defaultdict(list)
    for state, questions in requests:
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            predictor.predict(state, questions)
            torch.cuda.synchronize()
            wall = (time.perf_counter() - start) * 1e3
        kernels = _kernels(prof)
        batch, _ = predictor.encode(state, questions)
        kind = traffic_kind(state, bool(batch.prefix_tokens))
        seen[kind] += kernels
        rows.append((kind, wall, _busy(kernels) / 1e3, batch.computed_tokens))
    kinds = ["all", "text", "image", *sorted(seen)]
    for kind in kinds:
        chosen = [row for row in rows if kind == "all" or row[0] == kind or row[0].startswith(kind + " ")]
        if not chosen:
            continue
        walls, busy = [row[1] for row in chosen], [row[2] for row in chosen]
        rest = [wall - device for wall, device in zip(walls, busy)]
        print(f"{kind:12} {len(chosen):3d} requests: wall p50 {percentile(walls, 0.5):.2f} ms, device busy p50 "
              f"{percentile(busy, 0.5):.2f} ms, the rest p50 {percentile(rest, 0.5):.2f} ms; "
              f"computed tokens p50 {percentile([row[3] for row in chosen], 0.5):.0f}", flush=True)
    print()
    _kernel_table([kernel for kind in seen for kernel in seen[kind]], top, len(rows), "request")
    for kind in sorted(seen):
        print(f"## {kind}")
        _kernel_table(seen[kind], max(1, top // 3), sum(row[0] == kind for row in rows), "request")


@torch.no_grad()
def long_row_profile(lengths: tuple[int, ...] = (1500, 3000), replays: int = 50, top: int = 40,
                     firsts: int = 8, settings: tuple[str, ...] = ()) -> None:
    """Where a one-question request of a long state spends its device time (issue 37): for each
    of `lengths` input tokens (`long_context.exact_request`, on the shape-only Qwen3.5-0.8B
    predictor with its graphs prepared), one `predict` on first sight, then its one-row bucket's
    graph replayed alone: the p50 of `replays` replays between device synchronisations (wall)
    and by CUDA events (device span), and from a profile of 5 replays the kernels a replay, their
    summed and union (busy) device time, the gaps (span less busy) and the table of kernels by
    device time (`top` rows); then `firsts` first sights of its text made new, timed, and as
    many under cProfile (`_first_sight_host`). `settings` change the runtime's first
    (`bench.settings`, as "attention.DENSE_LONE=0").

        python benchmarks/run.py long_row_profile --lengths 1500 3000

    Raises:
        RuntimeError: a request whose batch is not served by a one-row bucket's single graph.
    """
    require_cuda()
    print(f"settings: {runtime_settings.apply(settings)}", flush=True)
    predictor = shape_only_predictor(SHAPE)
    scores = predictor.scores
    for tokens in lengths:
        state, questions = exact_request(predictor, tokens)
        first = timed_samples(lambda state=state, questions=questions: predictor.predict(state, questions), 1)[0]
        batch, _ = predictor.encode(state, questions)
        bucket = bucket_for(batch, scores.ladder)
        if bucket is None or not bucket.single:
            raise RuntimeError(f"{tokens} tokens: no one-row bucket serves the request ({bucket})")
        graphs = scores.buckets[bucket]
        padded = pad_to_bucket(batch, bucket, scores.pad_id).to(predictor.model.device)
        graphs.replay(predictor.model.embeddings(padded), padded)
        graph = graphs.graphs[0]
        walls = timed_samples(graph.replay, replays)
        spans = []
        for _ in range(replays):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            graph.replay()
            end.record()
            end.synchronize()
            spans.append(begin.elapsed_time(end))
        kernels = _kernels_of(graph.replay)
        summed, busy = sum(end - start for _, start, end in kernels) / PROFILED, _busy(kernels) / PROFILED
        span = statistics.median(spans) * 1e3
        print(f"## {batch.computed_tokens} computed tokens ({tokens} asked), {bucket}: first sight {first:.2f} ms; "
              f"replay alone p50 {statistics.median(walls):.3f} ms wall, {span / 1e3:.3f} ms device span", flush=True)
        print(f"kernels a replay {len(kernels) / PROFILED:.0f}; summed {summed / 1e3:.3f} ms, busy (union) "
              f"{busy / 1e3:.3f} ms, gaps (span less busy) {(span - busy) / 1e3:.3f} ms")
        _kernel_table(kernels, top)
        _first_sight_host(predictor, state, questions, firsts)


def _first_sight_host(predictor, state, questions, count: int) -> None:
    """`count` first sights of `state` made new (a line before its text: its tokens are not in
    the template's cache), timed, then as many more under cProfile (`host.cprofiled`). The line
    adds a few tokens: the buckets the new texts took are printed (a length that fills its
    bucket moves to the next)."""
    states = [{"document": f"Case {index}.\n{state['document']}"} for index in range(2 * count)]
    fresh = iter(states)

    def call():
        predictor.predict(next(fresh), questions)

    walls = timed_samples(call, count)
    print(f"first sights of new texts: p50 {statistics.median(walls):.2f} ms of {count}; cProfile of {count} more:")
    cprofiled([call] * count)
    buckets = {bucket_for(predictor.encode(new, questions)[0], predictor.scores.ladder) for new in states}
    print(f"the new texts' buckets: {', '.join(sorted(map(str, buckets)))}", flush=True)


@torch.no_grad()
def real_traffic_host(count: int = 40, seed: int = 37, rows: int = 40, kind: str = "all") -> None:
    """Where a real-traffic request's first sight spends its host time (issue 37): the
    workload of `real_traffic` on the shape-only Qwen3.5-0.8B predictor (graphs prepared, 10
    warm-up requests), `count` first sights under cProfile (`host.cprofiled`, `rows` rows):
    every request, or only those of `kind` "text" or "image" (those with a new image) among them.

        python benchmarks/run.py real_traffic_host --count 40 --kind image

    Raises:
        ValueError: a kind other than "all", "text" and "image".
    """
    if kind not in ("all", "text", "image"):
        raise ValueError(f"--kind is all, text or image, got {kind!r}")
    require_cuda()
    predictor, requests = real_traffic_warmed(count, seed)
    chosen = [(state, questions) for state, questions in requests
              if kind == "all" or traffic_kind(state, False).startswith(kind)]
    print(f"{len(chosen)} of {len(requests)} requests ({kind})", flush=True)
    torch.cuda.synchronize()
    cprofiled([lambda state=state, questions=questions: predictor.predict(state, questions)
              for state, questions in chosen], rows)

