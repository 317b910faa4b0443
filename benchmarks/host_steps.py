"""The host's steps of a repeated workload's `predict` when it replays its exact CUDA graph: the
script behind the `h200-host-steps-*.txt` files in docs/results/.

    python3 benchmarks/host_steps.py distinct_text_1q vision_protocol_image_1q

On the shape-only Qwen3.5-0.8B predictor (random weights, bf16) warmed up on the workload, each
of 100 calls runs `Predictor.predict_many`'s steps one after another as it does (encode; the
layout key, the load into the graph's inputs, the embeddings, the replay's launch and the
weight-version check, which runs while the device replays, inside `GraphedScores`; the wait for
the logits; the answers), timed on the
host with no synchronisation between them, so each step's time is its host time, except the
wait, which is the device's remaining work. Prints the p50 of each step and of their sum,
beside the p50 of 100 plain `predict` calls.
"""

import statistics
import sys
import time

import torch
from profile_predict import timed_samples, warm_up, warmed_predictor  # this folder is on the path as a script

from dohnuts.bench.protocol import workloads
from dohnuts.runtime.cuda_graphs import layout_key

STEPS = ("encode", "layout key", "load into the graph", "embeddings", "replay launch", "version check",
         "wait for the logits", "answers")


@torch.no_grad()
def steps(predictor, state, questions) -> list[float]:
    scores, model = predictor.scores, predictor.model
    marks = [time.perf_counter()]
    batch, parsed, tokens, _ = predictor._encode([(state, questions)], collect=False)
    marks.append(time.perf_counter())
    key = layout_key(batch)
    marks.append(time.perf_counter())
    graph = scores.graphs.get(key)
    if graph is None:
        sys.exit("host_steps: the workload's layout has no exact CUDA graph (it was not captured)")
    moved = graph.load(batch)
    if moved is None:
        sys.exit("host_steps: the workload's batch does not load into its graph's inputs in one copy")
    marks.append(time.perf_counter())
    embeds = None if graph.text else model.embeddings(moved)  # a text graph looks its embeddings up itself
    marks.append(time.perf_counter())
    logits = graph.replay(embeds, moved)
    marks.append(time.perf_counter())
    scores._check_versions()
    marks.append(time.perf_counter())
    torch.cuda.current_stream().synchronize()
    marks.append(time.perf_counter())
    real, predictor.scores = predictor.scores, lambda _: logits  # the answers from these logits
    try:
        predictor._answers(batch, parsed, tokens, False)
    finally:
        predictor.scores = real
    marks.append(time.perf_counter())
    return [1e3 * (after - before) for before, after in zip(marks, marks[1:])]


def main(*names: str) -> None:
    names = names or ("distinct_text_1q", "vision_protocol_image_1q")
    predictor, _, _ = warmed_predictor(names[0], "host_steps")
    table = workloads()
    for name in names:
        state, questions = table[name]
        warm_up(predictor, state, questions)
        samples = [steps(predictor, state, questions) for _ in range(100)]
        plain = timed_samples(lambda state=state, questions=questions: predictor.predict(state, questions), 100)
        print(f"## {name}: p50 of 100 calls (ms); plain predict p50 {statistics.median(plain):.3f}")
        for index, step in enumerate(STEPS):
            print(f"{step:22s} {statistics.median(sample[index] for sample in samples):7.3f}")
        print(f"{'sum':22s} {statistics.median(sum(sample) for sample in samples):7.3f}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
