"""The user's decision records: label forms, every bad-record error, isolation, pinning, formats."""

import base64
import io
import json

import pandas as pd
import pytest
from PIL import Image

from dohnuts.config import DataConfig, ModelConfig
from dohnuts.data.isolation import PARTITIONS
from dohnuts.data.records import partition_rows
from dohnuts.data.user_records import RecordsError, read_records
from dohnuts.pipeline.prepare import UntestedGroups, prepare

QUESTIONS = {
    "team": {"type": "choice", "instructions": "Which team?", "criteria": {"billing": "payments", "tech": ""}},
    "refund": {"type": "noul", "instructions": "Refund asked?"},
    "urgency": {"type": "score", "instructions": "How urgent?", "criteria": ["none", "low", "high"]},
}
FRACTIONS = {"train": 0.7, "dev": 0.1, "calibration": 0.1, "test": 0.1}


def _record(index, labels=None, **fields):
    return {"id": f"r-{index}", "state": {"message": f"message {index}"}, "questions": QUESTIONS,
            "labels": labels or {"team": "billing", "refund": True, "urgency": 2}, **fields}


def _write(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in records))
    return path


def _png(colour, **save) -> bytes:
    buffer = io.BytesIO()
    image = Image.new("RGB", (40, 40), "white")
    image.paste(colour, (5, 5, 30, 30))
    image.save(buffer, format="PNG", **save)
    return buffer.getvalue()


def test_every_label_form_becomes_the_target_in_candidate_order(tmp_path):
    forms = [
        ({"team": "tech", "refund": False, "urgency": 0}, {"team": [0, 1], "refund": [1, 0], "urgency": [1, 0, 0]}),
        ({"team": {"billing": 0.25, "tech": 0.75}, "refund": 0.9, "urgency": {"0": 0.0, "1": 0.3, "2": 0.7}},
         {"team": [0.25, 0.75], "refund": [0.1, 0.9], "urgency": [0.0, 0.3, 0.7]}),
        ({"team": {"tech": 1.0}, "refund": 1, "urgency": {"2": 1.0}},  # options left out have 0
         {"team": [0.0, 1.0], "refund": [0.0, 1.0], "urgency": [0, 0, 1]}),
    ]
    _write(tmp_path / "tickets.jsonl", [_record(i, labels) for i, (labels, _) in enumerate(forms)])
    states, problems = read_records(tmp_path)
    assert problems == []
    for state, (_, expected) in zip(states, forms):
        assert {qid: pytest.approx(values) for qid, values in expected.items()} == state.targets
        assert state.group == "tickets" and state.split is None and state.source == f"id:{state.state_id}"
    defaults = _write(tmp_path / "other" / "plain.jsonl", [{k: v for k, v in _record(9).items() if k != "id"}])
    (state,), _ = read_records(defaults)
    assert state.state_id == "plain.jsonl:1" and state.group == "plain"


def test_a_null_option_description_as_the_official_client_sends_it_is_read(tmp_path):
    questions = {**QUESTIONS, "team": {**QUESTIONS["team"], "criteria": {"billing": None, "tech": None}}}
    _write(tmp_path / "tickets.jsonl", [{**_record(0), "questions": questions}, _record(1)])
    states, problems = read_records(tmp_path)
    assert problems == [] and len(states) == 2
    assert states[0].targets["team"] == pytest.approx([1.0, 0.0])


