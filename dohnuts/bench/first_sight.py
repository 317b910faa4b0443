"""Where a first-seen request's time goes on the GPU: the eager forward by delta-rule route, one
image miss step by step, and the varied-traffic and evaluation records summarised."""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

import torch

from ..inputs.pixels import image_key
from ..io import write_json
from ..model.vision import image_features
from . import settings as runtime_settings
from .evaluation import evaluation_throughput_record
from .host import SHAPE, require_cuda, timed_samples
from .long_context import long_context_record
from .protocol import workloads
from .shapes import shape_only_predictor
from .traffic import percentile, varied_requests
from .varied import real_traffic_record, varied_traffic_record


def _line(label: str, samples: list[float]) -> None:
    print(f"{label:46s} p50 {statistics.median(samples):8.3f} ms  p95 {percentile(samples, 0.95):8.3f}  "
          f"min {min(samples):8.3f}  n={len(samples)}", flush=True)


@torch.no_grad()
def eager_forwards(predictor, count: int) -> None:
    """The eager language forward of the text requests among `count` varied requests, through
    our delta-rule kernels and through FLA's chunked ones: p50, p95 and the largest logit gap."""
    model, device = predictor.model, predictor.model.device
    batches = [predictor.encode(state, questions)[0].to(device)
               for state, questions in varied_requests(count, seed=0) if "image" not in state]
    from ..ops.delta_rule import scan as ops  # the bound kernels.delta_rule reads

    routes = {"ours (delta_rule_rows + delta_rule_scan)": (ops.SCAN_TOKENS, ops.FORWARD_TOKENS),
              "FLA chunked for prefixes, long rows": (0, 0)}
    logits = {}
    for label, (scan_tokens, forward_tokens) in routes.items():
        ops.SCAN_TOKENS, ops.FORWARD_TOKENS = scan_tokens, forward_tokens
        try:
            for batch in batches[:4]:  # compile and autotune outside the timing
                model(batch)
            samples, outputs = [], []
            for batch in batches:
                out = []
                samples += timed_samples(lambda: out.append(model(batch)), 1)  # noqa: B023 - called at once
                outputs.append(out[0])
            logits[label] = outputs
            _line(f"eager forward, {label}", samples)
        finally:
            ops.SCAN_TOKENS, ops.FORWARD_TOKENS = routes["ours (delta_rule_rows + delta_rule_scan)"]
    ours, fla = logits.values()
    difference = max((a - b).abs().max().item() for a, b in zip(ours, fla))
    tokens = [batch.computed_tokens for batch in batches]
    print(f"{len(batches)} text requests of {min(tokens)} to {max(tokens)} computed tokens; largest logit "
          f"difference ours vs FLA: {difference:.3e}", flush=True)


@torch.no_grad()
def image_miss(predictor) -> None:
    """One image miss of `vision_protocol_image_1q`, step by step, and `predict` cold and warm."""
    state, questions = workloads()["vision_protocol_image_1q"]
    image, template, model = state["image"], predictor.template, predictor.model
    _line("image_key (content hash)", timed_samples(lambda: image_key(image), 20))
    _line("encode_image on the host (decode to bytes)", timed_samples(lambda: template.encode_image(image), 20))
    encoded = template.encode_image(image)
    device = model.device
    _line("bytes to the device", timed_samples(lambda: encoded.pixel_values.to(device), 20))
    _line("patches on the device", timed_samples(lambda: encoded.patches(device), 20))
    pixels, grid = encoded.patches(device), encoded.grid_thw
    visual = model.backbone.visual
    image_features(visual, pixels, grid, model.vision_plans)
    _line(f"vision tower, ours (grid {grid.tolist()}, plan cached)",
          timed_samples(lambda: image_features(visual, pixels, grid, model.vision_plans), 20))
    _line("vision tower, ours, plan made", timed_samples(lambda: image_features(visual, pixels, grid, {}), 20))
    on_device = grid.to(device)
    _line("vision tower, Hugging Face's forward",
          timed_samples(lambda: visual(pixels.to(visual.dtype), grid_thw=on_device), 20))
    graphs = model.vision_graphs
    _line("vision tower, ours through its CUDA graph",
          timed_samples(lambda: image_features(visual, pixels, grid, model.vision_plans, graphs), 20))

    def miss():
        model.image_cache.clear()
        predictor.predict(state, questions)

    miss()
    _line("predict, image-feature cache emptied", timed_samples(miss, 20))
    _line("predict, cache warm", timed_samples(lambda: predictor.predict(state, questions), 20))


def traffic_and_evaluation(predictor) -> None:
    """The benchmark's varied-traffic workload and evaluation throughput, summarised."""
    record = varied_traffic_record(predictor, 60)
    for name in ("first_sight", "second_pass"):
        part = record[name]
        print(f"varied traffic, {name.replace('_', ' ')}: p50 {part['p50_ms']:.2f} p95 {part['p95_ms']:.2f} "
              f"p99 {part['p99_ms']:.2f} ms, text p50 {part['text_p50_ms']:.2f}, image p50 {part['image_p50_ms']:.2f}; "
              f"{part['timed_calls']}", flush=True)
    with tempfile.TemporaryDirectory() as scratch:
        record = evaluation_throughput_record(predictor.model, predictor.template, predictor.config.max_tokens,
                                              Path(scratch))
    print(f"evaluation: {record['rows']} rows, {record['images']} images, {record['batches']} batches: "
          f"{record['overlapped_rows_per_second']:.1f} rows/s overlapped, "
          f"{record['synchronous_rows_per_second']:.1f} synchronous", flush=True)


