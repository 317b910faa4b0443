"""Which tensor copies one eager forward of a benchmark workload makes, and where from: the
script behind the `h200-copies-*.txt` files in docs/results/.

    python3 benchmarks/copy_trace.py distinct_text_1q

It builds the benchmark's shape-only Qwen3.5-0.8B predictor (random weights, bf16), encodes the
workload, runs `model.scores` eagerly once under a dispatch mode, and prints every copying ATen
operation (copy_, clone, contiguous copies, cat, index) with its shapes, strides and the
innermost `dohnuts` line that asked for it, counted.
"""

import sys
import traceback
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dohnuts.bench.protocol import workloads
from dohnuts.bench.shapes import shape_only_predictor

COPIES = ("copy_", "clone", "cat", "index.Tensor", "_to_copy")


class Copies(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket.__name__) + "." + func._overloadname
        if any(copy in name for copy in COPIES):
            shapes = [(tuple(a.shape), a.stride()) for a in args if isinstance(a, torch.Tensor)]
            where = [f"{frame.filename.split('/dohnuts/')[-1]}:{frame.lineno} {frame.name}"
                     for frame in traceback.extract_stack() if "/dohnuts/" in frame.filename]
            self.seen[(name, str(shapes)[:150], where[-1] if where else "?")] += 1
        return func(*args, **(kwargs or {}))


@torch.no_grad()
def main(name: str = "distinct_text_1q") -> None:
    predictor = shape_only_predictor("qwen3_5-0.8b", graphs=False)
    state, questions = workloads()[name]
    batch, _ = predictor.encode(state, questions)
    moved = batch.to(predictor.model.device)
    embeds = predictor.model.embeddings(moved)
    predictor.model.scores(embeds, moved)  # compiles and tunes outside the trace
    with Copies() as mode:
        predictor.model.scores(embeds, moved)
    for (op, shapes, where), count in mode.seen.most_common():
        print(f"{count:4d}  {op:28s} {where:60s} {shapes}")


if __name__ == "__main__":
    main(*sys.argv[1:])
