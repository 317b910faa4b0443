"""The text sources on the Hub, from fixtures in their own Parquet layouts, field by field."""

import json
from dataclasses import replace

import pytest
from datasets import ClassLabel, Sequence, Value

from dohnuts.data.public import text
from dohnuts.data.public.mixture import public_states
from dohnuts.data.public.sources import locate, manifest

from .fixtures import local_path, write_hf_parquet

_INTENTS = (
    "datetime_query iot_hue_lightchange transport_ticket takeaway_query qa_stock general_greet recommendation_events "
    "music_dislikeness iot_wemo_off cooking_recipe qa_currency transport_traffic general_quirky weather_query "
    "audio_volume_up email_addcontact takeaway_order email_querycontact iot_hue_lightup recommendation_locations "
    "play_audiobook lists_createoradd news_query alarm_query iot_wemo_on general_joke qa_definition social_query "
    "music_settings audio_volume_other calendar_remove iot_hue_lightdim calendar_query email_sendemail iot_cleaning "
    "audio_volume_down play_radio cooking_query datetime_convert qa_maths iot_hue_lightoff iot_hue_lighton "
    "transport_query music_likeness email_query play_music audio_volume_mute social_post alarm_set qa_factoid "
    "calendar_set play_game alarm_remove lists_remove transport_taxi recommendation_movies iot_coffee music_query "
    "play_podcasts lists_query")
_SCENARIOS = ("social transport calendar play news datetime recommendation email iot general audio lists qa cooking "
              "takeaway music alarm weather")
MASSIVE_INTENTS, SCENARIOS = _INTENTS.split(), _SCENARIOS.split()  # in the features' ClassLabel order


def _only(cache, name, path):
    """The source reduced to one raw file, and that file's local path as `locate` gives it."""
    source = manifest()[name]
    source = replace(source, files=tuple(file for file in source.files if file.path == path))
    return source, {path: [local_path(cache, source, source.files[0])]}


def _write(cache, source_name, path, columns, features):
    source = manifest()[source_name]
    file = next(file for file in source.files if file.path == path)
    write_hf_parquet(local_path(cache, source, file), columns, features)


def _massive(cache, locale, split, rows):
    features = {
        "id": Value("string"), "locale": Value("string"), "partition": Value("string"),
        "scenario": ClassLabel(names=SCENARIOS), "intent": ClassLabel(names=MASSIVE_INTENTS), "utt": Value("string"),
        "annot_utt": Value("string"), "worker_id": Value("string"),
        "slot_method": Sequence({"slot": Value("string"), "method": Value("string")}),
        "judgments": Sequence({"worker_id": Value("string"), "intent_score": Value("int8"),
                               "slots_score": Value("int8"), "grammar_score": Value("int8"),
                               "spelling_score": Value("int8"), "language_identification": Value("string")}),
    }
    columns = {name: [] for name in features}
    for identifier, intent, utterance in rows:
        values = {"id": identifier, "locale": locale, "partition": {"validation": "dev"}.get(split, split),
                  "scenario": SCENARIOS.index(MASSIVE_INTENTS[intent].split("_")[0]), "intent": intent,
                  "utt": utterance, "annot_utt": utterance, "worker_id": "8",
                  "slot_method": {"slot": [], "method": []},
                  "judgments": {"worker_id": ["1"], "intent_score": [1], "slots_score": [1], "grammar_score": [4],
                                "spelling_score": [2], "language_identification": ["target"]}}
        for name in features:
            columns[name].append(values[name])
    _write(cache, "massive", f"{locale}/{split}/0000.parquet", columns, features)


def _all_massive(cache):
    _massive(cache, "en-US", "train", [("1", 48, "wake me up at nine am on friday"), ("2", 13, "what is the weather")])
    _massive(cache, "en-US", "validation", [("3", 45, "play some jazz")])
    _massive(cache, "en-US", "test", [("4", 0, "what time is it in tokyo")])
    _massive(cache, "zh-CN", "train", [("1", 48, "周五早上九点叫醒我"), ("2", 13, "天气怎么样")])
    _massive(cache, "zh-CN", "validation", [("3", 45, "放点爵士乐")])
    _massive(cache, "zh-CN", "test", [("4", 0, "东京现在几点")])


