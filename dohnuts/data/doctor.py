"""The data doctor: one report of everything that would silently spoil a run on a mixture.

Per group and question type: records, questions and labels; the label distribution per
option, with the options never labelled in train; state and row token lengths against the
training and inference budgets (rows over them are excluded and counted, never truncated);
duplicates and cross-partition drops; unreadable or tiny images; groups too small for dev,
calibration or test. `prepare` runs it and writes the report beside the partitions.
"""

from __future__ import annotations

import statistics
from collections import Counter

from ..inputs.batch import EncodedImage
from ..inputs.template import Template
from ..inputs.tokens import special_tokens
from ..model.base import load_processors
from ..schema import parse_request
from .image_files import pil_state, state_images
from .isolation import PARTITIONS
from .records import partition_rows
from .user_records import read_records

TINY_IMAGE = 32  # pixels: a side below this carries little for the vision tower to see
SHOWN_PROBLEMS = 50


def token_lengths(template: Template, states) -> dict[tuple[str, str], tuple[int, int]]:
    """(state tokens, row tokens) of every (state_id, qid), as the template renders them."""
    lengths, encoded = {}, {}

    def grid_only(image, key, data):
        # A public source shows one image in many rows (CLEVR: 10 questions a scene): preprocess
        # it once, and keep only its grid (all the token count needs).
        if key not in encoded:
            encoded[key] = EncodedImage(None, template.encode_image(image, key, data).grid_thw, key)
        return encoded[key]

    for state in states:
        request = parse_request(pil_state(state.state), state.questions, template.reserved, template.max_images)
        images = []
        indices = template.encode_images(request, images, encode=grid_only)
        rows = template.encode(request, 2**62, indices, images)
        shared = rows[0].shared
        for row in rows:
            lengths[(state.state_id, row.question.qid)] = (shared, len(row.input_ids))
    return lengths


def budget_exclusion(lengths: dict, train_tokens: int, inference_tokens: int):
    """The `exclude(state, qid, partition)` of `partition_rows` for the token budgets: a row
    over the inference budget leaves every partition, one over the training budget leaves train."""
    def exclude(state, qid, partition):
        tokens = lengths[(state.state_id, qid)][1]
        if tokens > inference_tokens:
            return "over_inference_budget"
        if partition == "train" and tokens > train_tokens:
            return "over_training_budget"
        return None
    return exclude


def _spread(values: list[int]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)} if values else {}


def diagnose(states, problems, records: dict, isolation: dict, lengths: dict | None, budgets: dict) -> dict:
    """The doctor's report (plain JSON types).

    Args:
        states: the valid states (`SourceState` or synthetic) before partitioning.
        problems: the invalid records' `Problem`s (dropped when data.skip_invalid, else fatal).
        records: {partition: rows} as `partition_rows` makes them; isolation: its report.
        lengths: `token_lengths` of the states, or None when no tokenizer was given.
        budgets: {"training": tokens, "inference": tokens}.
    """
    by_group: dict[str, list] = {}
    for state in states:
        by_group.setdefault(state.group, []).append(state)
    rows_in = {name: Counter(row["group"] for row in rows) for name, rows in records.items()}
    train_mass: dict[tuple, float] = Counter()
    for row in records.get("train", []):
        for index, value in enumerate(row["target"]):
            train_mass[(row["group"], row["qid"], index)] += value
    groups = {}
    for group, members in sorted(by_group.items()):
        types: dict[str, dict] = {}
        images, tiny, per_state = 0, 0, []
        for state in members:
            shown = state_images(state.state)
            per_state.append(len(shown))
            images += len(shown)
            tiny += sum(min(image.size) < TINY_IMAGE for image in shown)
            for qid, question in state.questions.items():
                kind = question["type"]
                entry = types.setdefault(kind, {"questions": 0, "soft_labels": 0, "options": {}})
                entry["questions"] += 1
                target = state.targets[qid]
                entry["soft_labels"] += max(target) < 1.0
                names = _candidate_names(question, len(target))
                for index, (name, value) in enumerate(zip(names, target)):
                    option = entry["options"].setdefault(f"{qid}:{name}", {"labelled": 0, "mass": 0.0,
                                                                           "in_train": 0.0})
                    option["labelled"] += value == max(target) and value > 0
                    option["mass"] += value
                    option["in_train"] = train_mass.get((group, qid, index), 0.0)
        for entry in types.values():
            entry["never_labelled_in_train"] = sorted(name for name, option in entry["options"].items()
                                                      if option["in_train"] == 0.0)
        report = {"records": len(members), "questions": sum(len(s.questions) for s in members), "types": types,
                  "images": {"count": images, "tiny": tiny, "per_state": _spread(per_state)},
                  "partitions": {name: int(rows_in[name][group]) for name in PARTITIONS}}
        report["too_small_for"] = [name for name in ("dev", "calibration", "test") if not report["partitions"][name]]
        if lengths is not None:
            own = [lengths[(s.state_id, qid)] for s in members for qid in s.questions]
            report["tokens"] = {"state": _spread([state for state, _ in own]), "row": _spread([row for _, row in own]),
                                "over_training_budget": sum(row > budgets["training"] for _, row in own),
                                "over_inference_budget": sum(row > budgets["inference"] for _, row in own)}
        groups[group] = report
    return {"records": len(states), "invalid_records": len({problem.where for problem in problems}),
            "problems": [str(problem) for problem in problems[:SHOWN_PROBLEMS]], "problem_count": len(problems),
            "budgets": budgets, "token_lengths_checked": lengths is not None, "groups": groups,
            "isolation": isolation}