def first_sight(count: int = 80) -> None:
    """Where a first-seen request's time goes on the GPU.

        python benchmarks/run.py first_sight --count 80 > first-sight.txt   # --count 0 skips part 1

    On the shape-only Qwen3.5-0.8B predictor the benchmark stage times (random weights, bf16, the
    real tokenizer), over the benchmark's varied-traffic requests (each a layout no graph holds):

    1. the eager language forward (`DecisionModel.forward`, no CUDA graph) of every text request
       among `count`, with the delta rule through our kernels (`delta_rule_rows`,
       `delta_rule_scan`: what the runtime runs) and again through FLA's chunked kernels for
       prefixes and long rows (what ran before): p50, p95 and the largest difference of logits
       between the two;
    2. one image miss of `vision_protocol_image_1q`, step by step: the content hash, the host
       part of the encoding (the decode), the copy, the patches on the device, the vision tower
       (ours with its per-grid plan cached and made afresh, Hugging Face's forward, ours through
       its CUDA graph), and the whole `predict` with the image-feature cache emptied first;
    3. the benchmark's varied-traffic workload and evaluation throughput, summarised.
    Every timing is bracketed by device synchronisations.
    """
    require_cuda()
    predictor = shape_only_predictor(SHAPE)
    if count:
        eager_forwards(predictor, count)
    image_miss(predictor)
    traffic_and_evaluation(predictor)


def real_traffic_measurement(count: int = 80, seed: int = 37, out: str | None = None,
                             settings: tuple[str, ...] = (), mix: str = "real") -> None:
    """The real-traffic workload on the shape-only Qwen3.5-0.8B predictor (graphs captured, the
    warm-up run, as a server loads): first-sight p50/p99/max, text and image p50, Triton's
    compiles and autotunes on the timed requests, Hugging Face on the same; the record as JSON
    to `out`, with the runtime's settings (`bench.settings`: `settings` changes them first, as
    "swiglu.BY_ROWS=1"). With `mix` "serving" the requests are the load harness's serving mix
    instead, one at a time in this process: the floor under the server's one-client figures.

        python benchmarks/run.py real_traffic --count 80 --out real.json
    """
    chosen = runtime_settings.apply(settings)
    record = real_traffic_record(shape_only_predictor(SHAPE), count, seed, mix=mix)
    record["settings"], record["shape_only"] = chosen, SHAPE  # the ledger's label of the model
    part = record["first_sight"]
    print(f"{mix} traffic, {record['requests']} requests ({record['image_requests']} with an image) on first sight: "
          f"p50 {part['p50_ms']:.2f} p99 {part['p99_ms']:.2f} max {part['max_ms']:.2f} ms; text p50 "
          f"{part['text_p50_ms']:.2f}, image p50 {part['image_p50_ms']:.2f}; engine stages p50 "
          f"{ {stage: round(ms, 2) for stage, ms in part['engine_stages_p50_ms'].items()} }; "
          f"{part['timed_calls']}; Hugging Face "
          f"p50 {record['hugging_face_p50_ms']:.2f} p99 {record['hugging_face_p99_ms']:.2f} max "
          f"{record['hugging_face_max_ms']:.2f}; {record['buckets']} buckets ready "
          f"({record['failed_bucket_captures']} failed) in {record['bucket_prepare_seconds']:.1f} s", flush=True)
    if out is not None:
        write_json(Path(out), record)


def long_context_measurement(lengths: tuple[int, ...] = (8192, 32768, 65536), out: str | None = None,
                             settings: tuple[str, ...] = ()) -> None:
    """The long-context workload on the shape-only Qwen3.5-0.8B predictor (graphs captured, the
    warm-up run, as a server loads): a line per request, and the record as JSON to `out`, with
    the runtime's settings (`settings` as `real_traffic_measurement`'s).

        python benchmarks/run.py long_context --lengths 8192 32768 65536 --out long.json
    """
    chosen = runtime_settings.apply(settings)
    record = long_context_record(shape_only_predictor(SHAPE), lengths)
    record["settings"], record["shape_only"] = chosen, SHAPE  # the ledger's label of the model
    for request in record["requests"]:
        if "refused" in request:
            print(f"{request['target_tokens']:6d} tokens: refused: {request['refused']}", flush=True)
            continue
        memory = request["peak_memory_bytes"]
        print(f"{request['computed_tokens']:6d} tokens ({request['rows']} rows): first sight "
              f"{request['first_sight_ms']:.1f} ms, again {request['second_ms']:.1f} ms, "
              f"{request['computed_tokens_per_second']:.0f} tokens/s, peak memory "
              f"{'n/a' if memory is None else f'{memory / 2**30:.2f} GiB'}; {request['timed_calls']}", flush=True)
    if out is not None:
        write_json(Path(out), record)
