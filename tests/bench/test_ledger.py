"""The figures ledger: entries from benchmark records and pytest logs, append-only writes, and the
Markdown rendered from it (docs/figures.md, the README's figures block)."""

import importlib.util
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from dohnuts.bench import curve, figures, ledger

ROOT = Path(__file__).resolve().parents[2]
SHAPE_ONLY = {"device": "NVIDIA H200", "base": "shape-only:qwen3_5-0.8b", "shape_only": True, "slow_paths": {}}


def records() -> list[dict]:
    """One record of each shape the benchmark stage writes, cut down to what the ledger reads."""
    return [
        {"workload": "distinct_text_50q", "p50_ms": 6.35, "p95_ms": 6.4, "hugging_face_p50_ms": 48.0,
         "computed_tokens": 1626, "samples_ms": [6.3, 6.35, 6.4], "hugging_face_samples_ms": [47.0, 48.0, 49.0],
         "timed_calls": {"graph_replays": 3, "graph_captures": 0, "bucket_replays": 0, "eager": 0},
         "roofline": {"efficiency": {"measured": 0.335, "datasheet": 0.3}},
         "telemetry": {"cuda_memory": {"peak_allocated_mib": 11799.0}}, "environment": SHAPE_ONLY},
        {"workload": "varied_traffic", "requests": 3, "hugging_face_p50_ms": 63.9, "hugging_face_samples_ms": [60.0],
         "first_sight": {"p50_ms": 4.67, "p99_ms": 9.24, "samples_ms": [4.0, 4.67, 9.3],
                         "timed_calls": {"bucket_replays": 3, "eager": 0, "padding_tokens": 12}},
         "second_pass": {"p50_ms": 4.64, "p99_ms": 6.5, "samples_ms": [4.1, 4.64, 6.6]}, "environment": SHAPE_ONLY},
        {"workload": "evaluation_throughput", "rows": 204, "overlapped_rows_per_second": 1617.4,
         "synchronous_rows_per_second": 1627.4, "overlapped_seconds_samples": [0.13, 0.126, 0.125],
         "synchronous_seconds": 0.125, "environment": SHAPE_ONLY},
        {"workload": "serving", "requests": 16, "environment": SHAPE_ONLY, "levels": [
            {"clients": 1, "p50_ms": 6.09, "p95_ms": 10.1, "decisions_per_second": 651.1, "failed": 0, "lost": 0},
            {"clients": 8, "p50_ms": 40.3, "decisions_per_second": 799.4, "failed": 1, "lost": 0}]},
        {"workload": "training_update", "processes": 1, "p50_ms": 90.18, "samples_ms": [90.0, 90.18],
         "training_graphs": {"eager": 0, "replays": 2}, "environment": SHAPE_ONLY},
        {"workload": "training_update", "processes": 2, "p50_ms": 60.0, "commit": "abc1234",
         "environment": {**SHAPE_ONLY, "slow_paths": {"fla": "not installed"}}},
    ]


def entries(run="2026-12-02-1c7de04-run2", commit="1c7de04", date="2026-12-02", machine="H200 (machine F)"):
    return ledger.entries_from_records(records(), date, commit, machine, run)


