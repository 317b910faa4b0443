"""The `dohnuts` command: the data doctor on the example records and on broken ones."""

import json
from pathlib import Path

from click.testing import CliRunner

from dohnuts.cli import main

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "support"


def test_doctor_reports_the_example_with_token_lengths_and_writes_json(tiny, tmp_path):
    report = tmp_path / "doctor.json"
    result = CliRunner().invoke(main, ["doctor", str(EXAMPLE), "--params", str(tmp_path / "none.yaml"),
                                       "--base", str(tiny.base), "--report", str(report)])
    assert result.exit_code == 0, result.output
    assert "168 valid records, 0 invalid" in result.output and "ticket_routing" in result.output
    data = json.loads(report.read_text())
    assert data["token_lengths_checked"] and set(data["groups"]) == {"product_photos", "ticket_routing"}
    urgency = data["groups"]["ticket_routing"]["types"]["score"]
    assert urgency["questions"] == 96 and urgency["soft_labels"] > 0
    assert data["groups"]["product_photos"]["images"]["count"] == 72


def test_doctor_exits_1_and_names_each_broken_line(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"state": "s", "questions": {}, "labels": {}}\nnot json\n')
    result = CliRunner().invoke(main, ["doctor", str(tmp_path), "--params", str(tmp_path / "none.yaml")])
    assert result.exit_code == 1
    assert f"{tmp_path / 'bad.jsonl'}:1: questions is empty" in result.output
    assert f"{tmp_path / 'bad.jsonl'}:2: not valid JSON" in result.output
    assert "token lengths not checked" in result.output


def test_public_fingerprint_prints_what_the_guard_matches_and_sources_show_the_cache(tmp_path):
    from dohnuts.data.guard import fingerprint, guarded

    texts = tmp_path / "benchmark.txt"
    texts.write_text("Is the refund owed?\n\n  IS the refund, owed  \n")
    result = CliRunner().invoke(main, ["public", "fingerprint", str(texts)])
    assert result.exit_code == 0, result.output
    lines = result.output.split()
    assert lines == [fingerprint("Is the refund owed?")] * 2  # case, punctuation and spacing do not matter
    assert guarded({"message": "is the refund owed"}, '{"message": "is the refund owed"}', frozenset(lines))
    assert not guarded({"message": "is a refund owed"}, "", frozenset(lines))
    params = tmp_path / "params.yaml"
    params.write_text(f"data:\n  source: public\n  cache: {tmp_path / 'cache'}\n  groups: [boolq]\n")
    result = CliRunner().invoke(main, ["public", "sources", "--params", str(params)])
    assert result.exit_code == 0, result.output
    assert "boolq" in result.output and "2 of 2 files missing" in result.output and "xnli" not in result.output


def test_a_params_file_that_is_not_yaml_or_not_utf8_is_one_clear_error(tmp_path):
    records = tmp_path / "records.jsonl"
    records.write_text('{"state": "s", "questions": {"q": {"type": "noul"}}, "labels": {"q": true}}\n')
    (tmp_path / "broken.yaml").write_text("model:\n  max_tokens: [1, 2\n")
    (tmp_path / "latin.yaml").write_bytes("model:\n  marker_token: caf\xe9\n".encode("latin-1"))
    for name, message in (("broken.yaml", "is not valid YAML"), ("latin.yaml", "is not UTF-8 text")):
        for arguments in (["doctor", str(records)], ["public", "sources"]):
            result = CliRunner().invoke(main, [*arguments, "--params", str(tmp_path / name)])
            assert result.exit_code == 1 and message in result.output, result.output
            assert result.exception is None or isinstance(result.exception, SystemExit)
