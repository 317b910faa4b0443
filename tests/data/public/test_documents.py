"""ShARC, ContractNLI and ESCI from fixtures in their releases' own layouts."""

import json
import zipfile

import pandas as pd

from dohnuts.data.public import documents
from dohnuts.data.public.sources import locate, manifest

from .fixtures import local_path


def _zip(path, members: dict):
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, json.dumps(data))


def _sharc_row(identifier, answer, history=()):
    return {"utterance_id": identifier, "tree_id": "tree-7", "source_url": "https://www.gov.uk/benefits",
            "snippet": "## Eligibility\n* You must be over 18.", "question": "Can I claim?",
            "scenario": "I am 20.", "history": [{"follow_up_question": q, "follow_up_answer": a} for q, a in history],
            "evidence": [], "answer": answer}


def test_sharc_answers_become_four_actions_and_the_archive_splits_are_kept(tmp_path):
    source = manifest()["sharc"]
    _zip(local_path(tmp_path, source, source.files[0]), {
        "sharc1-official/json/sharc_train.json": [_sharc_row("u1", "Yes", [("Are you over 18?", "Yes")]),
                                                  _sharc_row("u2", "Are you a resident?")],
        "sharc1-official/json/sharc_dev.json": [_sharc_row("u3", "Irrelevant")],
        "sharc1-official/json/sharc_test.json": [_sharc_row("u4", "no")]})
    found, missing = locate(source, tmp_path)
    assert missing == []
    rows = list(documents.sharc(source, found))
    assert [(row.record["id"], row.split, row.record["labels"]["action"]) for row in rows] == [
        ("u1", "train", "yes"), ("u2", "train", "follow_up"), ("u3", "dev", "irrelevant"), ("u4", "test", "no")]
    assert rows[0].record["state"] == {"rules": "## Eligibility\n* You must be over 18.", "question": "Can I claim?",
                                       "scenario": "I am 20.",
                                       "conversation": [{"question": "Are you over 18?", "answer": "Yes"}]}
    assert list(rows[0].record["questions"]["action"]["criteria"]) == ["yes", "no", "irrelevant", "follow_up"]
    assert rows[0].links == rows[3].links and rows[0].links[1] == "sharc-tree:tree-7"
    assert source.pinned_splits() == {"dev", "test"}


def test_contract_nli_gives_one_row_per_claim_and_the_claims_of_a_contract_link(tmp_path):
    source = manifest()["contract_nli"]
    labels = {"nda-1": {"short_description": "Explicit identification", "hypothesis": "All Confidential "
                        "Information shall be expressly identified by the Disclosing Party."},
              "nda-2": {"short_description": "No licensing", "hypothesis": "The agreement grants no license."}}

    def split(text):
        return {"documents": [{"id": 3, "file_name": "nda.pdf", "text": text, "document_type": "search-pdf",
                               "url": "https://example.org/nda.pdf", "spans": [[0, 10]],
                               "annotation_sets": [{"annotations": {
                                   "nda-1": {"choice": "NotMentioned", "spans": []},
                                   "nda-2": {"choice": "Entailment", "spans": [0]}}}]}],
                "labels": labels}
    _zip(local_path(tmp_path, source, source.files[0]), {
        "contract-nli/train.json": split("This Agreement grants no license."),
        "contract-nli/dev.json": split("A second agreement."), "contract-nli/test.json": split("A third one.")})
    found, _ = locate(source, tmp_path)
    rows = list(documents.contract_nli(source, found))
    assert len(rows) == 6 and [row.split for row in rows] == ["train", "train", "dev", "dev", "test", "test"]
    first, second = rows[:2]
    assert first.record["state"] == {"contract": "This Agreement grants no license.",
                                     "claim": labels["nda-1"]["hypothesis"]}
    assert (first.record["labels"], second.record["labels"]) == ({"relation": "NotMentioned"},
                                                                 {"relation": "Entailment"})
    assert first.links == second.links != rows[2].links


def test_esci_keeps_the_small_task_a_group_per_locale_and_joins_products(tmp_path):
    source = manifest()["esci"]
    examples = pd.DataFrame({
        "example_id": [1, 2, 3, 4, 5], "query": ["red shoes", "red shoes", "zapatos", "靴", "big set only"],
        "query_id": [10, 10, 11, 12, 13], "product_id": ["A1", "A2", "B1", "C1", "A1"],
        "product_locale": ["us", "us", "es", "jp", "us"], "esci_label": ["E", "I", "S", "C", "E"],
        "small_version": [1, 1, 1, 1, 0], "large_version": [1, 1, 1, 1, 1],
        "split": ["train", "train", "test", "train", "train"]})
    products = pd.DataFrame({
        "product_id": ["A1", "A2", "B1", "C1"], "product_title": ["Red running shoe", "Blue hat", "Zapato", "靴"],
        "product_description": [None, "A hat.", "", "説明"], "product_bullet_point": ["Light", None, None, None],
        "product_brand": ["Acme", "Hatco", None, None], "product_color": ["red", "blue", None, None],
        "product_locale": ["us", "us", "es", "jp"]})
    examples.to_parquet(local_path(tmp_path, source, source.files[0]))
    products.to_parquet(local_path(tmp_path, source, source.files[1]))
    found, _ = locate(source, tmp_path)
    rows = {row.record["id"]: row for row in documents.esci(source, found)}
    assert sorted(rows) == ["1", "2", "3", "4"]  # the large-only judgement is left out
    first = rows["1"]
    assert first.record["group"] == "esci_us" and first.split == "train"
    assert first.record["state"] == {"query": "red shoes", "product": {
        "title": "Red running shoe", "description": "", "bullet_point": "Light", "brand": "Acme", "color": "red"}}
    assert first.record["labels"] == {"match": "E"} and list(first.record["questions"]["match"]["criteria"]) == list(
        "ESCI")
    assert rows["3"].record["group"] == "esci_es" and rows["3"].split == "test"
    assert rows["4"].record["group"] == "esci_jp"
    assert rows["1"].links == rows["2"].links == ("esci-query:us:10",)