def _candidate_names(question: dict, count: int) -> list[str]:
    """The candidate labels of a raw question, in order (as the schema names them)."""
    criteria = question.get("criteria")
    if question["type"] == "noul":
        return ["false", "true"]
    if question["type"] == "score":
        return [str(level) for level in range(count)]
    return list(criteria) if isinstance(criteria, dict) else [str(item) for item in criteria]


def describe(report: dict) -> str:
    """The report as a readable summary for the console."""
    lines = [f"{report['records']} valid records, {report['invalid_records']} invalid "
             f"({report['problem_count']} problems)"]
    lines += [f"  {problem}" for problem in report["problems"][:10]]
    if report["problem_count"] > 10:
        lines.append(f"  ... and {report['problem_count'] - 10} more (all in the JSON report, up to 50)")
    header = f"{'group':24s} {'records':>7s} {'questions':>9s} " + " ".join(f"{name:>11s}" for name in PARTITIONS)
    lines += ["", header]
    warnings = []
    for group, entry in report["groups"].items():
        counts = " ".join(f"{entry['partitions'][name]:11d}" for name in PARTITIONS)
        lines.append(f"{group:24s} {entry['records']:7d} {entry['questions']:9d} {counts}")
        if entry["too_small_for"]:
            warnings.append(f"{group}: no rows in {', '.join(entry['too_small_for'])} (too few records)")
        for kind, summary in entry["types"].items():
            if summary["never_labelled_in_train"]:
                names = summary["never_labelled_in_train"]
                warnings.append(f"{group} {kind}: options never labelled in train: {', '.join(names[:8])}"
                                f"{' ...' if len(names) > 8 else ''}")
        tokens = entry.get("tokens")
        if tokens and (tokens["over_training_budget"] or tokens["over_inference_budget"]):
            warnings.append(f"{group}: {tokens['over_training_budget']} rows over the training budget, "
                            f"{tokens['over_inference_budget']} over the inference budget (excluded, not truncated)")
        if entry["images"]["tiny"]:
            warnings.append(f"{group}: {entry['images']['tiny']} images smaller than {TINY_IMAGE} pixels on a side")
    isolation = report["isolation"]
    drops = {reason: sum(groups.values()) for reason, groups in isolation["drops"].items()}
    lines += ["", f"isolation: {isolation['components']} components of {isolation['states']} states, "
                  f"{isolation['joined_states']} states joined by shared content; dropped: "
                  f"{', '.join(f'{n} {reason}' for reason, n in drops.items()) or 'nothing'}; in two partitions: "
                  f"{isolation['cross_partition']['texts']} texts, {isolation['cross_partition']['images']} images"]
    if not report["token_lengths_checked"]:
        warnings.append("token lengths not checked: no tokenizer given (--base)")
    lines += [""] + ([f"warning: {warning}" for warning in warnings] or ["no warnings"])
    return "\n".join(lines)


def examine(path, model, data, train_tokens: int, base=None) -> dict:
    """The doctor's report of the records at `path` without writing anything: validated,
    partitioned as prepare would (`data.seed`, `data.partitions`), token lengths measured with
    the tokenizer of `base` (a base or checkpoint folder) when given.

    Args:
        model, data: the ModelConfig (marker, inference budget) and DataConfig.
        train_tokens: the training token budget.
    """
    states, problems = read_records(path, tuple(special_tokens(model.marker_token)), model.max_images)
    lengths = None
    if base is not None:
        tokenizer, processor = load_processors(base, model)
        lengths = token_lengths(Template.of(tokenizer, processor, model), states)
    exclude = budget_exclusion(lengths, train_tokens, model.max_tokens) if lengths is not None else None
    records, _, isolation = partition_rows(states, data.seed, data.partitions, exclude)
    return diagnose(states, problems, records, isolation, lengths, {"training": train_tokens,
                                                                     "inference": model.max_tokens})