def test_entries_from_records_pick_each_workloads_figures_samples_and_kind():
    made = {entry["workload"]: entry for entry in entries()}
    assert list(made) == ["distinct_text_50q", "varied_traffic", "evaluation_throughput", "serving",
                          "training_update", "training_update_2_processes"]
    replay = made["distinct_text_50q"]
    assert replay["kind"] == "replay" and replay["shape"] == "shape-only qwen3_5-0.8b"
    assert (replay["date"], replay["commit"], replay["machine"], replay["run"]) == (
        "2026-12-02", "1c7de04", "H200 (machine F)", "2026-12-02-1c7de04-run2")
    assert replay["figures"] == {"p50_ms": 6.35, "p95_ms": 6.4, "hugging_face_p50_ms": 48.0, "computed_tokens": 1626,
                                 "graph_replays": 3, "graph_captures": 0, "bucket_replays": 0, "eager": 0,
                                 "efficiency": 0.335, "peak_allocated_mib": 11799.0}
    assert replay["samples"] == {"samples_ms": [6.3, 6.35, 6.4], "hugging_face_ms": [47.0, 48.0, 49.0]}
    varied = made["varied_traffic"]
    assert varied["kind"] == "varied"
    assert {key: varied["figures"][key] for key in ("first_sight_p50_ms", "first_sight_p99_ms",
                                                    "second_pass_p50_ms", "first_sight_bucket_replays")} == {
        "first_sight_p50_ms": 4.67, "first_sight_p99_ms": 9.24, "second_pass_p50_ms": 4.64,
        "first_sight_bucket_replays": 3}
    assert varied["samples"]["first_sight_ms"] == [4.0, 4.67, 9.3] and varied["samples"]["second_pass_ms"][1] == 4.64
    evaluation = made["evaluation_throughput"]
    assert evaluation["kind"] == "varied"
    assert evaluation["figures"] == {"rows": 204, "rows_per_second": 1617.4, "plain_loop_rows_per_second": 1627.4}
    # Without repeated passes the one timed pass is the sample.
    assert evaluation["samples"] == {"overlapped_seconds": [0.13, 0.126, 0.125], "plain_loop_seconds": [0.125]}
    serving = made["serving"]
    assert serving["kind"] == "serving" and "samples" not in serving
    assert serving["figures"]["clients_8_decisions_per_second"] == 799.4
    assert (serving["figures"]["failed"], serving["figures"]["lost"]) == (1, 0)
    training = made["training_update"]
    assert training["kind"] == "replay" and training["figures"]["graph_replays"] == 2
    two = made["training_update_2_processes"]
    assert two["commit"] == "abc1234"  # a record that names its commit keeps it
    assert two["note"] == "slower paths taken: fla"


def test_entries_from_records_refuse_two_records_of_one_workload():
    twice = [records()[0], records()[0]]
    with pytest.raises(ValueError, match="two records of 'distinct_text_50q'"):
        ledger.entries_from_records(twice, "2026-12-02", "1c7de04", "H200", "2026-12-02-1c7de04-run1")


def test_entries_from_pytest_count_each_summary_line_under_its_command():
    log = "\n".join([
        "## python3 -m pytest -q -m gpu tests/ops/test_kernels.py -k 'not slow' -p no:cacheprovider",
        "19 passed, 17 deselected, 20 warnings in 340.52s (0:05:40)",
        "# python3 -m pytest -m gpu -q tests/model",
        "........F",
        "FAILED tests/model/test_batch.py::test_something",
        "=========== 1 failed, 22 passed, 69 deselected, 16 warnings in 157.01s ===========",
    ])
    made = ledger.entries_from_pytest(log, "2026-12-02", "1c7de04", "H200", "2026-12-02-1c7de04-tests", "log.txt")
    assert [entry["workload"] for entry in made] == ["-m gpu tests/ops/test_kernels.py -k 'not slow'",
                                                     "-m gpu tests/model"]
    assert [entry["figures"] for entry in made] == [
        {"passed": 19, "failed": 0, "deselected": 17, "seconds": 340.52},
        {"passed": 22, "failed": 1, "deselected": 69, "seconds": 157.01}]
    assert {entry["kind"] for entry in made} == {"tests"}
    assert made[1]["command"] == "python3 -m pytest -m gpu -q tests/model"


