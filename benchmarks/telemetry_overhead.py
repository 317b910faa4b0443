"""Telemetry's observer effect on a repeated workload's `predict`: the script behind
`h200-telemetry-overhead-*.txt` in docs/results/.

    python3 benchmarks/telemetry_overhead.py distinct_text_50q

On the shape-only Qwen3.5-0.8B predictor (random weights, bf16) warmed up on the workload,
prints the p50 and p95 of 200 calls without telemetry and with NVML sampled every 10 and
100 ms, in that order, then once more each without and at 10 ms: the sampler is a thread of
the timed process.
"""

import sys

import torch
from profile_predict import timed_samples, warmed_predictor  # this folder is on the path as a script

from dohnuts.bench.telemetry import Telemetry
from dohnuts.bench.traffic import percentile

WINDOWS = (("none", None), ("telemetry 0.01", 0.01), ("none", None), ("telemetry 0.1", 0.1),
           ("telemetry 0.01", 0.01))


def main(name: str = "distinct_text_50q", calls: int = 200) -> None:
    predictor, state, questions = warmed_predictor(name, "telemetry_overhead")

    def call():
        predictor.predict(state, questions)

    for label, interval in WINDOWS:
        if interval is None:
            samples = timed_samples(call, calls)
        else:
            with Telemetry(torch.device("cuda"), interval_s=interval):
                samples = timed_samples(call, calls)
        print(f"{label:16s} p50 {percentile(samples, 0.5):.3f} p95 {percentile(samples, 0.95):.3f}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:2])
