"""CLEVR and ScreenQA from fixtures in their releases' own layouts (zip; JSON plus a RICO tar)."""

import io
import json
import tarfile
import zipfile

from dohnuts.data.public import clevr, screens
from dohnuts.data.public.sources import locate, manifest

from .fixtures import jpeg, local_path, png


def _program(*functions):
    return [{"inputs": [] if i == 0 else [i - 1], "function": name, "value_inputs": []}
            for i, name in enumerate(functions)]


def test_clevr_questions_split_into_attribute_count_and_exist_groups(tmp_path):
    source = manifest()["clevr"]

    def question(split, index, text, answer, *program):
        return {"split": split, "image_index": index // 2, "image_filename": f"CLEVR_{split}_{index // 2:06d}.png",
                "question": text, "answer": answer, "program": _program("scene", *program),
                "question_family_index": 1, "question_index": index}
    train = [question("train", 0, "What color is the cube?", "red", "filter_shape", "unique", "query_color"),
             question("train", 1, "How many spheres are there?", "3", "filter_shape", "count"),
             question("train", 2, "Is there a metal cylinder?", "no", "filter_material", "exist"),
             question("train", 3, "Are there more cubes than spheres?", "yes", "greater_than")]  # left out
    val = [question("val", 0, "What size is the sphere?", "large", "unique", "query_size")]
    with zipfile.ZipFile(local_path(tmp_path, source, source.files[0]), "w") as archive:
        for split, questions in (("train", train), ("val", val)):
            archive.writestr(f"CLEVR_v1.0/questions/CLEVR_{split}_questions.json",
                             json.dumps({"info": {}, "questions": questions}))
        archive.writestr("CLEVR_v1.0/images/train/CLEVR_train_000000.png", png((120, 120, 120)))
        archive.writestr("CLEVR_v1.0/images/train/CLEVR_train_000001.png", png((100, 100, 100)))
        archive.writestr("CLEVR_v1.0/images/val/CLEVR_val_000000.png", png((80, 80, 80)))
    found, _ = locate(source, tmp_path)
    rows = list(clevr.clevr(source, found))
    assert [(row.record["group"], row.split) for row in rows] == [
        ("clevr_attribute", "train"), ("clevr_count", "train"), ("clevr_exist", "train"), ("clevr_attribute", "test")]
    attribute, count, exist, size = (row.record for row in rows)
    assert attribute["questions"]["answer"]["criteria"] == clevr.ATTRIBUTES["query_color"]
    assert attribute["labels"] == {"answer": "red"} and size["labels"] == {"answer": "large"}
    assert count["questions"]["answer"] == {"type": "score", "instructions": "How many spheres are there?",
                                            "criteria": [str(n) for n in range(11)]}
    assert count["labels"] == {"answer": 3} and exist["labels"] == {"answer": False}
    assert rows[0].image.load() == png((120, 120, 120)) and rows[0].image.key == rows[1].image.key
    assert rows[2].image.load() == png((100, 100, 100))
    assert source.pinned_splits() == {"test"}


def _node(bounds, children=(), visibility="visible"):
    return {"bounds": list(bounds), "children": list(children), "visibility": visibility, "class": "View"}


def test_screenqa_regions_come_from_the_view_hierarchy_and_disagreeing_raters_are_left_out(tmp_path):
    source = manifest()["screenqa"]
    files = {file.path: file for file in source.files}
    # Depth-first indices: 0 root, 1 toolbar (its children 2 and 3), 4 list (5, 6 hidden, 7).
    root = _node((0, 0, 1440, 2560), [
        _node((0, 0, 1440, 200), [_node((0, 0, 200, 200)), _node((1240, 0, 1440, 200))]),
        _node((0, 200, 1440, 2560), [_node((0, 200, 1440, 400)), _node((0, 400, 1440, 600), visibility="gone"),
                                     _node((0, 400, 1440, 600))])])
    hierarchy = json.dumps({"activity_name": "com.example/.Main", "activity": {"root": root}}).encode()

    def rater(*indices):
        return {"full_answer": "the answer", "ui_elements": [{"text": "x", "bounds": [0, 0, 1, 1], "vh_index": i}
                                                             for i in indices]}
    annotations = {
        "answers_and_bboxes/train.json": [
            {"image_id": 5, "image_width": 1440, "image_height": 2560, "question": "Where is the menu?",
             "ground_truth": [rater(2), rater(2)]},
            {"image_id": 5, "image_width": 1440, "image_height": 2560, "question": "What is listed?",
             "ground_truth": [rater(5), rater(7)]}],  # raters disagree: left out
        "answers_and_bboxes/validation.json": [
            {"image_id": 5, "image_width": 1440, "image_height": 2560, "question": "Which row is first?",
             "ground_truth": [rater(5)]}],
        "answers_and_bboxes/test.json": [
            {"image_id": 9, "image_width": 1440, "image_height": 2560, "question": "Anything?",  # no screen: out
             "ground_truth": [rater(1)]}]}
    for path, rows in annotations.items():
        local_path(tmp_path, source, files[path]).write_text(json.dumps(rows))
    with tarfile.open(local_path(tmp_path, source, files["unique_uis.tar.gz"]), "w:gz") as archive:
        for name, data in (("combined/5.json", hierarchy), ("combined/5.jpg", jpeg((250, 250, 250))),
                           ("combined/6.jpg", jpeg((0, 0, 0)))):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    found, missing = locate(source, tmp_path)
    assert missing == []
    rows = list(screens.screenqa(source, found))
    assert [(row.record["group"], row.split) for row in rows] == [
        ("screenqa_choice", "train"), ("screenqa_noul", "train"), ("screenqa_noul", "train"),
        ("screenqa_choice", "dev"), ("screenqa_noul", "dev"), ("screenqa_noul", "dev")]
    choice = rows[0].record
    assert choice["questions"]["region"]["criteria"] == {
        "r2": "box [left, top, right, bottom] = [0.000, 0.000, 0.139, 0.078]",
        "r3": "box [left, top, right, bottom] = [0.861, 0.000, 1.000, 0.078]",
        "r5": "box [left, top, right, bottom] = [0.000, 0.078, 1.000, 0.156]",
        "r7": "box [left, top, right, bottom] = [0.000, 0.156, 1.000, 0.234]"}  # visible leaves only
    assert choice["labels"] == {"region": "r2"} and choice["state"] == {}
    positive, negative = rows[1].record, rows[2].record
    assert positive["state"] == negative["state"] == {}  # the screenshot alone: a box recurs across screens
    assert positive["questions"]["answers"] == {"type": "noul", "instructions": (
        "Does the region box [left, top, right, bottom] = [0.000, 0.000, 0.139, 0.078] answer the question: "
        "Where is the menu?")}
    assert positive["labels"] == {"answers": True} and negative["labels"] == {"answers": False}
    assert negative["questions"]["answers"]["instructions"] != positive["questions"]["answers"]["instructions"]
    assert rows[0].image.load() == jpeg((250, 250, 250)) and rows[0].links == ("rico:5",)
    extracted = sorted(path.name for path in (found["unique_uis.tar.gz"][0].parent / "unique_uis.tar.gz.screens")
                       .iterdir())
    assert extracted == [".complete", "5.jpg", "5.json"]  # only the screens the annotations use