def test_append_keeps_earlier_lines_byte_for_byte_and_refuses_a_recorded_run_and_workload(tmp_path):
    path = tmp_path / "ledger.jsonl"
    assert ledger.append(path, entries(run="2026-12-01-aaaaaaa-run1", commit="aaaaaaa", date="2026-12-01")) == 6
    before = path.read_bytes()
    assert ledger.append(path, entries()) == 6
    after = path.read_bytes()
    assert after.startswith(before) and len(after) > len(before)
    assert [json.loads(line)["run"] for line in after.decode().splitlines()] == (
        ["2026-12-01-aaaaaaa-run1"] * 6 + ["2026-12-02-1c7de04-run2"] * 6)
    with pytest.raises(ValueError, match="already holds"):
        ledger.append(path, entries()[:1])
    twice = entries(run="2026-12-03-1c7de04-run3")[:1] * 2
    with pytest.raises(ValueError, match="already holds"):
        ledger.append(path, twice)
    assert path.read_bytes() == after  # nothing of a refused append is written
    assert [path.name] == [child.name for child in tmp_path.iterdir()]  # no temporary file left behind


def test_append_refuses_a_malformed_entry_naming_the_offending_value(tmp_path):
    bad = {**entries()[0], "date": "02/12/2026"}
    with pytest.raises(ValueError, match=r"date '02/12/2026' is not YYYY-MM-DD"):
        ledger.append(tmp_path / "ledger.jsonl", [bad])
    with pytest.raises(ValueError, match="figures must map names to numbers"):
        ledger.append(tmp_path / "ledger.jsonl", [{**entries()[0], "figures": {"p50_ms": "fast"}}])
    assert not (tmp_path / "ledger.jsonl").exists()


def tiny_ledger() -> list[dict]:
    older = entries(run="2026-12-01-aaaaaaa-run1", commit="aaaaaaa", date="2026-12-01")
    older[0]["figures"]["p50_ms"] = 9.11
    run1 = entries(run="2026-12-02-1c7de04-run1", machine="H200 (machine D)")
    run1[0]["figures"]["p50_ms"] = 7.81
    tests = ledger.entry("2026-12-02", "1c7de04", "H200 (machine E)", "2026-12-02-1c7de04-tests", "gpu tests",
                         "tests", "the test suite", {"passed": 25, "failed": 0}, "log.txt",
                         command="python3 -m pytest -m gpu -q tests/model")
    return older + run1 + entries() + [tests]


def test_readme_table_takes_the_latest_run_with_the_spread_of_its_commits_runs():
    table = figures.readme_table(tiny_ledger())
    row = next(line for line in table.splitlines() if line.startswith("| distinct_text_50q"))
    assert row == ("| distinct_text_50q: p50 ms | **6.35** | replay | H200 (machine F) | 1c7de04 | 2026-12-02 | "
                   "6.35-7.81 (2 runs) |")
    serving = next(line for line in table.splitlines() if line.startswith("| serving, 8 clients"))
    assert "**799.4**" in serving
    cut_short = ledger.entry("2026-12-03", "bbbbbbb", "H200 (machine G)", "2026-12-03-bbbbbbb-run1", "serving",
                             "serving", "shape-only qwen3_5-0.8b", {"open_150_p99_ms": 95.0}, "serving.json",
                             note="an open-loop level only")
    later = figures.readme_table([*tiny_ledger(), cut_short])
    assert next(line for line in later.splitlines() if line.startswith("| serving, 8 clients")) == serving
    assert "shape-only qwen3_5-0.8b" in table and ledger.RENDER_COMMAND in table


