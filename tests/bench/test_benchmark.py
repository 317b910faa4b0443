"""The benchmark's training-update record on the CPU (tiny model)."""

import dataclasses

import pytest
import torch

from dohnuts import Predictor
from dohnuts.bench.baseline import distinct_tokens, padded_baseline
from dohnuts.bench.protocol import run_workload, workloads
from dohnuts.bench.records import environment
from dohnuts.bench.stage import describe
from dohnuts.bench.telemetry import measure_ceilings
from dohnuts.bench.training import training_update_record
from dohnuts.inputs.batch import Row
from dohnuts.model.base import load_backbone
from dohnuts.model.decision import new_head
from dohnuts.runtime.checkpoint import assemble


def test_training_update_record_steps_lora_only_and_counts_shared_prefixes(tiny):
    backbone = load_backbone(tiny.base, torch.float32)
    model = assemble(backbone, new_head(backbone.config.text_config.hidden_size, 0.01))
    frozen = {name: p.detach().clone() for name, p in model.named_parameters()}
    record, varied = training_update_record(model, tiny.template(), measure_ceilings(model.device), microbatches=2,
                                            rows=4, timed=1, varied=3)
    assert record["microbatches"] == 2 and record["rows_per_microbatch"] == 4
    # Rows of a state share their prefix: fewer tokens computed than given.
    assert 0 < record["computed_tokens"] < record["input_tokens"]
    assert record["p50_ms"] > 0 and record["tokens_per_second"] > 0
    roofline = record["roofline"]
    assert roofline["work"]["flops"]["total"] > 0
    # Useful work is the forward and the input gradients; the checkpointed recomputation is apart.
    repeated = roofline["repeated_work"]["flops"]
    assert 0 < repeated["total"] < roofline["work"]["flops"]["total"] / 2
    assert repeated["recurrence"] == 0  # a delta-rule layer recomputes only what follows the delta rule
    # peft renames a wrapped layer's own weight to base_layer.weight.
    after = {name.replace(".base_layer", ""): p for name, p in model.named_parameters()}
    changed = {name for name, p in after.items() if name not in frozen or not torch.equal(p, frozen[name])}
    assert changed and all("lora_" in name or name.startswith("head.") for name in changed)
    assert not model.training
    # Three more updates of distinct layouts, each timed once.
    assert varied["workload"] == "training_update_varied" and len(varied["samples_ms"]) == 3
    assert len(set(varied["computed_tokens"])) == 3 and record["computed_tokens"] not in varied["computed_tokens"]
    assert set(varied["training_graphs"].values()) == {0}  # the CPU's forward never reaches the training graphs
    assert describe(varied).startswith("training_update_varied") and "3 layouts" in describe(varied)
    assert describe(record).startswith("training_update") and "efficiency" in describe(record)


def test_shape_only_runs_give_the_published_token_counts_of_the_workloads():
    from dohnuts.bench.protocol import workloads
    from dohnuts.bench.training import training_requests
    from dohnuts.inputs.template import Template
    from dohnuts.inputs.vocabulary import qwen3_5_tokenizer
    from dohnuts.schema import parse_request

    template = Template(qwen3_5_tokenizer(), None, "<|fim_suffix|>")
    state, questions = workloads()["distinct_text_50q"]
    rows = template.encode(parse_request(state, questions, template.reserved), 4096)
    # benchmark-workloads.json: upstream's run reported input_shape [50, 113] and 5105 tokens.
    assert (len(rows), max(len(row.input_ids) for row in rows)) == (50, 113)
    assert sum(len(row.input_ids) for row in rows) == 5105
    # The training update's states grow to the token size asked for.
    for state, questions in training_requests(template, 1, 8, state_tokens=250):
        (row, *_) = template.encode(parse_request(state, questions, template.reserved), 2048)
        assert 250 <= row.shared < 250 + 20


def _rows(*sequences, shared=0, image=None):
    return [Row(tuple(ids), (len(ids) - 1,), None, shared, () if image is None else (image,)) for ids in sequences]


def test_repeated_prefix_tokens_count_what_the_padded_baseline_computes_twice():
    assert padded_baseline(_rows(range(39)))["repeated_prefix_tokens"] == 0  # one question: nothing repeated
    three = _rows([*range(40), 100], [*range(40), 101, 102], [*range(40), 103])  # 40 tokens shared by 3 rows
    assert distinct_tokens(three) == 40 + 1 + 2 + 1
    assert padded_baseline(three) == {"computed_tokens": 3 * 42, "padding_tokens": 3 * 42 - 41 - 42 - 41,
                                       "repeated_prefix_tokens": 2 * 40}
    # The same token ids after different images are different computations.
    assert distinct_tokens(_rows(range(5), image=0) + _rows(range(5), image=1)) == 10


