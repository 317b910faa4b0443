"""`dohnuts predict`: one answer line per request line, invalid lines answered with their error,
resumable after a kill."""

import json

import pytest
from click.testing import CliRunner
from PIL import Image

from dohnuts import Predictor
from dohnuts.cli import main
from dohnuts.serve.batch_predict import answered_lines, input_lines, predict_file

QUESTIONS = {"refund": {"type": "noul", "instructions": "Refund?"},
             "team": {"type": "choice", "instructions": "Which team?", "criteria": ["billing", "tech"]}}


@pytest.fixture(scope="module")
def predictor(deployable):
    root, _ = deployable
    return Predictor.from_checkpoint(root / "checkpoint", device="cpu")


def _requests(folder, count=9):
    (folder / "images").mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (48, 48), (30, 60, 200)).save(folder / "images" / "blue.png")
    lines = []
    for index in range(count):
        state = {"message": f"request {index}"} if index % 3 else {"note": "a photo", "image": "images/blue.png"}
        lines.append(json.dumps({"id": f"q-{index}", "state": state, "questions": QUESTIONS}))
    lines[min(4, count - 1)] = json.dumps({"id": "bad", "state": "s", "questions": {}})  # invalid: no question
    if count > 6:
        lines[6] = "{broken json"
    (folder / "requests.jsonl").write_text("\n".join(lines) + "\n")
    return folder / "requests.jsonl", lines


def test_every_line_gets_its_answer_or_its_error_in_order(tmp_path, predictor):
    source, lines = _requests(tmp_path)
    counts = predict_file(predictor, source, tmp_path / "answers.jsonl", chunk=4, progress=False)
    assert counts == {"lines": 9, "skipped": 0, "answered": 7, "errors": 2}
    out = [json.loads(line) for line in (tmp_path / "answers.jsonl").read_text().splitlines()]
    assert [item["line"] for item in out] == list(range(1, 10))
    assert out[4]["id"] == "bad" and "questions is empty" in out[4]["error"]
    assert out[6]["id"] is None and "JSONDecodeError" in out[6]["error"]
    image = Image.open(tmp_path / "images" / "blue.png").convert("RGB")
    for index in (0, 1, 3):
        state = {"note": "a photo", "image": image} if index % 3 == 0 else {"message": f"request {index}"}
        alone = predictor.predict(state, QUESTIONS)["answers"]
        assert out[index]["id"] == f"q-{index}"
        assert out[index]["answers"]["team"]["probabilities"] == pytest.approx(alone["team"]["probabilities"],
                                                                               abs=1e-5)


def test_a_line_of_several_images_is_answered_as_predict_answers_them(tmp_path, predictor):
    (tmp_path / "images").mkdir()
    pictures = []
    for index, colour in enumerate([(220, 20, 20), (20, 220, 20), (20, 20, 220)]):
        picture = Image.new("RGB", (48, 40 + 8 * index), colour)
        picture.save(tmp_path / "images" / f"{index}.png")
        pictures.append(picture)
    state = {"photos": ["images/0.png", "images/1.png"], "note": "a listing",
             "detail": {"label": "images/2.png", "again": "images/0.png"}}
    (tmp_path / "requests.jsonl").write_text(json.dumps({"id": "four", "state": state, "questions": QUESTIONS}) + "\n")
    predict_file(predictor, tmp_path / "requests.jsonl", tmp_path / "answers.jsonl", progress=False)
    (out,) = [json.loads(line) for line in (tmp_path / "answers.jsonl").read_text().splitlines()]
    alone = predictor.predict({"photos": pictures[:2], "note": "a listing",
                               "detail": {"label": pictures[2], "again": pictures[0]}}, QUESTIONS)
    assert out["usage"]["images"] == 4
    for qid, answer in alone["answers"].items():
        assert out["answers"][qid]["probabilities"] == pytest.approx(answer["probabilities"], abs=1e-5)


class Killed(Exception):
    pass