def test_render_gives_each_workload_its_latest_figures_runs_by_commit_and_the_test_runs():
    text = figures.render(tiny_ledger())
    assert text.startswith("# Measured figures\n") and ledger.RENDER_COMMAND in text
    section = text[text.index("#### distinct_text_50q"):]
    section = section[: section.index("\n#### ", 1)]
    assert ("Latest: p50 ms 6.35, p95 ms 6.40, Hugging Face p50 ms 48.00, computed tokens 1,626, efficiency 0.335, "
            "peak allocated MiB 11,799 (H200 (machine F), 1c7de04, 2026-12-02, run `2026-12-02-1c7de04-run2`)."
            ) in section
    rows = [line for line in section.splitlines() if line.startswith("| 2026")]
    assert rows == ["| 2026-12-02 | 1c7de04 | 2 | H200 (machine D), H200 (machine F) | 6.35-7.81 | 6.40 | 48.00 |",
                    "| 2026-12-01 | aaaaaaa | 1 | H200 (machine F) | 9.11 | 6.40 | 48.00 |"]
    tests = text[text.index("## Test runs"):]
    assert ("| 2026-12-02 | 1c7de04 | H200 (machine E) | 25 | 0 | `python3 -m pytest -m gpu -q tests/model` |"
            in tests)
    assert text == figures.render(list(tiny_ledger()))  # the same ledger renders the same text


def test_update_markdown_rewrites_only_the_block_between_the_markers(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"# Title\n\nBefore.\n\n{figures.START}\nold table\n{figures.END}\n\nAfter.\n")
    assert figures.update_markdown(readme, tiny_ledger())
    text = readme.read_text()
    assert text.startswith(f"# Title\n\nBefore.\n\n{figures.START}\n") and text.endswith(f"\n{figures.END}\n\nAfter.\n")
    assert "old table" not in text and figures.readme_table(tiny_ledger()) in text
    assert not figures.update_markdown(readme, tiny_ledger())  # already current
    plain = tmp_path / "plain.md"
    plain.write_text(f"# No block\n{figures.START} but no end marker\n")
    assert not figures.update_markdown(plain, tiny_ledger())
    assert plain.read_text() == f"# No block\n{figures.START} but no end marker\n"


def test_record_command_appends_a_run_and_names_the_next_one_itself(tmp_path):
    spec = importlib.util.spec_from_file_location("ledger_command", ROOT / "benchmarks" / "ledger.py")
    command = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(command)
    source, path = tmp_path / "dohnuts.jsonl", tmp_path / "ledger.jsonl"
    source.write_text("".join(json.dumps(record) + "\n" for record in records()))
    arguments = ["record", str(source), "--machine", "H200", "--commit", "1c7de04", "--date", "2026-12-02",
                 "--ledger", str(path)]
    for _ in range(2):
        result = CliRunner().invoke(command.main, arguments)
        assert result.exit_code == 0, result.output
    made = ledger.read(path)
    assert [entry["run"] for entry in made] == ["2026-12-02-1c7de04-run1"] * 6 + ["2026-12-02-1c7de04-run2"] * 6
    assert made[0]["source"] == source.name and made[0]["figures"]["p50_ms"] == 6.35
    result = CliRunner().invoke(command.main, [*arguments, "--run", "2026-12-02-1c7de04-run1"])
    assert result.exit_code != 0 and "already holds" in result.output


def test_docs_figures_md_is_the_render_of_the_ledger():
    ledger_path, markdown = ROOT / "benchmarks" / "ledger.jsonl", ROOT / "docs" / "figures.md"
    assert markdown.read_text() == figures.render(ledger.read(ledger_path)), (
        f"docs/figures.md differs from the ledger's render: run `{ledger.RENDER_COMMAND}`, never edit it by hand")


def test_docs_serving_curve_is_drawn_from_the_ledger():
    ledger_path, drawn = ROOT / "benchmarks" / "ledger.jsonl", ROOT / "docs" / "serving-curve.svg"
    assert drawn.read_text() == curve.serving_curve_svg(ledger.read(ledger_path)), (
        f"docs/serving-curve.svg differs from the ledger's drawing: run `{ledger.RENDER_COMMAND}`")


