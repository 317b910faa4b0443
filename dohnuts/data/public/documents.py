"""Decisions over documents, from the sources' own releases: ShARC (rules and a conversation),
ContractNLI (a contract and a claim) and the Amazon Shopping Queries Dataset (ESCI: a query and
a product)."""

from __future__ import annotations

import zipfile
from collections.abc import Iterator
from pathlib import Path

from ..guard import fingerprint
from ..isolation import stable_fraction
from .readers import parquet_rows, zip_json
from .rows import Converted
from .sources import Source

SHARC_SPLITS = {"train": "train", "dev": "dev", "test": "test"}
SHARC_ACTIONS = {
    "yes": "the rules support answering yes",
    "no": "the rules support answering no",
    "irrelevant": "the rules do not address the question",
    "follow_up": "ask the user a follow-up question first",
}
CONTRACT_RELATIONS = {
    "Entailment": "the contract implies the claim",
    "Contradiction": "the contract contradicts the claim",
    "NotMentioned": "the contract does not address the claim",
}
ESCI_LABELS = {
    "E": "exact: the product matches the query",
    "S": "substitute: it does not match, but could stand in for what was asked",
    "C": "complement: it goes with what was asked",
    "I": "irrelevant: it fails a central part of the query",
}
ESCI_LOCALES = ("us", "es", "jp")
# Queries kept per locale, in a fixed hash order (every judgement of a kept query is kept): the
# Task 1 set holds tens of thousands of queries of about 20 judgements each.
ESCI_QUERIES = {"train": 600, "test": 75}
PRODUCT_FIELDS = ("title", "description", "bullet_point", "brand", "color")


def _archive(source: Source, found: dict[str, list[Path]]) -> Path:
    (path,) = found[source.files[0].path]
    return path


def _member(archive: Path, suffix: str) -> str | None:
    """The member of a zip archive whose name ends with `suffix`, or None."""
    with zipfile.ZipFile(archive) as handle:
        return next((name for name in handle.namelist() if name.endswith(suffix)), None)


def sharc(source, found) -> Iterator[Converted]:
    """ShARC 1.0: given the rules, the question, the scenario and the conversation so far, what
    should the agent do (choice of 4; an answer that is a follow-up question is `follow_up`).
    Utterances of one rule text or one source page link."""
    archive = _archive(source, found)
    for split in SHARC_SPLITS:
        member = _member(archive, f"json/sharc_{split}.json")
        if member is None:
            continue  # the release's test file came later; older archives have train and dev only
        for row in zip_json(archive, member):
            answer = row["answer"].strip().casefold()
            action = answer if answer in ("yes", "no", "irrelevant") else "follow_up"
            state = {"rules": row["snippet"], "question": row["question"], "scenario": row.get("scenario", ""),
                     "conversation": [{"question": turn["follow_up_question"], "answer": turn["follow_up_answer"]}
                                      for turn in row.get("history", [])]}
            record = {"id": row["utterance_id"], "group": "sharc", "state": state,
                      "questions": {"action": {"type": "choice", "criteria": SHARC_ACTIONS,
                                               "instructions": "Given the rules and the conversation, what should "
                                                               "the agent do next?"}},
                      "labels": {"action": action}}
            links = (f"sharc-rules:{fingerprint(row['snippet'])}",)
            if row.get("tree_id"):
                links += (f"sharc-tree:{row['tree_id']}",)
            yield Converted(record, SHARC_SPLITS[split], links)


def contract_nli(source, found) -> Iterator[Converted]:
    """ContractNLI: how a whole non-disclosure agreement relates to each of 17 claims (choice
    of 3); the claims of one contract link."""
    archive = _archive(source, found)
    for split in ("train", "dev", "test"):
        member = _member(archive, f"contract-nli/{split}.json")
        if member is None:
            raise ValueError(f"{archive}: no contract-nli/{split}.json in the archive")
        data = zip_json(archive, member)
        claims = {key: label["hypothesis"] for key, label in data["labels"].items()}
        for document in data["documents"]:
            for key, annotation in document["annotation_sets"][0]["annotations"].items():
                record = {"id": f"{split}:{document['id']}:{key}", "group": "contract_nli",
                          "state": {"contract": document["text"], "claim": claims[key]},
                          "questions": {"relation": {"type": "choice", "criteria": CONTRACT_RELATIONS,
                                                     "instructions": "How does the contract relate to the claim?"}},
                          "labels": {"relation": annotation["choice"]}}
                yield Converted(record, split, (f"contract:{fingerprint(document['text'])}",))


def esci(source, found) -> Iterator[Converted]:
    """The Shopping Queries Dataset (Task 1, the small version): how well a product matches a
    query (E/S/C/I), one group per locale; the judgements of one query link. Up to
    ESCI_QUERIES queries per locale and official split, in hash order."""
    examples_path = next(path for file in source.files if "examples" in file.path for path in found[file.path])
    products_path = next(path for file in source.files if "products" in file.path for path in found[file.path])
    queries: dict[tuple, list[dict]] = {}
    for row in parquet_rows(examples_path, ["example_id", "query", "query_id", "product_id", "product_locale",
                                            "esci_label", "small_version", "split"]):
        if row["small_version"] == 1 and row["product_locale"] in ESCI_LOCALES:
            queries.setdefault((row["split"], row["product_locale"], row["query_id"]), []).append(row)
    kept = []
    for split, limit in ESCI_QUERIES.items():
        for locale in ESCI_LOCALES:
            keys = sorted((key for key in queries if key[0] == split and key[1] == locale),
                          key=lambda key: stable_fraction("esci", *key))
            kept += keys[:limit]
    needed = {(row["product_locale"], row["product_id"]) for key in kept for row in queries[key]}
    products = {}
    for row in parquet_rows(products_path):
        if (row["product_locale"], row["product_id"]) in needed:
            products[(row["product_locale"], row["product_id"])] = {
                field: row.get(f"product_{field}") or "" for field in PRODUCT_FIELDS}
    for key in kept:
        split, locale, query_id = key
        for row in queries[key]:
            product = products.get((locale, row["product_id"]))
            if product is None:
                continue  # a judgement of a product the products table lacks
            record = {"id": str(row["example_id"]), "group": f"esci_{locale}",
                      "state": {"query": row["query"], "product": product},
                      "questions": {"match": {"type": "choice", "criteria": ESCI_LABELS,
                                              "instructions": "How well does the product match the search query?"}},
                      "labels": {"match": row["esci_label"]}}
            yield Converted(record, split, (f"esci-query:{locale}:{query_id}",))


CONVERTERS = {"sharc": sharc, "contract_nli": contract_nli, "esci": esci}