def test_each_kind_of_mistake_is_one_clear_line_and_prepare_writes_nothing(tmp_path):
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "broken.png").write_bytes(b"not a png")
    mistakes = [
        "{not json",
        [1, 2],
        _record(2, extra=1),
        {"id": "r-3", "questions": QUESTIONS, "labels": {}},
        _record(4, {"team": "sales", "refund": True, "urgency": 2}),
        _record(5, {"team": {"billing": 0.5, "tech": 0.4}, "refund": True, "urgency": 2}),
        _record(6, {"team": "billing", "refund": True, "urgency": 2, "mood": "calm"}),
        _record(7, {"team": "billing", "refund": True}),
        _record(8, {"team": "billing", "refund": 1.5, "urgency": 2}),
        _record(9, {"team": "billing", "refund": True, "urgency": 3}),
        {**_record(10), "state": {"message": "x", "image": "images/missing.png"}},
        {**_record(11), "state": {"message": "x", "image": "images/broken.png"}},
        _record(12, split="validation"),
        {**_record(13), "questions": {"q": {"type": "choice", "instructions": "one option?", "criteria": ["a"]}},
         "labels": {"q": "a"}},
        {**_record(14), "state": "the marker <|fim_suffix|> inside"},
        {**_record(15), "state": {"message": "x", "image": "data:image/png;base64,@@@"}},
        {**_record(16), "state": {"photos": ["images/a.png"] * 3}},  # over model.max_images (2 here)
        {**_record(17), "state": {"message": "x", "image": "images/huge.png"}},  # over Pillow's pixel bound
        {**_record(18), "state": json.loads('{"k": ' * 900 + '"x"' + "}" * 900)},
    ]
    Image.new("RGB", (8, 8)).save(tmp_path / "images" / "a.png")
    Image.new("1", (20_000, 20_000)).save(tmp_path / "images" / "huge.png")  # 400 megapixels, a small file
    file = _write(tmp_path / "bad.jsonl", mistakes + [_record(19)])
    with open(file, "ab") as handle:
        handle.write(json.dumps(_record(20)).encode().replace(b"message 20", b"caf\xe9") + b"\n")  # Latin-1
    out = tmp_path / "runs" / "prepare"
    with pytest.raises(RecordsError) as caught:
        prepare(ModelConfig(max_images=2), DataConfig(source="records", path=str(tmp_path)), 2048, out / "base", out)
    assert not out.exists()  # nothing written, not even the base
    lines = str(caught.value).splitlines()[1:]
    expected = [
        (1, "not valid JSON"), (2, "must be a JSON object"), (3, "unknown keys ['extra']"), (4, "missing 'state'"),
        (5, "question team: unknown option 'sales'"), (6, "question team: soft label sums to 0.9, not 1"),
        (7, "question mood: a label for a question that is not asked"), (8, "question urgency: no label"),
        (9, "question refund: a noul label is true, false or P(true)"), (10, "question urgency: a score label is"),
        (11, "state.image: no such file images/missing.png"), (12, "cannot be decoded as an image"),
        (13, "split must be one of"), (14, "question 'q' has 1 candidates"),
        (15, "contains the reserved candidate marker"), (16, "not valid base64"),
        (17, "holds 3 images, over the limit of 2"), (18, "too large an image to decode"),
        (19, "nested too deep to read"), (21, "not UTF-8 text"),
    ]
    assert len(lines) == len(expected)
    for line, (number, reason) in zip(lines, expected):
        assert line.startswith(f"{file}:{number}: ") and reason in line, line
    states, problems = read_records(tmp_path, ("<|fim_suffix|>",), max_images=2)
    assert [state.state_id for state in states] == ["r-19"] and len(problems) == len(expected)


def test_every_mistake_of_one_record_is_listed_not_only_the_first(tmp_path):
    questions = {**QUESTIONS, "team": {**QUESTIONS["team"], "criteria": ["only"]},
                 "mood": {"type": "sentiment", "instructions": "How?"}}
    record = {**_record(0, {"team": "only", "refund": 2.0, "urgency": 2, "stray": 1}), "questions": questions,
              "split": "validation", "state": {"message": "x", "image": "images/missing.png"}}
    _write(tmp_path / "tickets.jsonl", [record])
    _, problems = read_records(tmp_path)
    reasons = sorted(str(problem).split(": ", 1)[1] for problem in problems)
    expected = ["question 'mood' has unknown type", "question 'team' has 1 candidates", "question refund: a noul label",
                "question stray: a label for a question that is not asked", "split must be one of",
                "state.image: no such file images/missing.png"]
    assert len(reasons) == len(expected)
    for reason, start in zip(reasons, sorted(expected)):
        assert reason.startswith(start), (reason, start)


def test_a_group_with_no_test_rows_stops_prepare_unless_allowed(tmp_path):
    _write(tmp_path / "tickets.jsonl", [_record(index) for index in range(40)])
    _write(tmp_path / "tiny.jsonl", [_record(100 + index, split="train") for index in range(3)])
    out = tmp_path / "runs" / "prepare"
    with pytest.raises(UntestedGroups, match=r"groups with no test rows, so never scored: \['tiny'\]"):
        prepare(ModelConfig(), DataConfig(source="records", path=str(tmp_path)), 2048, out / "base", out)
    assert not (out / "test").exists()  # no partition written
    summary = prepare(ModelConfig(), DataConfig(source="records", path=str(tmp_path), allow_untested_groups=True),
                      2048, out / "base", out)
    assert "tiny" not in summary["partitions"]["test"]["groups"] and summary["partitions"]["train"]["rows"] > 0


def test_skip_invalid_drops_bad_records_and_the_doctor_counts_them(tmp_path):
    _write(tmp_path / "records" / "tickets.jsonl", [_record(i) for i in range(30)] + ["{broken"])
    out = tmp_path / "runs"
    result = prepare(ModelConfig(image_pixels=64 * 64), DataConfig(source="records", path=str(tmp_path / "records"),
                                                                   skip_invalid=True), 2048, out / "base", out)
    report = result["doctor"]
    assert report["records"] == 30 and report["invalid_records"] == 1 and "not valid JSON" in report["problems"][0]
    assert sum(value["rows"] for value in result["partitions"].values()) == 30 * 3
    assert report["groups"]["tickets"]["tokens"]["row"]["max"] > 10