def test_the_serving_curve_marks_each_level_of_the_latest_serving_runs():
    def run(name, figures):
        return {"run": name, "machine": "H200", "shape": "shape-only qwen3_5-0.8b", "workload": "serving",
                "figures": figures}

    first = run("a", {"open_80_p99_ms": 50.0, "open_80_decisions_per_second": 800.0,
                      "clients_64_p99_ms": 384.0, "clients_64_decisions_per_second": 2110.0, "failed": 0})
    second = run("b", {"open_150_p99_ms": 90.0, "open_150_decisions_per_second": 1500.0,
                       "open_300_p99_ms": None, "open_300_decisions_per_second": 0.0})
    assert curve.levels(first) == [
        {"mode": "closed", "load": 64.0, "decisions_per_second": 2110.0, "p99_ms": 384.0},
        {"mode": "open", "load": 80.0, "decisions_per_second": 800.0, "p99_ms": 50.0}]
    second["figures"] |= {"clients_8_p99_ms": 70.0, "clients_8_decisions_per_second": 1400.0}
    cut_short = run("c", {"open_150_p99_ms": 95.0, "open_150_decisions_per_second": 1490.0})
    drawn = curve.serving_curve_svg([first, {"workload": "pytest"}, second, cut_short], runs=2)
    assert drawn.startswith("<svg") and drawn.count("<circle") == 4  # the unanswered level is left out
    assert "80/s" in drawn and "64 cl." in drawn and "150/s" in drawn and "p99 500 ms" in drawn
    assert "8 cl." in drawn and ">c<" not in drawn  # the run without closed loops is not drawn
    assert curve.serving_curve_svg([first, second, cut_short]).count("<circle") == 2  # the latest run by default
    assert curve.serving_curve_svg([{"workload": "pytest"}]) is None


def test_a_serving_record_of_the_load_harness_names_its_shape_and_open_loop_levels():
    """`benchmarks/run.py serving_workload` writes no environment, only `shape_only`: the entry
    still names the model (not "unknown model", which would start a model section of its own)."""
    record = {"workload": "serving", "requests": 4096, "shape_only": "qwen3_5-0.8b", "levels": [
        {"mode": "open", "offered_requests_per_second": 80.0, "p50_ms": 25.3, "p99_ms": 3065.5,
         "achieved_requests_per_second": 80.0, "no_answer": 1, "server": {"eager_share": 0.0}}]}
    made = ledger.entries_from_records([record], "2026-12-03", "84d6fca", "H200 (machine J)", "r")[0]
    assert made["shape"] == "shape-only qwen3_5-0.8b"
    assert made["figures"]["open_80_p99_ms"] == 3065.5 and made["figures"]["open_80_eager_share"] == 0.0
    assert made["figures"]["lost"] == 1


def test_an_entry_names_its_source_file_never_a_machines_path_and_keeps_nested_figures():
    record = {"workload": "serving_bucket_padding", "requests": 4, "environment": SHAPE_ONLY,
              "depths": {"8": {"padding_share": 0.2, "invocations": 1}}}
    made = ledger.entries_from_records([record], "2026-12-03", "9df1c00", "CPU, 2 cores", "r", "padding.json")[0]
    assert made["figures"] == {"requests": 4, "depths_8_padding_share": 0.2, "depths_8_invocations": 1}
    with pytest.raises(ValueError, match="a path of one machine"):
        ledger.check({**made, "source": "/work/scratch/padding.json"})
    assert all(not entry["source"].startswith("/") for entry in ledger.read(ROOT / "benchmarks" / "ledger.jsonl"))


