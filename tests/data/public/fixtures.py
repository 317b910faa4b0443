"""Small raw files in each public source's own layout, written where the local cache keeps them."""

from __future__ import annotations

import io
import json
from pathlib import Path

from PIL import Image

from dohnuts.data.public.sources import RawFile, Source, cache_folders

FAKE_COMMIT = "0123456789abcdef0123456789abcdef01234567"


def local_path(cache: Path, source: Source, file: RawFile, name: str | None = None) -> Path:
    """Where `file` of `source` sits in the cache rooted at `cache` (for a Hub file, inside the
    snapshot of its revision; a branch revision gets a ref to a made-up commit, as
    huggingface_hub writes it). `name` replaces a pattern with one concrete shard name."""
    hub, files = cache_folders(cache)
    if file.url is not None:
        path = files / source.name / file.path
    else:
        repo = hub / ("datasets--" + source.hub.replace("/", "--"))
        revision = source.revision or "main"
        commit = revision if len(revision) == 40 and all(c in "0123456789abcdef" for c in revision) else FAKE_COMMIT
        if commit != revision:
            (repo / "refs" / revision).parent.mkdir(parents=True, exist_ok=True)
            (repo / "refs" / revision).write_text(commit)
        path = repo / "snapshots" / commit / (name or file.path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def write_hf_parquet(path: Path, columns: dict, features: dict) -> None:
    """A Parquet file as the Hub's converter writes it: Hugging Face features in the schema
    metadata (label names of ClassLabel columns, Image structs {bytes, path})."""
    from datasets import Dataset, Features

    Dataset.from_dict(columns, features=Features(features)).to_parquet(str(path))


def png(colour, size=(32, 24)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, format="PNG")
    return buffer.getvalue()


def jpeg(colour, size=(40, 30), quality=90) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue()


def write_json(path: Path, data) -> None:
    path.write_text(json.dumps(data))


# --- a small mixture of every source, each in its own layout ------------------------------------

def _hub(cache, name, path, columns, features, shard=None):
    from dohnuts.data.public.sources import manifest

    source = manifest()[name]
    file = next(file for file in source.files if file.path == path)
    write_hf_parquet(local_path(cache, source, file, shard), columns, features)


def _url(cache, name, path) -> Path:
    from dohnuts.data.public.sources import manifest

    source = manifest()[name]
    return local_path(cache, source, next(file for file in source.files if file.path == path))


def _tar(path: Path, members: dict, mode="w:gz") -> None:
    import tarfile

    with tarfile.open(path, mode) as archive:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))


def _zip(path: Path, members: dict) -> None:
    import zipfile

    with zipfile.ZipFile(path, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data if isinstance(data, bytes) else json.dumps(data))


SHARED_TEXT = "Shared sentence that two sources both contain, word for word."


