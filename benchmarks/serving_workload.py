"""The benchmark's serving workload alone, on the shape-only Qwen3.5-0.8B predictor the benchmark
stage times: the server on loopback, `REQUESTS` varied requests at each client count.

    python3 benchmarks/serving_workload.py 256 1 8 64 > serving.json

Prints the record (JSON) on stdout and one line per client count on stderr.
"""

import json
import sys

import torch

from dohnuts.bench.records import environment
from dohnuts.bench.serving import serving_record
from dohnuts.bench.shapes import shape_only_predictor
from dohnuts.bench.stage import describe


def main(requests: int = 256, clients: tuple[int, ...] = (1, 8, 64)) -> None:
    if not torch.cuda.is_available():
        sys.exit("serving_workload: needs a CUDA device")
    predictor = shape_only_predictor("qwen3_5-0.8b")
    record = {**serving_record(predictor, requests, clients), "environment": environment(predictor)}
    print(describe(record), file=sys.stderr)
    print(json.dumps(record))


if __name__ == "__main__":
    arguments = [int(value) for value in sys.argv[1:]]
    main(arguments[0], tuple(arguments[1:])) if arguments else main()