def test_a_re_encoded_image_and_a_text_in_two_groups_land_in_one_partition(tmp_path):
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "a.png").write_bytes(_png((200, 20, 20)))
    (tmp_path / "images" / "b.png").write_bytes(_png((200, 20, 20), compress_level=0))  # other bytes, same pixels
    assert (tmp_path / "images" / "a.png").read_bytes() != (tmp_path / "images" / "b.png").read_bytes()
    url = "data:image/png;base64," + base64.b64encode(_png((200, 20, 20), optimize=True)).decode()
    photos = [{**_record(i), "state": {"caption": f"caption {i}", "image": image}}
              for i, image in enumerate(["images/a.png", "images/b.png", url])]
    _write(tmp_path / "photos.jsonl", photos + [_record(10 + i) for i in range(40)])
    _write(tmp_path / "emails.jsonl", [{**_record(100), "state": {"message": "MESSAGE  13"}}])  # r-13 in photos
    states, problems = read_records(tmp_path)
    assert not problems
    for seed in range(10):
        records, _, report = partition_rows(states, seed, FRACTIONS)
        where = {row["state_id"]: name for name, rows in records.items() for row in rows}
        assert where["r-0"] == where["r-1"] == where["r-2"]
        assert where["r-100"] == where["r-13"]  # one text in two groups
        assert report["cross_partition"] == {"texts": 0, "images": 0}


def test_states_of_several_images_are_read_in_place_and_joined_by_any_shared_image(tmp_path):
    """Images under any key and in lists, as paths or data URLs, decoded in their places; a text
    that only mentions a file stays text; a state sharing any one image with another joins it;
    a nested missing file is named by its place."""
    (tmp_path / "images").mkdir()
    for name, colour in (("a", (200, 20, 20)), ("b", (20, 200, 20)), ("c", (20, 20, 200))):
        (tmp_path / "images" / f"{name}.png").write_bytes(_png(colour))
    url = "data:image/png;base64," + base64.b64encode(_png((90, 90, 90))).decode()
    pair = {"before": "images/a.png", "note": "see before.png for details", "after": ["images/b.png", url]}
    records = [{**_record(0), "state": pair},
               {**_record(1), "state": {"photos": ["images/c.png", "images/b.png"]}},  # shares b with r-0
               {**_record(2), "state": {"photos": ["images/c.png", {"inner": "images/missing.png"}]}}]
    _write(tmp_path / "pairs.jsonl", records + [_record(10 + i) for i in range(40)])
    states, problems = read_records(tmp_path)
    assert [str(problem).split(": ", 1)[1] for problem in problems] == [
        f"state.photos[1].inner: no such file images/missing.png (in {tmp_path})"]
    state = next(state for state in states if state.state_id == "r-0").state
    assert state["note"] == "see before.png for details" and isinstance(state["before"], Image.Image)
    assert [image.getpixel((10, 10)) for image in state["after"]] == [(20, 200, 20), (90, 90, 90)]
    for seed in range(6):
        written, files, report = partition_rows(states, seed, FRACTIONS)
        rows = {row["state_id"]: row for rows in written.values() for row in rows}
        assert rows["r-0"]["partition"] == rows["r-1"]["partition"]
        assert len(rows["r-0"]["images"]) == 3 and all(name in files for name in rows["r-0"]["images"])
        stored = json.loads(rows["r-0"]["state"])  # each image's file name in its place
        assert stored["before"] == rows["r-0"]["images"][0] and stored["after"] == rows["r-0"]["images"][1:]
        assert report["cross_partition"] == {"texts": 0, "images": 0}


def test_states_naming_one_photo_land_in_one_partition_whatever_their_pixels(tmp_path):
    (tmp_path / "images").mkdir()
    colours = [(200, 20, 20), (20, 200, 20), (20, 20, 200), (90, 90, 90)]
    for index, colour in enumerate(colours):  # four different images, two of them one photo
        (tmp_path / "images" / f"{index}.png").write_bytes(_png(colour))
    crops = [{**_record(i), "state": {"caption": f"crop {i}", "image": f"images/{i}.png"},
              "photo": "coco:7" if i < 2 else None} for i in range(4)]
    _write(tmp_path / "crops.jsonl", crops + [_record(10 + i) for i in range(30)])
    _write(tmp_path / "bad.jsonl", [{**_record(99), "photo": 7}])
    states, problems = read_records(tmp_path)
    assert [str(problem) for problem in problems] == [
        f"{tmp_path / 'bad.jsonl'}:1: photo must be a non-empty string, got 7"]
    assert {state.state_id: state.links for state in states if state.group == "crops"}["r-0"] == ("photo:coco:7",)
    for seed in range(10):
        records, _, _ = partition_rows(states, seed, FRACTIONS)
        where = {row["state_id"]: name for name, rows in records.items() for row in rows}
        assert where["r-0"] == where["r-1"]


