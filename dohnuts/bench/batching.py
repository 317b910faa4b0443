"""How the server's batching behaves: answers batched against alone, and the serving workload
alone (`dohnuts serve` in its own processes, over a shape-only deployable folder)."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from .host import SHAPE, require_cuda
from .load import describe_level
from .serving import ServingPlan, serving_record
from .shapes import shape_only_predictor, write_shape_checkpoint
from .traffic import serving_mix


def batched_vs_alone(count: int = 32) -> None:
    """How far a request's answers move when it is batched with others, on the shape-only
    Qwen3.5-0.8B predictor in bf16 (the server's batching): `predict_many` over the serving mix
    against `predict` on each alone.

        python benchmarks/run.py batched_vs_alone --count 32 > batched-vs-alone.txt
    """
    require_cuda()
    predictor = shape_only_predictor(SHAPE)
    requests = serving_mix(count, seed=1)
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


def serving_workload(requests: int = 512, rates: tuple[float, ...] = (), clients: tuple[int, ...] = (1, 8, 64),
                     seconds: float = 30.0, warmup_seconds: float = 5.0, workers: int = 4, processes: int = 4,
                     client_cpus: int = 4) -> None:
    """The benchmark's serving workload alone (`serving.serving_record`), on a deployable folder
    of the shape-only Qwen3.5-0.8B model written for it: open loop at each of `rates`, then
    closed loop at each count of `clients`.

        python benchmarks/run.py serving_workload --rates 100 200 400 --clients 1 8 64 > serving.json

    Prints the record (JSON) on stdout and one line per level on stderr.
    """
    require_cuda()
    plan = ServingPlan(requests, tuple(rates), tuple(clients), seconds, warmup_seconds, workers, processes, client_cpus)
    with tempfile.TemporaryDirectory() as scratch:
        folder = write_shape_checkpoint(SHAPE, Path(scratch) / "checkpoint")
        record = serving_record(folder, plan, progress=lambda level: print(describe_level(level), file=sys.stderr,
                                                                               flush=True))
    print(json.dumps({**record, "shape_only": SHAPE}))