def test_record_keeps_the_files_name_and_the_command(tmp_path):
    spec = importlib.util.spec_from_file_location("ledger_script", ROOT / "benchmarks" / "ledger.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    source = tmp_path / "deep" / "serving.json"
    source.parent.mkdir()
    source.write_text(json.dumps(records()[3]) + "\n")
    path = tmp_path / "ledger.jsonl"
    done = CliRunner().invoke(script.main, ["record", str(source), "--machine", "H200", "--commit", "abc1234",
                                            "--command", "python benchmarks/run.py serving_workload",
                                            "--ledger", str(path)])
    assert done.exit_code == 0, done.output
    made = ledger.read(path)[0]
    assert made["source"] == "serving.json" and made["command"] == "python benchmarks/run.py serving_workload"


def test_record_takes_a_measurements_indented_json_record_and_names_its_shape(tmp_path):
    """`benchmarks/run.py real_traffic --out real.json` writes one indented JSON object naming its
    shape-only model: the ledger records it as it is, labelled with that shape."""
    spec = importlib.util.spec_from_file_location("ledger_measurement", ROOT / "benchmarks" / "ledger.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    record = {"workload": "real_traffic", "requests": 2, "image_requests": 1, "shape_only": "qwen3_5-0.8b",
              "buckets": 243, "bucket_prepare_seconds": 51.3, "failed_bucket_captures": 0,
              "first_sight": {"p50_ms": 11.5, "p99_ms": 22.5, "samples_ms": [11.5, 22.5]}}
    source, path = tmp_path / "real.json", tmp_path / "ledger.jsonl"
    source.write_text(json.dumps(record, indent=2))
    done = CliRunner().invoke(script.main, ["record", str(source), "--machine", "H100", "--commit", "abc1234",
                                            "--ledger", str(path)])
    assert done.exit_code == 0, done.output
    made = ledger.read(path)
    assert len(made) == 1 and made[0]["shape"] == "shape-only qwen3_5-0.8b"
    assert made[0]["figures"]["first_sight_p50_ms"] == 11.5 and made[0]["figures"]["requests"] == 2
    assert made[0]["figures"]["buckets"] == 243 and made[0]["figures"]["bucket_prepare_seconds"] == 51.3
    assert made[0]["figures"]["failed_bucket_captures"] == 0


def test_the_serving_mix_first_sights_are_read_as_real_traffic_is():
    """`real_traffic --mix serving` writes workload real_traffic_serving_mix: a varied entry with
    the first-sight figures and samples real_traffic's get."""
    record = {"workload": "real_traffic_serving_mix", "requests": 2, "image_requests": 0, "shape_only": "qwen3_5-0.8b",
              "first_sight": {"p50_ms": 9.5, "p99_ms": 19.5, "samples_ms": [9.5, 19.5]}}
    made = ledger.entries_from_records([record], "2026-12-07", "fe2727c", "H100", "r")[0]
    assert made["kind"] == "varied" and made["figures"]["first_sight_p99_ms"] == 19.5
    assert made["samples"]["first_sight_ms"] == [9.5, 19.5]


def test_a_load_time_record_gives_each_loads_steps_under_its_kernel_cache():
    """`load_time` loads cold, then warm: each load's total, steps, compiles and buckets apart."""
    def run(cache, read, graphs, compiled):
        return {"kernel_cache": cache, "seconds": {"read": read, "bucket graphs": graphs, "warm-up": 1.0},
                "total_seconds": read + graphs + 1.0, "process_seconds": read + graphs + 9.0,
                "triton_compiles": {"read": 0, "bucket graphs": compiled,
                                                                          "warm-up": 0},
                "buckets": 243, "failed_bucket_captures": 0}
    record = {"workload": "load_time", "shape_only": "qwen3_5-0.8b",
              "runs": [run("cold", 20.0, 90.0, 40), run("warm", 12.0, 50.0, 0), run("warm", 11.0, 49.0, 0)]}
    [made] = ledger.entries_from_records([record], "2026-12-07", "abc1234", "H200", "r")
    figures = made["figures"]
    assert made["kind"] == "profile" and made["shape"] == "shape-only qwen3_5-0.8b"
    assert figures["cold_total_seconds"] == 111.0 and figures["cold_bucket_graphs_seconds"] == 90.0
    assert figures["cold_process_seconds"] == 119.0
    assert figures["cold_triton_compiles"] == 40 and figures["warm_triton_compiles"] == 0
    assert figures["warm_read_seconds"] == 12.0 and figures["warm_2_read_seconds"] == 11.0
    assert figures["warm_warm_up_seconds"] == 1.0 and figures["warm_buckets"] == 243
