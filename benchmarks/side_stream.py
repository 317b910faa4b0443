"""What the prefixes' delta rule on a side stream (`decoder._delta_mix`) gains: the script
behind the `h200-side-stream-*.txt` files in docs/results/.

    python3 benchmarks/side_stream.py distinct_text_50q

On the shape-only Qwen3.5-0.8B predictor (random weights, bf16, no bucket graphs: the
workload replays its own captured graph), `rounds` alternations of: the graph captured with
the side stream, 100 timed `predict` calls; the graph captured again with everything on one
stream (`kernels.side_stream` returning None, for this measurement only), 100 calls. Prints
each block's p50 in ms.
"""

import statistics
import sys

from profile_predict import timed_samples, warm_up  # this folder is on the path as a script

from dohnuts.measure.shapes import shape_only_predictor
from dohnuts.ops import kernels
from dohnuts.pipeline.benchmark import workloads


def main(name: str = "distinct_text_50q", rounds: int = 3) -> None:
    predictor = shape_only_predictor("qwen3_5-0.8b", graphs=False)
    state, questions = workloads()[name]
    real = kernels.side_stream
    blocks = {"side stream": [], "one stream": []}
    for _ in range(rounds):
        for label, choice in (("side stream", real), ("one stream", lambda x: None)):
            kernels.side_stream = choice
            predictor.scores.graphs.clear()  # captured again under this choice on the third call
            predictor.scores.seen.clear()
            warm_up(predictor, state, questions)
            samples = timed_samples(lambda: predictor.predict(state, questions), 100)
            blocks[label].append(statistics.median(samples))
    kernels.side_stream = real
    print(f"## {name}: predict p50 (ms) of 100 calls, {rounds} alternating blocks; stats {predictor.scores.stats}")
    for label, values in blocks.items():
        print(f"{label:12s} " + " ".join(f"{value:6.3f}" for value in values))


if __name__ == "__main__":
    main(*sys.argv[1:2])
