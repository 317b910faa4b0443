"""How the server's batching behaves: answers batched against alone, and the serving workload
alone (`dohnuts serve` in its own processes, over a shape-only deployable folder)."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from ..io import write_json
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
                     client_cpus: int = 4, out: str | None = None) -> None:
    """The benchmark's serving workload alone (`serving.serving_record`), on a deployable folder
    of the shape-only Qwen3.5-0.8B model written for it: open loop at each of `rates`, then
    closed loop at each count of `clients`.

        python benchmarks/run.py serving_workload --rates 100 200 400 --clients 1 8 64 > serving.json

    Prints the record (JSON) on stdout and one line per level on stderr; with `out`, also
    writes the record so far to that file once the server is ready and after each level
    ("complete": false until the end), so a run cut short keeps its levels.
    """
    require_cuda()
    plan = ServingPlan(requests, tuple(rates), tuple(clients), seconds, warmup_seconds, workers, processes, client_cpus)

    def partial(record):
        if out is not None:
            write_json(Path(out), {**record, "shape_only": SHAPE})
        if not record["levels"]:
            print(f"server ready in {record['ready_seconds']:.1f} s", file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory() as scratch:
        folder = write_shape_checkpoint(SHAPE, Path(scratch) / "checkpoint")
        record = serving_record(folder, plan, progress=lambda level: print(describe_level(level), file=sys.stderr,
                                                                               flush=True), partial=partial)
    record = {**record, "shape_only": SHAPE}
    if out is not None:
        write_json(Path(out), record)
    print(json.dumps(record))


def invocation_profile(batch: int = 8, groups: int = 4, top: int = 25, settings: tuple[str, ...] = ()) -> None:
    """Where an invocation's device time goes on the shape-only Qwen3.5-0.8B (bf16): text
    requests of the serving mix through the engine alone and `batch` at a time (`groups` of
    each), timed after a first sight, then profiled (the top kernels by device time). Only the
    buckets they need are captured; a group that fits none is left out and said so. `settings`
    change the runtime's first (`bench.settings`, as "scan.FWD_VALUES=32"); the line before the
    figures gives them all.

        python benchmarks/run.py invocation_profile --batch 8 --groups 4 --top 25 > profile.txt
    """
    import statistics
    import time

    import torch

    from ..runtime.buckets import all_buckets, joined, smallest_fit
    from ..runtime.engine import request_shape
    from . import settings as runtime_settings

    chosen = runtime_settings.apply(settings)
    require_cuda()
    print(f"# runtime settings {chosen}", flush=True)
    predictor = shape_only_predictor(SHAPE, graphs=False)
    mix = [pair for pair in serving_mix(4 * batch * groups, seed=11) if "image" not in pair[0]]
    sets = {"alone": [mix[index:index + 1] for index in range(groups)],
            f"{batch} together": [mix[index * batch:(index + 1) * batch] for index in range(groups)]}
    needed = set()
    for label, requests in sets.items():
        for group in list(requests):
            shape = joined(request_shape(predictor.encode_request(predictor.encode(*pair)[1])) for pair in group)
            bucket = smallest_fit(shape, all_buckets())
            if bucket is None:
                print(f"{label}: a group of {shape} fits no bucket; left out", flush=True)
                requests.remove(group)
            else:
                needed.add(bucket)
    started = time.perf_counter()
    ready = predictor.prepare_graphs(sorted(needed, key=lambda bucket: bucket.tokens))
    print(f"{ready} buckets captured in {time.perf_counter() - started:.1f} s: "
          f"{sorted(needed, key=lambda bucket: bucket.tokens)}", flush=True)
    for label, requests in sets.items():
        for group in requests:  # first sight
            predictor.predict_many(group)
        times = []
        for _ in range(3):
            for group in requests:
                torch.cuda.synchronize()
                begun = time.perf_counter()
                predictor.predict_many(group)
                torch.cuda.synchronize()
                times.append(1000 * (time.perf_counter() - begun))
        print(f"{label}: p50 {statistics.median(times):.1f} ms, min {min(times):.1f} ms over {len(times)} calls; "
              f"{predictor.engine.scores.stats}", flush=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as profiler:
            for group in requests:
                predictor.predict_many(group)
            torch.cuda.synchronize()
        print(profiler.key_averages().table(sort_by="cuda_time_total", row_limit=top, max_name_column_width=70),
              flush=True)


def serving_ceiling(requests: int = 512, matrix_tflops: float = 800.0, bandwidth_tbps: float = 4.3) -> None:
    """The roofline ceiling of the serving mix (`records.mix_ceiling`): each of its first
    `requests` requests' useful work on the shape-only Qwen3.5-0.8B in bf16, at `matrix_tflops`
    and `bandwidth_tbps` (the H200's as measured on the test machine by default; the datasheet's
    989.5 and 4.8 give the other bound); the most requests and decisions a second the device
    could answer doing only that work. Encodes only: runs anywhere.

        python benchmarks/run.py serving_ceiling --requests 512 > ceiling.json
    """
    from .records import mix_ceiling

    predictor = shape_only_predictor(SHAPE, "cpu", graphs=False)
    ceilings = {"device": "NVIDIA H200", "matrix_flops_per_s": matrix_tflops * 1e12,
                "bandwidth_bytes_per_s": bandwidth_tbps * 1e12, "vector_flops_per_s": None}
    ceiling = mix_ceiling(predictor, serving_mix(requests), ceilings)
    print(json.dumps({"workload": "serving_mix_ceiling", **ceiling, "matrix_tflops": matrix_tflops,
                      "bandwidth_tbps": bandwidth_tbps, "shape_only": SHAPE,
                      "environment": {"base": f"shape-only:{SHAPE}", "dtype": "bfloat16"}}))


def bucket_padding(requests: int = 512, depths: tuple[int, ...] = (1, 8, 32)) -> None:
    """How much of a bucket's work is padding on the serving mix: its requests in arrival order,
    taken from a queue kept `depth` deep (as a saturated engine's loop sees it) as the engine
    takes them (`engine.plan`: while the joined shape fits a bucket, then as many as `densest`
    keeps by `Engine.cost`), each invocation padded to its smallest bucket
    (`buckets.all_buckets`); beside it, every admitted request taken (`fullest`, the engine's
    rule before `densest`). Per depth and rule: invocations, mean requests an invocation,
    computed and useful tokens, the padding share, the cost (bucket tokens and
    `engine.INVOCATION_TOKENS` an invocation) a useful token, and the share of invocations that
    fit no bucket. The cost is the model `densest` maximises, so its figure is an estimate of the
    device's time a useful token, not a measurement of it. Encodes only: runs anywhere.

        python benchmarks/run.py bucket_padding --requests 512 --depths 1 8 32 > padding.json

    Raises:
        ValueError: a depth below 1.
    """
    from ..runtime.buckets import Ladder, all_buckets, joined, smallest_fit
    from ..runtime.engine import INVOCATION_TOKENS, bucket_cost, plan, request_shape

    if not depths or min(depths) < 1:
        raise ValueError(f"queue depths are whole numbers of requests from 1: got {list(depths)}")

    predictor = shape_only_predictor(SHAPE, "cpu", graphs=False)
    encoded = [predictor.encode_request(predictor.encode(*pair)[1]) for pair in serving_mix(requests)]
    buckets = Ladder(all_buckets())

    def admits(first, together):
        return smallest_fit(together, buckets) is not None

    def cost(shape):
        return bucket_cost(shape, buckets)

    found = {}
    for depth in depths:
        for rule, priced in (("densest", cost), ("fullest", None)):  # the engine's rule, and the one before
            invocations, useful, computed, unfit, queue, arriving = 0, 0, 0, 0, [], iter(encoded)
            while True:
                queue += [request for _, request in zip(range(depth - len(queue)), arriving)]
                if not queue:
                    break
                planned = plan(queue, admits, priced)
                lead = planned[0][0]
                if len(lead.rows) < len(queue[lead.request].rows):  # a request split by rows: all its parts
                    parts, taken = [pieces for pieces in planned if pieces[0].request == lead.request], 1
                else:
                    parts, taken = planned[:1], len(planned[0])
                for pieces in parts:
                    shape = joined(request_shape(queue[piece.request], piece.rows) for piece in pieces)
                    bucket = smallest_fit(shape, buckets)
                    invocations += 1
                    useful += shape.tokens
                    unfit += bucket is None
                    computed += shape.tokens if bucket is None else bucket.tokens
                queue = queue[taken:]
            found[f"{depth}_{rule}"] = {
                "depth": depth, "rule": rule, "invocations": invocations,
                "requests_per_invocation": len(encoded) / invocations, "useful_tokens": useful,
                "computed_tokens": computed, "padding_share": 1 - useful / computed,
                "cost_per_useful_token": (computed + INVOCATION_TOKENS * invocations) / useful,
                "unfit_share": unfit / invocations}
    print(json.dumps({"workload": "serving_bucket_padding", "requests": len(encoded), "buckets": len(buckets.buckets),
                      "depths": found, "shape_only": SHAPE,
                      "environment": {"base": f"shape-only:{SHAPE}", "dtype": "bfloat16"}}))
