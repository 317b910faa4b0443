"""Where the time of one benchmark workload's `predict` goes on the GPU: the script behind the
`h200-predict-breakdown-*.txt` files in docs/results/.

    python3 benchmarks/predict_breakdown.py distinct_text_50q > breakdown.txt

It builds the shape-only Qwen3.5-0.8B predictor the benchmark stage times (random weights,
bf16), warms it up (so the request's CUDA graph is captured), then prints the p50 and minimum
of 50 calls of: the whole `predict`, its host encoding, the batch's copy to the device, the
input embeddings, the graph's replay alone (the device time of the forward with its launch
gaps), the replay with its input copies, the layout key, and `predict` again with the
benchmark's NVML sampler running.
"""

import statistics
import sys

import torch
from profile_predict import timed_samples, warmed_predictor  # this folder is on the path when run as a script

from dohnuts.bench.telemetry import Telemetry
from dohnuts.runtime.cuda_graphs import layout_key


def timed(label: str, call, calls: int = 50) -> None:
    samples = timed_samples(call, calls)
    print(f"{label:34s} p50 {statistics.median(samples):7.3f} ms  min {min(samples):7.3f}", flush=True)


@torch.no_grad()
def main(name: str = "distinct_text_50q") -> None:
    predictor, state, questions = warmed_predictor(name, "predict_breakdown")
    timed("predict", lambda: predictor.predict(state, questions))
    timed("encode", lambda: predictor.encode(state, questions))
    batch, _ = predictor.encode(state, questions)
    device = predictor.model.device
    timed("batch.to", lambda: batch.to(device))
    moved = batch.to(device)
    timed("embeddings", lambda: predictor.model.embeddings(moved))
    graph = predictor.scores.graphs[layout_key(moved)]
    timed("graph.replay only", graph.graph.replay)
    embeds = predictor.model.embeddings(moved)
    timed("replay with input copies", lambda: graph.replay(embeds, moved))
    timed("layout_key", lambda: layout_key(moved))
    with Telemetry(device):
        timed("predict under Telemetry", lambda: predictor.predict(state, questions))
    timed("predict again", lambda: predictor.predict(state, questions))


if __name__ == "__main__":
    main(*sys.argv[1:])
