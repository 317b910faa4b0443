"""Profile one benchmark workload's `predict` on the GPU: the script behind the
`h200-profile-*.txt` files in docs/results/.

    python3 benchmarks/profile_predict.py distinct_text_50q > profile.txt

It builds the shape-only Qwen3.5-0.8B predictor the benchmark stage times (random weights,
bf16), warms it up (so CUDA graphs are captured), prints the p50 of 20 calls, then the
torch.profiler key averages of 3 calls sorted by device time.
"""

import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from dohnuts.bench.protocol import workloads
from dohnuts.bench.shapes import shape_only_predictor


def timed_samples(call, calls: int) -> list[float]:
    """Milliseconds of each of `calls` calls, each bracketed by device synchronisations."""
    samples = []
    for _ in range(calls):
        torch.cuda.synchronize()
        start = time.perf_counter()
        call()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) * 1e3)
    return samples


def warm_up(predictor, state, questions) -> None:
    """Five calls of one request, so its CUDA graph is captured (on the third), then a sync."""
    for _ in range(5):
        predictor.predict(state, questions)
    torch.cuda.synchronize()


def warmed_predictor(name: str, script: str):
    """(the benchmark's shape-only Qwen3.5-0.8B predictor after 5 calls of workload `name`, so
    its CUDA graph is captured, the workload's state, its questions); exits with a message
    naming `script` without CUDA or for an unknown workload. The other scripts here share it."""
    if not torch.cuda.is_available():
        sys.exit(f"{script}: needs a CUDA device")
    table = workloads()
    if name not in table:
        sys.exit(f"{script}: unknown workload {name!r}; known: {sorted(table)}")
    predictor = shape_only_predictor("qwen3_5-0.8b")
    state, questions = table[name]
    warm_up(predictor, state, questions)
    return predictor, state, questions


def main(name: str = "distinct_text_50q", calls: int = 20, profiled: int = 3, rows: int = 45) -> None:
    predictor, state, questions = warmed_predictor(name, "profile_predict")
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        predictor.predict(state, questions)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    print(f"# {name}: p50 of {calls} calls {statistics.median(times):.2f} ms; profile of {profiled} calls")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(profiled):
            predictor.predict(state, questions)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=70))


if __name__ == "__main__":
    main(*sys.argv[1:2])
