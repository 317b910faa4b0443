"""The prepare step: the base model folder and the decision mixture, each with a manifest."""

from __future__ import annotations

from pathlib import Path

from ..config import DataConfig, ModelConfig, to_dict
from ..data import synthetic
from ..data.doctor import budget_exclusion, diagnose, token_lengths
from ..data.guard import guarded, read_guard
from ..data.image_files import shown_text
from ..data.public.mixture import public_states
from ..data.records import partition_rows, write_partition
from ..data.user_records import RecordsError, read_records
from ..inputs.template import Template
from ..inputs.tokens import special_tokens
from ..io import atomic_directory, write_manifest
from ..model.base import load_processors, prepare_base


def source_states(model: ModelConfig, data: DataConfig) -> tuple[list, list, dict | None]:
    """The states of the configured source, the problems of its invalid records, and for the
    public mixture what was read from each source (None otherwise).

    Raises:
        RecordsError: invalid records, unless data.skip_invalid (then they are left out).
        MissingSources: public raw files not in the local cache (every one named).
    """
    reserved = tuple(special_tokens(model.marker_token))
    if data.source == "synthetic":
        return synthetic.generate(data.seed, data.states_per_group, data.image_size), [], None
    if data.source == "public":
        # The sources' own rows are not the user's to fix: invalid ones are dropped and counted.
        return public_states(data.cache, data.seed, data.public_pool, data.groups or None, reserved)
    states, problems = read_records(Path(data.path), reserved, model.max_images)
    if problems and not data.skip_invalid:
        raise RecordsError(problems)
    return states, problems, None


def exclusion(lengths: dict, train_tokens: int, inference_tokens: int, guard: frozenset[str] | None):
    """`partition_rows`' exclude: the token budgets, then the guard's fingerprints."""
    budget = budget_exclusion(lengths, train_tokens, inference_tokens)
    rendered: dict[str, str] = {}

    def exclude(state, qid, partition):
        if guard:
            text = rendered.setdefault(state.state_id, shown_text(state.state))
            if guarded(state.state, text, guard):
                return "guard"
        return budget(state, qid, partition)
    return exclude


class UntestedGroups(ValueError):
    """A group has no test rows (and `data.allow_untested_groups` is off)."""


def prepare(model: ModelConfig, data: DataConfig, train_tokens: int, base_out: Path, data_root: Path,
            train_cap: int | None = None) -> dict:
    """Write the base (HF format) to `base_out` and one folder per partition under `data_root`.

    The records are validated before anything is written. Rows over the inference budget
    (model.max_tokens) leave every partition, rows over the training budget (`train_tokens`)
    leave train, rows the guard names leave every partition, and train keeps at most
    `train_cap` rows a group (training's own cap, in its hash order); all are counted, nothing
    is truncated.

    Returns:
        {"partitions": row, state and group counts per partition, "isolation": what isolation by
        content joined and dropped (`dohnuts.data.records.partition_rows`), "doctor": the data
        doctor's report (`dohnuts.data.doctor.diagnose`)}

    Raises:
        RecordsError: invalid records (nothing is written), unless data.skip_invalid.
        UntestedGroups: a group with no test rows (no partition is written), unless
            data.allow_untested_groups.
    """
    guard = read_guard(Path(data.guard)) if data.guard else None
    states, problems, public = source_states(model, data)
    with atomic_directory(base_out) as tmp:
        prepare_base(model, tmp, synthetic.corpus(data.seed))
        write_manifest(tmp, {"model": to_dict(model)})
    tokenizer, processor = load_processors(base_out, model)
    lengths = token_lengths(Template.of(tokenizer, processor, model), states)
    records, images, isolation = partition_rows(states, data.seed, data.partitions,
                                                exclusion(lengths, train_tokens, model.max_tokens, guard), train_cap)
    report = diagnose(states, problems, records, isolation, lengths,
                      {"training": train_tokens, "inference": model.max_tokens})
    untested = sorted({state.group for state in states} - {row["group"] for row in records["test"]})
    if untested and not data.allow_untested_groups:
        raise UntestedGroups(f"groups with no test rows, so never scored: {untested}. Isolation joins states "
                             f"that share an image, a source id, a link or an identifying text, and each joined "
                             f"component lands whole in one partition: see runs/prepare's doctor report for each "
                             f"group's partitions. Add states, or set data.allow_untested_groups: true")
    counts = {name: write_partition(rows, images, Path(data_root) / name, name, isolation)
              for name, rows in records.items()}
    summary = {"partitions": counts, "isolation": isolation, "doctor": report}
    if public is not None:
        summary["public"] = public
    return summary


def describe(summary: dict) -> str:
    """One line for the console: rows per partition, drops, cross-partition duplicates."""
    rows = " ".join(f"{name}={value['rows']} rows" for name, value in summary["partitions"].items())
    isolation = summary["isolation"]
    dropped = sum(sum(groups.values()) for groups in isolation["drops"].values())
    shared = isolation["cross_partition"]
    return (f"{rows}; {isolation['joined_states']} states joined by shared content, {dropped} rows or states "
            f"dropped; in two partitions: {shared['texts']} texts, {shared['images']} images")
