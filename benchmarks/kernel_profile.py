"""Which kernels one benchmark workload's forward runs, and for how long, on the GPU: the script
behind the `h200-kernels-*.txt` files in docs/results/.

    python3 benchmarks/kernel_profile.py distinct_text_50q distinct_text_1q vision_protocol_image_1q

For each workload it builds (once) the benchmark's shape-only Qwen3.5-0.8B predictor (random
weights, bf16), warms the workload up until its CUDA graph is captured, and prints:
- the p50 of 50 `predict` calls and of 50 replays of the graph alone;
- from a profile of 5 replays: kernels a call, the device time a call summed over kernels and
  as their union (busy), and the table of kernels by device time a call, grouped by name.
"""

import statistics
import sys
from collections import defaultdict

import torch
from profile_predict import timed_samples, warm_up, warmed_predictor  # this folder is on the path when run as a script
from torch.profiler import ProfilerActivity, profile

from dohnuts.runtime.cuda_graphs import layout_key

PROFILED = 5


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
def report(predictor, name: str, state, questions) -> None:
    warm_up(predictor, state, questions)
    batch, _ = predictor.encode(state, questions)
    moved = batch.to(predictor.model.device)
    graph = predictor.scores.graphs[layout_key(moved)]
    whole = statistics.median(timed_samples(lambda: predictor.predict(state, questions), 50))
    replay = statistics.median(timed_samples(graph.graph.replay, 50))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED):
            graph.graph.replay()
        torch.cuda.synchronize()
    kernels = _kernels(prof)
    by_name = defaultdict(lambda: [0, 0.0])
    for kernel, start, end in kernels:
        by_name[kernel][0] += 1
        by_name[kernel][1] += end - start
    summed = sum(end - start for _, start, end in kernels)
    print(f"## {name}: predict p50 {whole:.3f} ms, graph replay alone p50 {replay:.3f} ms", flush=True)
    print(f"kernels a call {len(kernels) / PROFILED:.0f}; device time a call: summed "
          f"{summed / PROFILED / 1e3:.3f} ms, busy (union) {_busy(kernels) / PROFILED / 1e3:.3f} ms")
    print(f"{'us a call':>10} {'calls':>6} {'us each':>8}  kernel")
    for kernel, (count, total) in sorted(by_name.items(), key=lambda item: -item[1][1]):
        print(f"{total / PROFILED:10.1f} {count / PROFILED:6.0f} {total / count:8.2f}  {kernel[:110]}")
    print(flush=True)


def main(names: list[str]) -> None:
    predictor, state, questions = warmed_predictor(names[0], "kernel_profile")
    from dohnuts.bench.protocol import workloads

    table = workloads()
    for name in names:
        report(predictor, name, *table[name])


if __name__ == "__main__":
    main(sys.argv[1:] or ["distinct_text_50q", "distinct_text_1q", "vision_protocol_image_1q"])
