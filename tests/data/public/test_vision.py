"""A-OKVQA, ScienceQA and VQAv2 from fixtures in their Hub Parquet layouts (images as structs)."""

import io
import json
import tarfile
from dataclasses import replace

from datasets import Image, Sequence, Value

from dohnuts.data.public import vision
from dohnuts.data.public.mixture import public_states
from dohnuts.data.public.sources import locate, manifest
from dohnuts.data.records import partition_rows

from .fixtures import jpeg, local_path, png, write_hf_parquet


def _aokvqa(tmp_path):
    source = manifest()["aokvqa"]
    features = {"image": Image(), "question_id": Value("string"), "question": Value("string"),
                "choices": Sequence(Value("string")), "correct_choice_idx": Value("int8"),
                "direct_answers": Value("string"), "difficult_direct_answer": Value("bool"),
                "rationales": Sequence(Value("string"))}

    def rows(ids, colours, answer=1):
        return {"image": [{"bytes": jpeg(colour), "path": None} for colour in colours], "question_id": ids,
                "question": ["What is the animal doing?"] * len(ids),
                "choices": [["sleeping", "eating", "running", "jumping"]] * len(ids),
                "correct_choice_idx": [answer] * len(ids), "direct_answers": ["['eating']"] * len(ids),
                "difficult_direct_answer": [False] * len(ids), "rationales": [["It has food."]] * len(ids)}
    train = source.files[0]
    write_hf_parquet(local_path(tmp_path, source, train, "data/train-00000-of-00001-9a3b.parquet"),
                     rows(["q1", "q2"], [(200, 10, 10), (10, 200, 10)]), features)
    write_hf_parquet(local_path(tmp_path, source, source.files[1], "data/validation-00000-of-00001-77aa.parquet"),
                     rows(["q3"], [(10, 10, 200)], answer=0), features)
    annotations = json.dumps([{"split": "train", "image_id": 299207, "question_id": "q1"},
                              {"split": "train", "image_id": 461751, "question_id": "q2"}]).encode()
    with tarfile.open(local_path(tmp_path, source, source.files[2]), "w:gz") as archive:
        info = tarfile.TarInfo("aokvqa_v1p0_train.json")
        info.size = len(annotations)
        archive.addfile(info, io.BytesIO(annotations))
    return source


def test_aokvqa_rows_are_image_choices_linked_to_their_coco_photo(tmp_path):
    source = _aokvqa(tmp_path)
    found, missing = locate(source, tmp_path)
    assert missing == [] and len(found["data/train-*.parquet"]) == 1  # a shard pattern matched
    rows = list(vision.aokvqa(source, found))
    assert [(row.record["id"], row.split, row.links) for row in rows] == [
        ("q1", "train", ("photo:coco:299207",)), ("q2", "train", ("photo:coco:461751",)), ("q3", "test", ())]
    assert rows[0].record["state"] == {} and rows[0].image == jpeg((200, 10, 10))
    assert rows[0].record["questions"]["answer"] == {"type": "choice", "instructions": "What is the animal doing?",
                                                     "criteria": ["sleeping", "eating", "running", "jumping"]}
    assert rows[0].record["labels"] == {"answer": "eating"} and rows[2].record["labels"] == {"answer": "sleeping"}


def test_scienceqa_keeps_the_image_questions_and_their_hint(tmp_path):
    source = manifest()["scienceqa"]
    features = {"image": Image(), "question": Value("string"), "choices": Sequence(Value("string")),
                "answer": Value("int8"), "hint": Value("string"), "task": Value("string"), "grade": Value("string"),
                "subject": Value("string"), "topic": Value("string"), "category": Value("string"),
                "skill": Value("string"), "lecture": Value("string"), "solution": Value("string")}
    columns = {"image": [{"bytes": png((0, 0, 255)), "path": None}, None, {"bytes": png((0, 255, 0)), "path": None}],
               "question": ["Which ocean is highlighted?", "Which word rhymes?", "Which is a mammal?"],
               "choices": [["the Atlantic", "the Pacific"], ["cat", "hat"], ["frog", "frog"]],
               "answer": [1, 0, 0], "hint": ["Look at the map.", "", ""]}
    columns.update({name: ["x"] * 3 for name in features if name not in columns})
    write_hf_parquet(local_path(tmp_path, source, source.files[2]), columns, features)
    found = {source.files[2].path: [local_path(tmp_path, source, source.files[2])]}
    (row,) = vision.scienceqa(replace(source, files=source.files[2:]), found)  # no image, repeated choices: out
    assert row.split == "test" and row.record["state"] == {"context": "Look at the map."}
    assert row.record["labels"] == {"answer": "the Pacific"} and row.image == png((0, 0, 255))