def write_mixture(cache: Path, n: int = 6) -> dict[str, int]:
    """Write `n` rows (or states) per split file of every source into `cache`; returns the
    states each group should yield. One AG News text is also an emotion text, and one COCO
    photo appears in A-OKVQA and VQAv2, so isolation has something to join."""
    from datasets import ClassLabel, Image, Sequence, Value

    text, label = Value("string"), lambda names: ClassLabel(names=names)
    expected = {}
    for locale in ("en-US", "zh-CN"):
        for split in ("train", "validation", "test"):
            _hub(cache, "massive", f"{locale}/{split}/0000.parquet",
                 {"id": [f"{split}{i}" for i in range(n)], "locale": [locale] * n, "partition": [split] * n,
                  "intent": [i % 3 for i in range(n)], "utt": [f"{locale} {split} utterance {i}" for i in range(n)]},
                 {"id": text, "locale": text, "partition": text, "intent": label(["alarm_set", "play_music", "qa"]),
                  "utt": text})
        expected[f"massive_{locale}"] = 3 * n
    for language in ("en", "zh"):
        for split in ("train", "validation", "test"):
            _hub(cache, "xnli", f"{language}/{split}-00000-of-00001.parquet",
                 {"premise": [f"{language} {split} premise {i}" for i in range(n)],
                  "hypothesis": [f"hypothesis {i}" for i in range(n)], "label": [i % 3 for i in range(n)]},
                 {"premise": text, "hypothesis": text, "label": label(["entailment", "neutral", "contradiction"])})
        expected[f"xnli_{language}"] = 3 * n
    for split in ("train", "validation"):
        _hub(cache, "boolq", f"data/{split}-00000-of-00001.parquet",
             {"question": [f"is {split} claim {i} true" for i in range(n)], "answer": [i % 2 == 0 for i in range(n)],
              "passage": [f"Passage {i} of {split}." for i in range(n)]},
             {"question": text, "answer": Value("bool"), "passage": text})
    expected["boolq"] = 2 * n
    for name, files, names in (
            ("ag_news", ["data/train-00000-of-00001.parquet", "data/test-00000-of-00001.parquet"],
             ["World", "Sports", "Business", "Sci/Tech"]),
            ("emotion", [f"split/{s}-00000-of-00001.parquet" for s in ("train", "validation", "test")],
             ["sadness", "joy", "love", "anger", "fear", "surprise"]),
            ("banking77", ["data/train-00000-of-00001.parquet", "data/test-00000-of-00001.parquet"],
             ["activate_my_card", "Refund_not_showing_up", "reverted_card_payment?"])):
        for path in files:
            texts = [f"{name} {path} text {i}" for i in range(n)]
            if name in ("ag_news", "emotion") and path.endswith(("train-00000-of-00001.parquet",)):
                texts[0] = SHARED_TEXT
            _hub(cache, name, path, {"text": texts, "label": [i % len(names) for i in range(n)]},
                 {"text": text, "label": label(names)})
        expected[name] = len(files) * n
    questions = {"route": {"type": "choice", "instructions": "Which team?", "criteria": {"billing": "", "tech": ""}},
                 "refund": {"type": "noul", "instructions": "Refund owed?"},
                 "urgency": {"type": "score", "instructions": "How urgent?", "criteria": ["low", "mid", "high"]}}
    gold = {"route": {"probabilities": {"billing": 0.7, "tech": 0.3}},
            "refund": {"probabilities": {"false": 0.4, "true": 0.6}},
            "urgency": {"probabilities": {"0": 0.2, "1": 0.3, "2": 0.5}}}
    for split in ("train", "test"):
        _hub(cache, "typed_decisions", f"all/{split}-00000-of-00001.parquet",
             {"id": [f"{split}-{i}" for i in range(n)], "state": [json.dumps({"task": f"{split} case {i}"})
                                                                  for i in range(n)],
              "questions": [json.dumps(questions)] * n, "gold": [json.dumps(gold)] * n},
             {"id": text, "state": text, "questions": text, "gold": text})
    expected["typed_decisions"] = 2 * n
    for split in ("train", "validation", "test"):
        _hub(cache, "wiki_qa", f"data/{split}-00000-of-00001.parquet",
             {"question_id": [f"{split}Q{i // 2}" for i in range(n)],
              "question": [f"{split} q {i // 2}?" for i in range(n)],
              "document_title": [f"{split} doc {i // 2}" for i in range(n)],
              "answer": [f"{split} sentence {i}." for i in range(n)], "label": [i % 2 for i in range(n)]},
             {"question_id": text, "question": text, "document_title": text, "answer": text,
              "label": label(["0", "1"])})
    expected["wikiqa"] = 3 * n
    _hub(cache, "sms_spam", "plain_text/train-00000-of-00001.parquet",
         {"sms": [f"sms number {i}\n" for i in range(n)], "label": [i % 2 for i in range(n)]},
         {"sms": text, "label": label(["ham", "spam"])})
    expected["sms_spam"] = n

    sharc = {f"sharc1-official/json/sharc_{split}.json": [
        {"utterance_id": f"{split}{i}", "tree_id": f"{split}-tree-{i}", "source_url": f"https://rules/{i}",
         "snippet": f"Rule {split} {i}.", "question": "Can I?", "scenario": "", "history": [],
         "evidence": [], "answer": ["Yes", "No", "Irrelevant", "Do you live here?"][i % 4]} for i in range(n)]
        for split in ("train", "dev", "test")}
    _zip(_url(cache, "sharc", "sharc1-official.zip"), sharc)
    expected["sharc"] = 3 * n
    labels = {"nda-1": {"short_description": "a", "hypothesis": "Claim one."},
              "nda-2": {"short_description": "b", "hypothesis": "Claim two."}}
    _zip(_url(cache, "contract_nli", "contract-nli.zip"), {
        f"contract-nli/{split}.json": {"labels": labels, "documents": [
            {"id": i, "file_name": f"{i}.pdf", "text": f"Contract {split} {i}.", "document_type": "search-pdf",
             "url": "", "spans": [], "annotation_sets": [{"annotations": {
                 "nda-1": {"choice": "Entailment", "spans": []}, "nda-2": {"choice": "NotMentioned", "spans": []}}}]}
            for i in range(n // 2)]} for split in ("train", "dev", "test")})
    expected["contract_nli"] = 3 * (n // 2) * 2
    import pandas as pd

    locales = ["us", "es", "jp"]
    examples = pd.DataFrame({
        "example_id": list(range(3 * n)), "query": [f"query {i % n}" for i in range(3 * n)],
        "query_id": [i % n for i in range(3 * n)], "product_id": [f"P{i}" for i in range(3 * n)],
        "product_locale": [locales[i // n] for i in range(3 * n)], "esci_label": [list("ESCI")[i % 4]
                                                                                   for i in range(3 * n)],
        "small_version": [1] * (3 * n), "large_version": [1] * (3 * n),
        "split": ["test" if i % n == 0 else "train" for i in range(3 * n)]})
    products = pd.DataFrame({"product_id": [f"P{i}" for i in range(3 * n)],
                             "product_title": [f"Product {i}" for i in range(3 * n)],
                             "product_description": [None] * (3 * n), "product_bullet_point": [None] * (3 * n),
                             "product_brand": ["Acme"] * (3 * n), "product_color": [None] * (3 * n),
                             "product_locale": [locales[i // n] for i in range(3 * n)]})
    examples.to_parquet(_url(cache, "esci", "shopping_queries_dataset_examples.parquet"))
    products.to_parquet(_url(cache, "esci", "shopping_queries_dataset_products.parquet"))
    for locale in locales:
        expected[f"esci_{locale}"] = n

    from email.message import EmailMessage

    def message(subject, body):
        mail = EmailMessage()
        mail["Subject"] = subject
        mail.set_content(body)
        return mail.as_bytes()
    _tar(_url(cache, "mail", "20030228_easy_ham.tar.bz2"),
         {f"easy_ham/{i:05d}.{i:032x}": message("hi", f"Ham message {i} about lunch.") for i in range(n)}, "w:bz2")
    _tar(_url(cache, "mail", "20030228_spam.tar.bz2"),
         {f"spam/{i:05d}.{i:032x}": message("win", f"Spam offer {i}, buy now.") for i in range(n)}, "w:bz2")
    _url(cache, "mail", "phishing-2024").write_bytes(b"".join(
        b"From x Mon Jan  1 00:00:00 2024\n" + message("bank", f"Phish {i}: confirm your password.") + b"\n"
        for i in range(n)))
    for name in ("20030228_easy_ham_2.tar.bz2", "20030228_hard_ham.tar.bz2", "20050311_spam_2.tar.bz2"):
        _tar(_url(cache, "mail", name), {}, "w:bz2")
    for name in ("phishing-2023", "phishing-2025"):
        _url(cache, "mail", name).write_bytes(b"")
    expected["mail_spam"], expected["mail_phishing"] = 2 * n, 2 * n

    image = Image()
    aokvqa = {"image": image, "question_id": text, "question": text, "choices": Sequence(text),
              "correct_choice_idx": Value("int8")}
    for split, shard in (("train", "data/train-00000-of-00001-aa.parquet"),
                         ("validation", "data/validation-00000-of-00001-bb.parquet")):
        _hub(cache, "aokvqa", f"data/{split}-*.parquet",
             {"image": [{"bytes": jpeg((10 * i, 100, 30 if split == "train" else 60)), "path": None}
                        for i in range(n)],
              "question_id": [f"{split}{i}" for i in range(n)], "question": [f"What is {i}?" for i in range(n)],
              "choices": [["a", "b", "c", "d"]] * n, "correct_choice_idx": [i % 4 for i in range(n)]},
             aokvqa, shard)
    annotations = json.dumps([{"question_id": f"train{i}", "image_id": 500 + i} for i in range(n)]).encode()
    _tar(_url(cache, "aokvqa", "aokvqa_v1p0.tar.gz"), {"aokvqa_v1p0_train.json": annotations})
    expected["aokvqa"] = 2 * n
    science = {"image": image, "question": text, "choices": Sequence(text), "answer": Value("int8"), "hint": text}
    for split, path in (("train", "data/train-00000-of-00001-1028f23e353fbe3e.parquet"),
                        ("validation", "data/validation-00000-of-00001-6c7328ff6c84284c.parquet"),
                        ("test", "data/test-00000-of-00001-f0e719df791966ff.parquet")):
        _hub(cache, "scienceqa", path,
             {"image": [{"bytes": png((200, 10 * i, 5 * len(split))), "path": None} for i in range(n)],
              "question": [f"{split} science {i}?" for i in range(n)], "choices": [["yes", "no"]] * n,
              "answer": [i % 2 for i in range(n)], "hint": [""] * n}, science)
    expected["scienceqa"] = 3 * n
    votes = [{"answer": Value("string"), "answer_confidence": Value("string"), "answer_id": Value("int64")}]
    _hub(cache, "vqav2", "data/validation-*.parquet",
         {"answers": [[{"answer": "yes", "answer_confidence": "yes", "answer_id": 1}]] * n,
          "image_id": [500] + [900 + i for i in range(1, n)], "answer_type": ["yes/no"] * n,
          "question_id": list(range(n)), "question": [f"Is it {i}?" for i in range(n)],
          "image": [{"bytes": jpeg((0, 100, 30), quality=60) if i == 0 else jpeg((i, 1, 1)), "path": None}
                    for i in range(n)]},
         {"answers": votes, "image_id": Value("int64"), "answer_type": text, "question_id": Value("int64"),
          "question": text, "image": image}, "data/validation-00000-of-00001.parquet")
    expected["vqav2_yesno"] = n

    def clevr_question(split, i):
        family = ["query_color", "count", "exist"][i % 3]
        answer = {"query_color": "red", "count": "2", "exist": "yes"}[family]
        return {"image_filename": f"CLEVR_{split}_{i:06d}.png", "question": f"{split} question {i}?",
                "answer": answer, "question_index": i,
                "program": [{"inputs": [], "function": "scene", "value_inputs": []},
                            {"inputs": [0], "function": family, "value_inputs": []}]}
    members = {}
    for split in ("train", "val"):
        members[f"CLEVR_v1.0/questions/CLEVR_{split}_questions.json"] = {
            "questions": [clevr_question(split, i) for i in range(n)]}
        for i in range(n):
            members[f"CLEVR_v1.0/images/{split}/CLEVR_{split}_{i:06d}.png"] = png((i, 50, 7 if split == "train" else 9))
    _zip(_url(cache, "clevr", "CLEVR_v1.0.zip"), members)
    for group in ("clevr_attribute", "clevr_count", "clevr_exist"):
        expected[group] = 2 * (n // 3)

    hierarchy = json.dumps({"activity": {"root": {"bounds": [0, 0, 100, 200], "children": [
        {"bounds": [0, 0, 100, 50]}, {"bounds": [0, 50, 100, 100]}, {"bounds": [0, 100, 100, 200]}]}}}).encode()
    screens, rico = {}, {}
    for split in ("train", "validation", "test"):
        screens[split] = [{"image_id": 10 * len(split) + i, "question": f"{split} where {i}?",
                           "ground_truth": [{"full_answer": "", "ui_elements": [{"vh_index": 1 + i % 3}]}]}
                          for i in range(n)]
        _url(cache, "screenqa", f"answers_and_bboxes/{split}.json").write_text(json.dumps(screens[split]))
        for row in screens[split]:
            rico[f"combined/{row['image_id']}.json"] = hierarchy
            rico[f"combined/{row['image_id']}.jpg"] = jpeg((row["image_id"], 3, 3))
    _tar(_url(cache, "screenqa", "unique_uis.tar.gz"), rico)
    expected["screenqa_choice"], expected["screenqa_noul"] = 3 * n, 3 * 2 * n
    return expected