def test_a_workload_record_counts_graph_replays_and_its_difference_to_hugging_face(deployable):
    root, _ = deployable
    predictor = Predictor.from_checkpoint(root / "checkpoint", device="cpu")
    state, questions = workloads()["distinct_text_5q"]
    record = run_workload(predictor, "distinct_text_5q", state, questions, warmup=1, timed=3,
                          ceilings=measure_ceilings("cpu", matrix_size=64, copy_bytes=2**20, repeats=2))
    assert record["timed_calls"] == {"graph_replays": 0, "graph_captures": 0, "bucket_replays": 0,
                                     "eager": 3}  # no graphs on a CPU
    assert 0 <= record["max_abs_logit_difference_to_hugging_face"] < 1e-4  # float32: summation order only
    assert record["hugging_face"]["repeated_prefix_tokens"] > 0  # 5 rows repeat the state
    by_bound = record["roofline"]["efficiency_by_bound"]["measured"]
    assert by_bound["t_lower"] == record["roofline"]["efficiency"]["measured"]
    # Stages one after another take at least as long as any one bound's total.
    assert by_bound["critical_path"] >= max(by_bound[name] for name in ("matrix", "vector", "recurrence", "memory"))
    assert "slow_paths" in environment(predictor)


def test_varied_traffic_times_each_distinct_layout_on_first_sight_then_again(deployable):
    from dohnuts.bench.varied import varied_traffic, varied_traffic_record
    from dohnuts.runtime.cuda_graphs import layout_key

    root, _ = deployable
    predictor = Predictor.from_checkpoint(root / "checkpoint", device="cpu")
    warm, timed = varied_traffic(predictor, 24, warmup=4)
    layouts = [layout_key(predictor.encode(*request)[0]) for request in warm + timed]
    assert len(set(layouts)) == len(layouts) == 28  # no request repeats another's or a warm-up's layout
    assert {len(questions) for _, questions in timed} >= {1, 10}
    assert any("image" in state for state, _ in timed) and any("image" not in state for state, _ in timed)
    images = [state["image"].tobytes() for state, _ in warm + timed if "image" in state]
    assert len(set(images)) == len(images)  # every image new to the feature cache
    record = varied_traffic_record(predictor, 8, warmup=2)
    assert record["requests"] == len(record["input_tokens"]) == 8 and min(record["input_tokens"]) > 0
    for name in ("first_sight", "second_pass"):
        measured = record[name]
        # The CPU: no graphs, no Triton. Each image is new on first sight (the tower runs) and cached after.
        vision = record["image_requests"] if name == "first_sight" else 0
        assert measured["timed_calls"] == {"graph_replays": 0, "graph_captures": 0, "bucket_replays": 0, "eager": 8,
                                           "padding_tokens": 0, "vision_replays": 0, "vision_captures": 0,
                                           "vision_bucket_replays": 0, "vision_eager": vision,
                                           "vision_padding_patches": 0, "triton_compiles": 0, "triton_autotunes": 0}
        assert len(measured["samples_ms"]) == 8
        assert min(measured["samples_ms"]) <= measured["p50_ms"] <= measured["p95_ms"] <= measured["p99_ms"]
        assert measured["p99_ms"] <= measured["max_ms"] == max(measured["samples_ms"])
    assert len(record["hugging_face_samples_ms"]) == 8 and record["image_requests"] > 0
    assert record["vision_buckets"] == [] and record["vision_bucket_prepare_seconds"] == 0.0  # CUDA only


def test_the_stage_echoes_every_record_even_when_a_step_adds_several(tmp_path, monkeypatch):
    """`run` rewrites the records file after each step and echoes one line per new record: the
    training step adds the repeated and the varied training records at once."""
    import json

    from dohnuts.bench import stage
    from dohnuts.config import BenchmarkConfig

    first = {"workload": "a", "rows": 1}
    pair = [{"workload": "b", "rows": 2}, {"workload": "c", "rows": 3}]

    def fake_benchmark(predictor, warmup, timed, progress=None, **_):
        progress([first])
        progress([first, *pair])
        return [], {}, []

    monkeypatch.setattr(stage.Predictor, "from_checkpoint", staticmethod(lambda path: None))
    monkeypatch.setattr(stage, "benchmark", fake_benchmark)
    lines = []
    stage.run(BenchmarkConfig(), tmp_path / "checkpoint", tmp_path / "records.jsonl", echo=lines.append)
    assert lines == [describe(first), *(describe(record) for record in pair)]
    written = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert written == [first, *pair]