def test_a_rerun_after_a_kill_keeps_what_was_answered_and_finishes(tmp_path, predictor):
    source, _ = _requests(tmp_path)
    output = tmp_path / "answers.jsonl"
    calls = []

    class DiesOnTheSecondChunk:
        def predict_many(self, requests, errors="raise"):
            calls.append(len(requests))
            if len(calls) == 2:
                raise Killed
            return predictor.predict_many(requests, errors=errors)

    with pytest.raises(Killed):
        predict_file(DiesOnTheSecondChunk(), source, output, chunk=3, progress=False)
    first = output.read_text()
    assert answered_lines(output, input_lines(source)) == 3
    with open(output, "a") as handle:
        handle.write('{"id": "q-3", "line": 4, "answ')  # a line cut by the kill
    counts = predict_file(predictor, source, output, chunk=3, progress=False)
    assert counts["skipped"] == 3 and counts["answered"] + counts["errors"] == 6
    text = output.read_text()
    assert text.startswith(first) and [json.loads(line)["line"] for line in text.splitlines()] == list(range(1, 10))
    assert predict_file(predictor, source, output, progress=False)["skipped"] == 9  # nothing left to do


def test_an_output_that_is_not_this_inputs_answers_is_left_alone(tmp_path, predictor):
    """A rerun appends only to this input's own answers: a file of something else (its last
    line without a newline), another input's answers or the input itself are refused, untouched."""
    source, _ = _requests(tmp_path)
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\nthe last line, no newline")
    other = tmp_path / "other.jsonl"
    other.write_text('{"id": "elsewhere", "line": 1, "answers": {}}\n')
    for output, message in ((notes, "line 1 is not the answer"), (other, "line 1 is not the answer"),
                            (source, "is the input file")):
        before = output.read_bytes()
        with pytest.raises(ValueError, match=message):
            predict_file(predictor, source, output, progress=False)
        assert output.read_bytes() == before


def test_a_line_separator_inside_a_json_string_does_not_split_a_request(tmp_path, predictor):
    """JSON text may hold U+2028 raw (json.dumps with ensure_ascii off writes it so): output line
    n still answers input line n."""
    source = tmp_path / "requests.jsonl"
    lines = [{"id": f"r{index}", "state": f"line\u2028separated {index}\u0085",
              "questions": {"q": {"type": "noul"}}} for index in range(3)]
    source.write_text("".join(json.dumps(line, ensure_ascii=False) + "\r\n" for line in lines), encoding="utf-8")
    counts = predict_file(predictor, source, tmp_path / "answers.jsonl", progress=False)
    assert counts == {"lines": 3, "skipped": 0, "answered": 3, "errors": 0}
    out = [json.loads(line) for line in (tmp_path / "answers.jsonl").read_text(encoding="utf-8").split("\n")[:-1]]
    assert [(line["id"], line["line"]) for line in out] == [("r0", 1), ("r1", 2), ("r2", 3)]


def test_the_predict_command_writes_the_answers(tmp_path, deployable):
    root, _ = deployable
    source, _ = _requests(tmp_path, count=5)
    result = CliRunner().invoke(main, ["predict", str(root / "checkpoint"), "--input", str(source),
                                       "--output", str(tmp_path / "out.jsonl"), "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert "4 answered, 1 invalid, 0 already answered of 5 lines" in result.output
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 5


def test_a_systemone_body_is_a_request_line_too(tmp_path, predictor):
    """A body as a client sends it (model, base64 assets, a placeholder inside a text, an x_
    field) is answered as `predict` answers the same state with the image in place."""
    import base64
    import io

    from dohnuts.schema import ImageText

    picture = Image.new("RGB", (40, 24), (200, 30, 30))
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    reference = "<image:" + "ab" * 16 + ">"
    body = {"model": "jev-latest", "x_trace_id": "t-1", "id": "wire-1", "state": {"note": f"see {reference} now"},
            "questions": QUESTIONS,
            "assets": {reference: {"type": "image", "format": "png",
                                   "data_base64": base64.b64encode(buffer.getvalue()).decode()}}}
    source = tmp_path / "bodies.jsonl"
    source.write_text(json.dumps(body) + "\n")
    counts = predict_file(predictor, source, tmp_path / "answers.jsonl", progress=False)
    assert counts["answered"] == 1, (tmp_path / "answers.jsonl").read_text()
    out = json.loads((tmp_path / "answers.jsonl").read_text())
    alone = predictor.predict({"note": ImageText(("see ", picture, " now"))}, QUESTIONS)
    assert out["id"] == "wire-1" and out["usage"] == alone["usage"]
    assert out["answers"]["refund"]["noul"] == pytest.approx(alone["answers"]["refund"]["noul"], abs=1e-5)
