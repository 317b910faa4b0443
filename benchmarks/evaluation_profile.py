"""Where evaluation's time goes on the GPU: the script behind the `h200-evaluation-profile-*.txt`
files in docs/results/.

    python3 benchmarks/evaluation_profile.py > evaluation-profile.txt

On the shape-only Qwen3.5-0.8B model (random weights, bf16, the real tokenizer) and the
benchmark's evaluation set (`evaluation_throughput_record`'s: 204 rows, 96 images), it times
the plan, each batch's host build, its copy and its forward alone, then whole passes of
`evaluate` with its batches built in the loop (no worker process, the default for 2 batches) and
by 1 and 2 worker processes, and the plain loop (the plan made beforehand), each pass with the
image-feature cache emptied first (p50 of 3 after one untimed pass). Every timing is
bracketed by device synchronisations.
"""

import statistics
import tempfile
import time
from pathlib import Path

import torch
from profile_predict import timed_samples  # this folder is on the path when run as a script

from dohnuts.bench.evaluation import synchronous_evaluation
from dohnuts.bench.shapes import shape_only_predictor
from dohnuts.config import EVALUATION_BATCH_TOKENS
from dohnuts.data import synthetic
from dohnuts.data.records import RecordReader, load_records, write_mixture
from dohnuts.runtime.evaluation import EvaluationBatches, evaluate, plan_batches


def main() -> None:
    predictor = shape_only_predictor("qwen3_5-0.8b", graphs=False)
    model, template = predictor.model, predictor.template
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        write_mixture(synthetic.generate(seed=0, states_per_group=12), root, 0,
                      {"train": 0.0, "dev": 0.0, "calibration": 0.0, "test": 1.0})
        rows, reader = load_records(root / "test"), RecordReader(root / "test")
        build = EvaluationBatches(template, reader, predictor.config.max_tokens)
        plan = plan_batches(rows, EVALUATION_BATCH_TOKENS, template)
        samples = timed_samples(lambda: plan_batches(rows, EVALUATION_BATCH_TOKENS, template), 5)
        print(f"plan_batches (host) p50 {statistics.median(samples):8.2f} ms", flush=True)
        print(f"{len(rows)} rows, {len(plan)} batches, {int(rows.image.notna().sum())} rows with images", flush=True)
        for index, tables in enumerate(plan):
            item = build(tables)
            moved = item.batch.to(model.device)
            with torch.no_grad():
                model(moved)

            def forward(moved=moved):
                model.image_cache.clear()
                with torch.no_grad():
                    model(moved)

            for label, call in (("build (host)", lambda tables=tables: build(tables)),
                                ("copy to the device", lambda item=item: item.batch.to(model.device)),
                                ("forward, images encoded", forward)):
                samples = timed_samples(call, 5)
                print(f"batch {index} ({sum(len(t) for t in tables)} rows, {item.batch.computed_tokens} tokens) "
                      f"{label:26s} p50 {statistics.median(samples):8.2f} ms", flush=True)
        passes = {f"evaluate, {workers} worker processes" if workers else "evaluate, built in the loop":
                  (lambda workers=workers: evaluate(model, template, reader, rows, EVALUATION_BATCH_TOKENS,
                                                    predictor.config.max_tokens, desc="profile", workers=workers))
                  for workers in (0, 1, 2)}
        passes["plain loop"] = lambda: synchronous_evaluation(model, build, plan)
        for label, run in passes.items():
            seconds = []
            for attempt in range(4):
                model.image_cache.clear()
                torch.cuda.synchronize()
                start = time.perf_counter()
                run()
                torch.cuda.synchronize()
                if attempt:
                    seconds.append(time.perf_counter() - start)
            best = statistics.median(seconds)
            print(f"{label:40s} p50 {best * 1000:8.1f} ms  {len(rows) / best:7.1f} rows/s  "
                  f"({', '.join(f'{s * 1000:.0f}' for s in seconds)} ms)", flush=True)


if __name__ == "__main__":
    main()