def test_pinned_splits_are_kept_and_a_conflicting_pin_is_dropped(tmp_path):
    records = [_record(i, split="test" if i < 3 else None) for i in range(20)]
    records.append({**_record(50, split="train"), "state": {"message": "message 1"}})  # r-1's text, pinned elsewhere
    _write(tmp_path / "tickets.jsonl", records)
    states, _ = read_records(tmp_path)
    rows, _, report = partition_rows(states, 0, FRACTIONS)
    where = {row["state_id"]: name for name, group in rows.items() for row in group}
    assert where["r-0"] == where["r-1"] == where["r-2"] == "test"
    assert "r-50" not in where and report["drops"] == {"pinned_split_conflict": {"tickets": 1}}


def test_jsonl_and_parquet_give_identical_partitions(tmp_path):
    records = [_record(i, split="dev" if i == 4 else None) for i in range(25)]
    _write(tmp_path / "jsonl" / "tickets.jsonl", records)
    table = pd.DataFrame([{**record, **{key: json.dumps(record[key]) for key in ("state", "questions", "labels")}}
                          for record in records])
    (tmp_path / "parquet").mkdir()
    table.to_parquet(tmp_path / "parquet" / "tickets.parquet")
    from_jsonl, _ = read_records(tmp_path / "jsonl")
    from_parquet, problems = read_records(tmp_path / "parquet")
    assert not problems
    first, _, _ = partition_rows(from_jsonl, 0, FRACTIONS)
    second, _, _ = partition_rows(from_parquet, 0, FRACTIONS)
    assert first == second
    assert any(first[name] for name in PARTITIONS if name != "train")


def test_a_state_that_is_one_image_path_reads_as_that_image(tmp_path):
    """As on the wire, where a state that is one placeholder is {"image": it}: the image is read,
    and a missing file is a problem, not a text."""
    (tmp_path / "images").mkdir()
    Image.new("RGB", (8, 8), "red").save(tmp_path / "images" / "red.png")
    _write(tmp_path / "r.jsonl", [{**_record(1), "state": "images/red.png"},
                                  {**_record(2), "state": "images/missing.png"}])
    states, problems = read_records(tmp_path)
    assert [state.state_id for state in states] == ["r-1"]
    image = states[0].state["image"]
    assert isinstance(image, Image.Image) and image.getpixel((0, 0)) == (255, 0, 0)
    assert len(problems) == 1 and "no such file images/missing.png" in problems[0].reason


def test_parquet_native_lists_and_texts_that_look_like_json_are_read_as_written(tmp_path):
    """A native list column comes back from Parquet as numpy arrays: read as lists; a plain text
    state that starts with a quote stays a text; a list state as JSON text is parsed."""
    pd.DataFrame({
        "id": ["a", "b", "c"],
        "state": ['"quoted" says the customer', '["images/x.png", "a caption"]', "plain"],
        "questions": [json.dumps({"urgency": QUESTIONS["urgency"]})] * 3,
        "labels": [json.dumps({"urgency": 1})] * 3,
        "photo": [None, None, None],
    }).to_parquet(tmp_path / "r.parquet")
    (tmp_path / "images").mkdir()
    Image.new("RGB", (8, 8), "blue").save(tmp_path / "images" / "x.png")
    states, problems = read_records(tmp_path)
    assert problems == [] and [state.state_id for state in states] == ["a", "b", "c"]
    assert states[0].state == '"quoted" says the customer'
    assert isinstance(states[1].state[0], Image.Image) and states[1].state[1] == "a caption"
    native = tmp_path / "native"
    native.mkdir()
    pd.DataFrame({"state": ["s"], "questions": [{"urgency": {"type": "score", "criteria": ["none", "low", "high"]}}],
                  "labels": [{"urgency": 2}]}).to_parquet(native / "r.parquet")
    states, problems = read_records(native)
    assert problems == [] and len(states) == 1


def test_a_byte_order_mark_before_the_first_record_is_dropped(tmp_path):
    (tmp_path / "r.jsonl").write_bytes(b"\xef\xbb\xbf" + (json.dumps(_record(1)) + "\n").encode())
    states, problems = read_records(tmp_path)
    assert problems == [] and [state.state_id for state in states] == ["r-1"]
