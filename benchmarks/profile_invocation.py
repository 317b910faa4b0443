"""Where an invocation's device time goes: the serving mix's requests, alone and eight at a
time, through the engine on a shape-only Qwen3.5-0.8B (bf16, CUDA), each timed and then
profiled (the top kernels by device time).

    python benchmarks/profile_invocation.py --batch 8 --top 25
"""

from __future__ import annotations

import statistics
import time

import click
import torch

from dohnuts.bench.shapes import shape_only_parts
from dohnuts.bench.traffic import serving_mix
from dohnuts.runtime.buckets import all_buckets, smallest_fit
from dohnuts.runtime.engine import request_shape
from dohnuts.runtime.predict import Predictor


@click.command()
@click.option("--batch", default=8, help="requests an invocation")
@click.option("--groups", default=6, help="distinct groups of requests timed")
@click.option("--top", default=25, help="kernels listed")
def main(batch: int, groups: int, top: int) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    model, template, config = shape_only_parts("qwen3_5-0.8b", device, dtype=dtype)
    predictor = Predictor(model, template, config, {"noul": 1.0, "choice": 1.0, "score": 1.0})
    mix = [pair for pair in serving_mix(batch * groups + groups, seed=11) if "image" not in pair[0]]
    sets = {"alone": [mix[index:index + 1] for index in range(groups)],
            f"{batch} together": [mix[index * batch:(index + 1) * batch] for index in range(groups)]}
    needed = set()
    for label, requests in sets.items():
        for group in list(requests):
            encoded = [predictor.encode_request(predictor.encode(*pair)[1]) for pair in group]
            shape = request_shape(encoded[0])
            for request in encoded[1:]:
                shape = shape.join(request_shape(request))
            bucket = smallest_fit(shape, all_buckets())
            if bucket is None:
                print(f"{label}: a group of {shape} fits no bucket; left out")
                requests.remove(group)
                continue
            needed.add(bucket)
    started = time.perf_counter()
    print("buckets", sorted(needed, key=lambda bucket: bucket.tokens), "ready",
          predictor.prepare_graphs(sorted(needed, key=lambda bucket: bucket.tokens)),
          f"in {time.perf_counter() - started:.1f} s", flush=True)
    for label, requests in sets.items():
        for group in requests:  # first sight, then warm
            predictor.predict_many(group)
        times = []
        for _ in range(3):
            for group in requests:
                sync()
                begun = time.perf_counter()
                predictor.predict_many(group)
                sync()
                times.append(1000 * (time.perf_counter() - begun))
        tokens = statistics.fmean(sum(len(row.input_ids) for pair in group
                                      for row in predictor.encode_request(predictor.encode(*pair)[1]).rows)
                                  for group in requests)
        print(f"{label}: p50 {statistics.median(times):.1f} ms, min {min(times):.1f} ms, row tokens (unshared) "
              f"{tokens:.0f}; engine stats {predictor.engine.scores.stats}", flush=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                                torch.profiler.ProfilerActivity.CPU]) as profiler:
            for group in requests:
                predictor.predict_many(group)
            sync()
        print(profiler.key_averages().table(sort_by="cuda_time_total", row_limit=top, max_name_column_width=70),
              flush=True)


if __name__ == "__main__":
    main()
