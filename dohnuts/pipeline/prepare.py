"""The prepare step: the base model folder and the decision mixture, each with a manifest."""

from __future__ import annotations

from pathlib import Path

from ..config import DataConfig, ModelConfig, to_dict
from ..data import synthetic
from ..data.records import write_mixture
from ..io import atomic_directory, write_manifest
from ..model.base import prepare_base


def prepare(model: ModelConfig, data: DataConfig, base_out: Path, data_root: Path) -> dict:
    """Write the base (HF format) to `base_out` and one folder per partition under `data_root`.

    Returns:
        {"partitions": row, state and group counts per partition, "isolation": what isolation by
        content joined and dropped (`dohnuts.data.records.write_mixture`)}
    """
    with atomic_directory(base_out) as tmp:
        prepare_base(model, tmp, synthetic.corpus(data.seed))
        write_manifest(tmp, {"model": to_dict(model)})
    states = synthetic.generate(data.seed, data.states_per_group, data.image_size)
    return write_mixture(states, data_root, data.seed, data.partitions)


def describe(summary: dict) -> str:
    """One line for the console: rows per partition, drops, cross-partition duplicates."""
    rows = " ".join(f"{name}={value['rows']} rows" for name, value in summary["partitions"].items())
    isolation = summary["isolation"]
    dropped = sum(sum(groups.values()) for groups in isolation["drops"].values())
    shared = isolation["cross_partition"]
    return (f"{rows}; {isolation['joined_states']} states joined by shared content, {dropped} rows or states "
            f"dropped; in two partitions: {shared['texts']} texts, {shared['images']} images")
