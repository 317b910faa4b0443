"""The select step: every checkpoint on the dev partition, the best macro accuracy kept."""

from __future__ import annotations

import shutil
from pathlib import Path

import pandas as pd

from ..config import LoraConfig, ModelConfig, SelectConfig
from ..data.records import RecordReader, hash_order, load_records
from ..inputs.template import Template
from ..io import atomic_directory, read_json, write_json_files, write_parquet
from ..model.base import load_processors
from ..runtime.checkpoint import load_adapter_model, verify_base
from ..runtime.distributed import world
from ..runtime.evaluation import evaluate, score_table


def select(checkpoints: Path, base: Path, data: Path, model: ModelConfig, lora: LoraConfig,
           config: SelectConfig, adapter_out: Path, table_out: Path, curve_out: Path) -> dict | None:
    """Evaluate every checkpoint on the dev subset; keep the best macro accuracy (ties: earliest).

    Writes the selected checkpoint folder to `adapter_out`, the selection table (Parquet) to
    `table_out` and the selection curve's plot data to `curve_out` (curve.json: dev macro
    accuracy per step; selected.json: the selected step); returns the metrics dict. Under
    several processes the evaluation is sharded (`evaluate`); rank 0 alone writes and returns
    the metrics, the others return None.
    """
    folders = sorted(Path(checkpoints).glob("step-*"))
    if not folders:
        raise FileNotFoundError(f"no step-* checkpoints in {checkpoints}: run the train stage first")
    verify_base(base)
    place = world()
    device = place.device
    tokenizer, processor = load_processors(base, model)
    template = Template.of(tokenizer, processor, model)
    reader = RecordReader(data)
    dev = hash_order(load_records(data), config.dev_rows_per_group)
    table = []
    for folder in folders:
        decision, _ = load_adapter_model(base, model.dtype, lora, folder, device)
        logits = evaluate(decision, template, reader, dev, config.batch_tokens, model.max_tokens, desc=folder.name,
                          place=place)
        if logits is None:
            continue
        _, summary = score_table(logits)
        step = read_json(folder / "manifest.json")["step"]
        table.append({"checkpoint": folder.name, "step": step, "macro_accuracy": summary["macro"]["accuracy"],
                      **{f"accuracy/{g}": v["accuracy"] for g, v in summary["groups"].items()}})
    if not place.main:
        return None
    selection = pd.DataFrame(table)
    best = best_checkpoint(selection)
    with atomic_directory(adapter_out) as tmp:
        shutil.copytree(Path(checkpoints) / best.checkpoint, tmp, dirs_exist_ok=True)
    write_parquet(table_out, selection)
    points = [{"step": int(row.step), "macro_accuracy": float(row.macro_accuracy)}
              for row in selection.sort_values("step").itertuples()]
    write_json_files(curve_out, {"curve": points, "selected": [
        {"step": int(best.step), "macro_accuracy": float(best.macro_accuracy)}]})
    return {"selected_step": int(best.step), "dev_macro_accuracy": float(best.macro_accuracy),
            "dev_rows": int(len(dev)), "checkpoints": int(len(selection))}


def best_checkpoint(selection: pd.DataFrame) -> pd.Series:
    """The row with the highest macro accuracy; a later checkpoint replaces the best only when
    strictly higher, so ties go to the earliest step (step 0, the parent, included)."""
    ordered = selection.sort_values("step").reset_index(drop=True)
    return ordered.loc[ordered.macro_accuracy.idxmax()]
