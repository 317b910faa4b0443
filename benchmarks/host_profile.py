"""Where a repeated workload's host time goes, and what the benchmark's NVML sampler costs it:
the script behind the `h200-host-profile-*.txt` files in docs/results/.

    python3 benchmarks/host_profile.py distinct_text_1q vision_protocol_image_1q > host.txt

For each workload, on one shape-only Qwen3.5-0.8B predictor (random weights, bf16) warmed up
on it: `rounds` alternations of 30 `predict` calls alone and 30 under the benchmark's
`Telemetry` (p50 of each block, so drift between blocks shows), then cProfile of 100 calls,
the functions with the most own time. A replay's device time shows as the own time of the
call that waits for the logits (`Tensor.cpu`).
"""

import cProfile
import io
import pstats
import statistics
import sys

import torch
from profile_predict import timed_samples, warm_up, warmed_predictor  # this folder is on the path as a script

from dohnuts.bench.protocol import workloads
from dohnuts.bench.telemetry import Telemetry


def p50(call, calls: int = 30) -> float:
    return statistics.median(timed_samples(call, calls))


@torch.no_grad()
def main(*names: str, rounds: int = 4) -> None:
    names = names or ("distinct_text_1q", "vision_protocol_image_1q", "distinct_text_50q")
    predictor, _, _ = warmed_predictor(names[0], "host_profile")
    table = workloads()
    device = predictor.model.device
    for name in names:
        state, questions = table[name]
        call = lambda state=state, questions=questions: predictor.predict(state, questions)  # noqa: E731
        warm_up(predictor, state, questions)
        alone, sampled = [], []
        for _ in range(rounds):
            alone.append(p50(call))
            with Telemetry(device):
                sampled.append(p50(call))
        print(f"## {name}: predict p50 of 30 calls, {rounds} alternating blocks", flush=True)
        print("alone           " + " ".join(f"{value:6.3f}" for value in alone))
        print("under Telemetry " + " ".join(f"{value:6.3f}" for value in sampled))
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(100):
            call()
        torch.cuda.synchronize()
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
        print(text.getvalue(), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