def test_massive_rows_become_60_way_intent_choices_and_a_translation_joins_its_original(tmp_path):
    _all_massive(tmp_path)
    source = manifest()["massive"]
    found, missing = locate(source, tmp_path)
    assert missing == []
    rows = list(text.massive(source, found))
    assert len(rows) == 8
    first = rows[0]
    assert first.record["group"] == "massive_en-US" and first.split == "train"
    assert first.record["state"] == "wake me up at nine am on friday"
    question = first.record["questions"]["label"]
    assert question["type"] == "choice" and question["criteria"] == MASSIVE_INTENTS and len(MASSIVE_INTENTS) == 60
    assert first.record["labels"] == {"label": "alarm_set"}
    assert first.links == ("massive:1",)
    chinese = next(row for row in rows if row.record["group"] == "massive_zh-CN" and row.split == "train")
    assert chinese.links == first.links  # one SLURP id: original and translation share a partition
    assert [row.split for row in rows if row.record["group"] == "massive_zh-CN"] == ["train", "train", "dev", "test"]


def test_xnli_pairs_keep_premise_and_hypothesis_and_official_splits(tmp_path):
    source = manifest()["xnli"]
    features = {"premise": Value("string"), "hypothesis": Value("string"),
                "label": ClassLabel(names=["entailment", "neutral", "contradiction"])}
    pairs = (("en", ("A man is sleeping.", "Nobody sleeps.")), ("zh", ("一个人在睡觉。", "没有人睡觉。")))
    for language, pair in pairs:
        for split in ("train", "validation", "test"):
            _write(tmp_path, "xnli", f"{language}/{split}-00000-of-00001.parquet",
                   {"premise": [pair[0]], "hypothesis": [pair[1]], "label": [2]}, features)
    found, _ = locate(source, tmp_path)
    rows = list(text.xnli(source, found))
    assert [(row.record["group"], row.split) for row in rows] == [
        ("xnli_en", "train"), ("xnli_en", "dev"), ("xnli_en", "test"),
        ("xnli_zh", "train"), ("xnli_zh", "dev"), ("xnli_zh", "test")]
    assert rows[0].record["state"] == {"premise": "A man is sleeping.", "hypothesis": "Nobody sleeps."}
    assert rows[0].record["questions"]["label"]["criteria"] == ["entailment", "neutral", "contradiction"]
    assert rows[0].record["labels"] == {"label": "contradiction"}
    assert rows[2].links == rows[5].links == ("xnli:test:0",)  # aligned translations join


def test_classification_sources_read_their_label_names_from_the_hugging_face_features(tmp_path):
    for name, path, columns, names in (
            ("ag_news", "data/train-00000-of-00001.parquet", {"text": ["Stocks rallied."], "label": [2]},
             ["World", "Sports", "Business", "Sci/Tech"]),
            ("emotion", "split/validation-00000-of-00001.parquet", {"text": ["i feel great"], "label": [1]},
             ["sadness", "joy", "love", "anger", "fear", "surprise"]),
            ("banking77", "data/test-00000-of-00001.parquet",
             {"text": ["my refund is missing", "hi"], "label": [1, -1]},
             ["activate_my_card", "Refund_not_showing_up", "reverted_card_payment?"])):
        _write(tmp_path, name, path, columns, {"text": Value("string"), "label": ClassLabel(names=names)})
        rows = list(text.CONVERTERS[name](*_only(tmp_path, name, path)))
        assert len(rows) == 1  # an unlabelled row (-1) is left out
        row = rows[0]
        assert row.record["group"] == name and row.record["state"] == columns["text"][0]
        assert row.record["questions"]["label"]["criteria"] == names  # the card's order, irregular names kept
        assert row.record["labels"] == {"label": names[columns["label"][0]]}