def test_real_traffic_is_harder_than_the_serving_mix_and_its_own():
    from dohnuts.bench.traffic import REAL_IMAGE_SIDES, real_traffic, serving_mix

    requests = real_traffic(60)
    assert real_traffic(60)[5][1] == requests[5][1]  # seeded
    counts = [len(questions) for _, questions in requests]
    assert min(counts) <= 2 and max(counts) == 20
    options = [len(q["criteria"]) for _, questions in requests for q in questions.values() if q["type"] == "choice"]
    assert min(options) == 2 and max(options) >= 30
    described = [q for _, questions in requests for q in questions.values() if isinstance(q.get("criteria"), dict)]
    assert described and all(all(isinstance(text, str) and text for text in q["criteria"].values()) for q in described)
    words = [len(state["message"].split()) for state, _ in requests]
    assert min(words) <= 10 and max(words) >= 800
    images = [state["image"] for state, _ in requests if "image" in state]
    assert len(images) == 20  # a third
    assert all(REAL_IMAGE_SIDES[0] <= side <= REAL_IMAGE_SIDES[1] for image in images for side in image.size)
    assert len({image.size for image in images}) == len(images) and max(max(image.size) for image in images) > 800
    assert len({image.tobytes() for image in images}) == len(images)
    tickets = {state["ticket"] for state, _ in requests}
    assert not tickets & {state["ticket"] for state, _ in serving_mix(60)}


def test_real_traffic_times_each_request_once_and_counts_compiles(deployable):
    from dohnuts.bench.varied import real_traffic_record

    root, _ = deployable
    predictor = Predictor.from_checkpoint(root / "checkpoint", device="cpu")
    record = real_traffic_record(predictor, 4, warmup=2)
    assert record["requests"] == len(record["input_tokens"]) == len(record["hugging_face_samples_ms"]) == 4
    part = record["first_sight"]
    assert len(part["samples_ms"]) == 4 and part["max_ms"] == max(part["samples_ms"])
    assert part["timed_calls"]["triton_compiles"] == part["timed_calls"]["triton_autotunes"] == 0  # the CPU
    assert part["timed_calls"]["eager"] == 4 and record["image_requests"] == len(record["image_sides"]) >= 1
    assert record["hugging_face_max_ms"] >= record["hugging_face_p50_ms"] > 0
    # What the load prepared: nothing on the CPU (its forward is eager), nothing failed.
    assert record["buckets"] == record["failed_bucket_captures"] == record["bucket_prepare_seconds"] == 0
    # The engine's stages of each call: on the CPU `prepare` packs and `run` is the forward itself.
    stages = part["engine_stages_p50_ms"]
    assert 0 < stages["prepare"] < part["max_ms"] and stages["run"] > 0 and stages["queue"] == 0


def test_the_first_sight_pass_times_the_serving_mix_when_asked(deployable):
    """`mix="serving"` times the load harness's requests (the floor under the server's one-client
    figures) under its own workload name; an unknown mix is refused by name."""
    from dohnuts.bench.traffic import serving_mix
    from dohnuts.bench.varied import real_traffic_record

    root, _ = deployable
    predictor = Predictor.from_checkpoint(root / "checkpoint", device="cpu")
    record = real_traffic_record(predictor, 3, seed=5, warmup=1, mix="serving")
    assert record["workload"] == "real_traffic_serving_mix" and record["requests"] == 3
    assert record["questions"] == [len(questions) for _, questions in serving_mix(4, 5)[1:]]
    with pytest.raises(ValueError, match="unknown mix 'replayed'"):
        real_traffic_record(predictor, 1, mix="replayed")


def test_long_requests_meet_the_budgets_they_aim_at_and_past_them_are_refused(deployable):
    """Within a row's budget one question of the input tokens aimed at (to 1%); past it several,
    each row within the row budget and the request within its own; past the request budget,
    refused by name (never truncated)."""
    from dohnuts.bench.long_context import long_context_record

    root, _ = deployable
    predictor = Predictor.from_checkpoint(root / "checkpoint", device="cpu")
    predictor.config = dataclasses.replace(predictor.config, max_tokens=2048, max_request_tokens=4096)
    record = long_context_record(predictor, (1000, 3500, 9000))
    one, several, over = record["requests"]
    assert one["rows"] == 1 and 990 <= one["input_tokens"] <= 1010 and one["computed_tokens"] == one["input_tokens"]
    assert several["rows"] == 3 and 3000 <= several["computed_tokens"] <= 4096  # the state once, each question
    assert one["first_sight_ms"] > 0 and several["computed_tokens_per_second"] > 0
    assert one["peak_memory_bytes"] is None  # the CPU
    assert "budget of 4096" in over["refused"]
