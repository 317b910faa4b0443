"""How far a request's answers move when it is batched with others, on the shape-only
Qwen3.5-0.8B predictor in bf16 (the server's batching): `predict_many` over the serving
workload's varied requests against `predict` on each alone.

    python3 benchmarks/batched_vs_alone.py 32 > batched-vs-alone.txt
"""

import sys

import torch

from dohnuts.bench.serving import mixed_requests
from dohnuts.bench.shapes import shape_only_predictor
from dohnuts.serve.wire import parse_system_one


def main(count: int = 32) -> None:
    if not torch.cuda.is_available():
        sys.exit("batched_vs_alone: needs a CUDA device")
    predictor = shape_only_predictor("qwen3_5-0.8b")
    requests = [parse_system_one(body)[:2] for body in mixed_requests(count, seed=1)]
    batched = predictor.predict_many(requests)
    worst = 0.0
    for request, together in zip(requests, batched):
        alone = predictor.predict(*request)
        for qid, answer in alone["answers"].items():
            gap = max(abs(a - b) for a, b in zip(answer["probabilities"].values(),
                                                  together["answers"][qid]["probabilities"].values()))
            worst = max(worst, gap)
    questions = sum(len(request[1]) for request in requests)
    print(f"{count} requests, {questions} questions, one batch against each alone (bf16, shape-only): "
          f"largest probability difference {worst:.3e}")


if __name__ == "__main__":
    main(*(int(value) for value in sys.argv[1:2]))
