"""The benchmark stage's records without its serving workload: the script behind the
`h200-shape-only-benchmark-0dc52ba-run{2,3}` files in docs/results/.

    OUT=folder python3 benchmarks/stage_records.py

On a machine that lacks the serve extra's dependencies (the H200 test machine has no
opentelemetry, which the fastapi 0.165 wheel imports), `stages.benchmark` stops at the serving
workload. This runs the stage's own `benchmark` loop on the shape-only Qwen3.5-0.8B predictor
with the stage's default protocol (3 warm-up and 20 timed calls, 60 varied requests) and no
serving workload, writing the raw records after each one and the summary to $OUT.
"""

import json
import os
from pathlib import Path

from dohnuts.bench.shapes import shape_only_predictor
from dohnuts.bench.stage import benchmark, describe


def main() -> None:
    out = Path(os.environ["OUT"])
    predictor = shape_only_predictor("qwen3_5-0.8b")
    print("shape-only: random weights of qwen3_5-0.8b, not the checkpoint", flush=True)

    def progress(done):
        (out / "records.jsonl").write_text("".join(json.dumps(record) + "\n" for record in done))
        print(describe(done[-1]), flush=True)

    _, summary, _ = benchmark(predictor, 3, 20, progress=progress, shape="qwen3_5-0.8b", varied_requests=60)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
