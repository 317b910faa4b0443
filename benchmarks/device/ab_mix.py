"""One process's figures for a runtime against another's (`base-ab.sh` runs it on a base tree and
on this one): the shape-only Qwen3.5-0.8B predictor with its buckets, then real-traffic first
sights (10 warm-up, 80 timed: p50/p99/max, text and image p50, the engine's stage p50s, what the
calls ran), three protocol workloads replayed (p50 of 30 after 3), and 128 requests of the
serving mix through `predict_many` in groups of 8 and of 32 (decisions/s). One line of JSON,
after "AB ".

    python3 benchmarks/device/ab_mix.py LABEL
"""

import json
import sys
import time

import torch

from dohnuts.bench.protocol import workloads
from dohnuts.bench.shapes import shape_only_predictor
from dohnuts.bench.traffic import percentile, real_traffic, serving_mix
from dohnuts.bench.varied import _timed_pass

label = sys.argv[1]
start = time.perf_counter()
predictor = shape_only_predictor("qwen3_5-0.8b")
out = {"label": label, "load_s": round(time.perf_counter() - start, 1), "buckets": len(predictor.scores.buckets),
       "failed": predictor.scores.stats["failed_buckets"]}
requests = real_traffic(90, 37)
for state, questions in requests[:10]:
    predictor.predict(state, questions)
first = _timed_pass(predictor, requests[10:])
out["real"] = {key: round(first[key], 2) for key in ("p50_ms", "p99_ms", "max_ms", "text_p50_ms", "image_p50_ms")}
out["real_stages"] = {stage: round(ms, 2) for stage, ms in first["engine_stages_p50_ms"].items()}
out["real_calls"] = first["timed_calls"]
for name in ("vision_protocol_images_4q", "distinct_text_50q", "vision_protocol_text_1q"):
    state, questions = workloads()[name]
    for _ in range(3):
        predictor.predict(state, questions)
    samples = []
    for _ in range(30):
        torch.cuda.synchronize()
        began = time.perf_counter()
        predictor.predict(state, questions)
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - began) * 1000)
    out[name] = round(percentile(samples, 0.5), 2)
mix = serving_mix(256, 5)
for size in (8, 32):
    seconds, decisions = [], 0
    for index in range(0, 128, size):
        group = mix[index:index + size]
        torch.cuda.synchronize()
        began = time.perf_counter()
        predictor.predict_many(group)
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - began)
        decisions += sum(len(questions) for _, questions in group)
    out[f"many{size}_decisions_per_s"] = round(decisions / sum(seconds), 1)
out["eager_total"] = predictor.scores.stats["eager"]
print("AB", json.dumps(out), flush=True)