def test_vqav2_yes_no_questions_get_the_share_of_yes_votes(tmp_path):
    source = manifest()["vqav2"]
    # The card's list<struct>: a list of {answer, answer_confidence, answer_id}.
    answers = [{"answer": Value("string"), "answer_confidence": Value("string"), "answer_id": Value("int64")}]
    features = {"question_type": Value("string"), "multiple_choice_answer": Value("string"), "answers": answers,
                "image_id": Value("int64"), "answer_type": Value("string"), "question_id": Value("int64"),
                "question": Value("string"), "image": Image()}

    def votes(*words):
        return [{"answer": word, "answer_confidence": "yes", "answer_id": index} for index, word in enumerate(words)]
    columns = {"question_type": ["is the", "how many", "is the"], "multiple_choice_answer": ["yes", "2", "no"],
               "answers": [votes(*["yes"] * 7, *["no"] * 2, "maybe"), votes("2"), votes("no")],
               "image_id": [299207, 299207, 42], "answer_type": ["yes/no", "number", "yes/no"],
               "question_id": [1, 2, 3], "question": ["Is the dog asleep?", "How many dogs?", "Is it raining?"],
               "image": [{"bytes": jpeg((90, 90, 90)), "path": None}] * 3}
    write_hf_parquet(local_path(tmp_path, source, source.files[0], "data/validation-00000-of-00001.parquet"),
                     columns, features)
    found, _ = locate(source, tmp_path)
    rows = list(vision.vqav2(source, found))
    assert [row.record["id"] for row in rows] == ["1", "3"]  # the number question is not yes/no
    assert rows[0].record["labels"] == {"answer": 7 / 9} and rows[1].record["labels"] == {"answer": 0.0}
    assert rows[0].record["questions"] == {"answer": {"type": "noul", "instructions": "Is the dog asleep?"}}
    assert rows[0].links == ("photo:coco:299207",) and rows[0].split is None


def test_one_coco_photo_in_aokvqa_and_vqav2_lands_in_one_partition(tmp_path):
    _aokvqa(tmp_path)
    source = manifest()["vqav2"]
    answers = Sequence({"answer": Value("string"), "answer_confidence": Value("string"), "answer_id": Value("int64")})
    features = {"answers": answers, "image_id": Value("int64"), "answer_type": Value("string"),
                "question_id": Value("int64"), "question": Value("string"), "image": Image()}
    count = 40
    write_hf_parquet(local_path(tmp_path, source, source.files[0], "data/validation-00000-of-00001.parquet"), {
        "answers": [{"answer": ["yes"], "answer_confidence": ["yes"], "answer_id": [1]}] * count,
        "image_id": [299207] + list(range(1000, 1000 + count - 1)), "answer_type": ["yes/no"] * count,
        "question_id": list(range(count)), "question": [f"Is there a thing number {i}?" for i in range(count)],
        # the same photo as A-OKVQA's q1, stored at another quality: other bytes, other pixels
        "image": [{"bytes": jpeg((200, 10, 10), quality=50 + i), "path": None} for i in range(count)]}, features)
    states, problems, _ = public_states(tmp_path, 0, 100, groups=["aokvqa", "vqav2_yesno"])
    assert problems == []
    fractions = {"train": 0.7, "dev": 0.1, "calibration": 0.1, "test": 0.1}
    for seed in range(5):
        records, _, report = partition_rows(states, seed, fractions)
        where = {(row["group"], row["state_id"]): name for name, rows in records.items() for row in rows}
        assert where[("aokvqa", "q1")] == where[("vqav2_yesno", "0")]
        assert report["cross_partition"]["images"] == 0