def test_boolq_wikiqa_and_sms_become_noul_questions(tmp_path):
    _write(tmp_path, "boolq", "data/validation-00000-of-00001.parquet",
           {"question": ["is the sky blue"], "answer": [True], "passage": ["The sky is blue on clear days."]},
           {"question": Value("string"), "answer": Value("bool"), "passage": Value("string")})
    (row,) = text.boolq(*_only(tmp_path, "boolq", "data/validation-00000-of-00001.parquet"))
    assert row.split == "test" and row.record["state"] == "The sky is blue on clear days."
    assert row.record["questions"] == {"answer": {"type": "noul", "instructions": "Is the sky blue?"}}
    assert row.record["labels"] == {"answer": True}

    columns = {"question_id": ["Q1", "Q1"], "question": ["how are glacier caves formed?"] * 2,
               "document_title": ["Glacier cave"] * 2,
               "answer": ["A glacier cave is a cave formed within the ice of a glacier.", "Glaciers move."],
               "label": [1, 0]}
    _write(tmp_path, "wiki_qa", "data/test-00000-of-00001.parquet", columns,
           {"question_id": Value("string"), "question": Value("string"), "document_title": Value("string"),
            "answer": Value("string"), "label": ClassLabel(names=["0", "1"])})
    rows = list(text.wiki_qa(*_only(tmp_path, "wiki_qa", "data/test-00000-of-00001.parquet")))
    assert [row.record["labels"]["answers"] for row in rows] == [True, False]
    assert rows[0].record["state"] == {"question": "how are glacier caves formed?",
                                       "sentence": "A glacier cave is a cave formed within the ice of a glacier."}
    assert rows[0].links == rows[1].links == ("wikiqa-question:Q1", "wikiqa-article:Glacier cave")

    sms = manifest()["sms_spam"]
    _write(tmp_path, "sms_spam", "plain_text/train-00000-of-00001.parquet",
           {"sms": ["WINNER!! Claim your prize now\n", "See you at 6\n"], "label": [1, 0]},
           {"sms": Value("string"), "label": ClassLabel(names=["ham", "spam"])})
    found, _ = locate(sms, tmp_path)
    rows = list(text.sms_spam(sms, found))
    assert [(row.record["state"], row.record["labels"]["spam"], row.split) for row in rows] == [
        ("WINNER!! Claim your prize now", True, None), ("See you at 6", False, None)]


def test_typed_decisions_keep_all_three_types_with_soft_targets(tmp_path):
    questions = {"route": {"type": "choice", "instructions": "Which team?",
                           "criteria": {"billing": "invoices", "tech": "outages"}},
                 "refund": {"type": "noul", "instructions": "Is a refund owed?",
                            "criteria": {"false": "no refund", "true": "refund"}},
                 "urgency": {"type": "score", "instructions": "How urgent?", "criteria": ["low", "mid", "high", "now"]}}
    gold = {"route": {"probabilities": {"billing": 0.66667, "tech": 0.33333}},
            "refund": {"probabilities": {"false": 0.25, "true": 0.75}},
            "urgency": {"probabilities": {"0": 0.0, "1": 0.5, "2": 0.5, "3": 0.0}}}
    _write(tmp_path, "typed_decisions", "all/test-00000-of-00001.parquet",
           {"id": ["case-1"], "state": [json.dumps({"task": "a double charge"})],
            "questions": [json.dumps(questions)], "gold": [json.dumps(gold)]},
           {"id": Value("string"), "state": Value("string"), "questions": Value("string"), "gold": Value("string")})
    (row,) = text.typed_decisions(*_only(tmp_path, "typed_decisions", "all/test-00000-of-00001.parquet"))
    assert row.split == "test" and row.record["state"] == {"task": "a double charge"}
    assert row.record["questions"] == questions
    labels = row.record["labels"]
    assert labels["refund"] == 0.75 and labels["urgency"] == {"0": 0.0, "1": 0.5, "2": 0.5, "3": 0.0}
    assert sum(labels["route"].values()) == pytest.approx(1.0, abs=1e-12)  # 0.99999 renormalised


def test_massive_through_the_mixture_validates_rows_pins_official_splits_and_hashes_the_rest(tmp_path):
    _all_massive(tmp_path)
    states, problems, report = public_states(tmp_path, 0, 100, groups=["massive_en-US", "massive_zh-CN"])
    assert problems == []
    assert report["groups"]["massive_en-US"] == {"source": "massive", "rows_read": 4, "rows_kept": 4}
    assert report["sources"]["massive"]["unpinned"] == sorted(file.path for file in manifest()["massive"].files)
    by_id = {state.state_id: state for state in states}
    assert by_id["en-US/validation/0000.parquet:0"].split == "dev"
    assert by_id["zh-CN/test/0000.parquet:0"].split == "test"
    trained = by_id["en-US/train/0000.parquet:0"]
    assert trained.split is None and trained.among == ("train", "calibration")  # dev and test are official
    assert trained.targets == {"label": [1.0 if name == "alarm_set" else 0.0 for name in MASSIVE_INTENTS]}
