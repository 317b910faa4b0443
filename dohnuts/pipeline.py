"""The select, merge, calibrate and test steps, each writing its outputs atomically."""

from __future__ import annotations

import io as _io
import shutil
from pathlib import Path

import pandas as pd
import torch

from .base import load_processors
from .calibration import fit_temperatures
from .checkpoint import load_merged, write_merged
from .config import CalibrateConfig, LoraConfig, ModelConfig, SelectConfig, TestConfig
from .data import RecordReader, hash_order, load_records
from .evaluate import evaluate, padded, score_table
from .io import atomic_directory, read_json, verify_manifest, write_bytes
from .model import build_training_model, default_device, load_adapter
from .template import Template
from .train import ADAPTER


def write_parquet(path: Path, table: pd.DataFrame) -> None:
    buffer = _io.BytesIO()
    table.to_parquet(buffer, index=False)
    write_bytes(path, buffer.getvalue())


def _adapter_model(base: Path, model: ModelConfig, lora: LoraConfig, adapter: Path, device):
    """The base with LoRA and head loaded from a verified adapter folder."""
    verify_manifest(adapter, required=(ADAPTER,))
    decision, peft_model = build_training_model(base, model.dtype, lora, 0.01, seed=0)
    load_adapter(adapter / ADAPTER, decision, peft_model)
    return decision.to(device).eval(), peft_model


def select(checkpoints: Path, base: Path, data: Path, model: ModelConfig, lora: LoraConfig,
           config: SelectConfig, adapter_out: Path, table_out: Path) -> dict:
    """Evaluate every checkpoint on the dev subset; keep the best macro accuracy (ties: earliest).

    Writes the selected checkpoint folder to `adapter_out` and the selection table (Parquet)
    to `table_out`; returns the metrics dict.
    """
    folders = sorted(Path(checkpoints).glob("step-*"))
    if not folders:
        raise FileNotFoundError(f"no step-* checkpoints in {checkpoints}: run the train stage first")
    device = default_device()
    tokenizer, processor = load_processors(base, model)
    template = Template(tokenizer, processor, model.marker_token)
    reader = RecordReader(data)
    dev = hash_order(load_records(data), config.dev_rows_per_group)
    table = []
    for folder in folders:
        decision, _ = _adapter_model(base, model, lora, folder, device)
        logits = evaluate(decision, template, reader, dev, config.batch_rows, model.max_tokens, desc=folder.name)
        _, summary = score_table(logits)
        step = read_json(folder / "manifest.json")["step"]
        table.append({"checkpoint": folder.name, "step": step, "macro_accuracy": summary["macro"]["accuracy"],
                      **{f"accuracy/{g}": v["accuracy"] for g, v in summary["groups"].items()}})
    selection = pd.DataFrame(table).sort_values("step").reset_index(drop=True)
    # Strictly higher replaces the best: idxmax returns the first (earliest) maximum.
    best = selection.loc[selection.macro_accuracy.idxmax()]
    with atomic_directory(adapter_out) as tmp:
        shutil.copytree(Path(checkpoints) / best.checkpoint, tmp, dirs_exist_ok=True)
    write_parquet(table_out, selection)
    return {"selected_step": int(best.step), "dev_macro_accuracy": float(best.macro_accuracy),
            "dev_rows": int(len(dev)), "checkpoints": int(len(selection))}


def merge(base: Path, adapter: Path, model: ModelConfig, lora: LoraConfig, out: Path) -> None:
    """Fold LoRA into the frozen base; write the merged model folder (no temperatures yet)."""
    decision, peft_model = _adapter_model(base, model, lora, adapter, torch.device("cpu"))
    merged = peft_model.merge_and_unload()
    tokenizer, processor = load_processors(base, model)
    resolved = {"adapter": read_json(Path(adapter) / "config.json"),
                "adapter_manifest": read_json(Path(adapter) / "manifest.json")}
    with atomic_directory(out) as tmp:
        write_merged(tmp, merged, decision.head, tokenizer, processor, model, resolved)


def calibrate(merged: Path, data: Path, config: CalibrateConfig, out: Path) -> dict:
    """Fit one temperature per question type on the calibration partition with the merged model;
    write the deployable checkpoint to `out`. Returns the metrics dict."""
    device = default_device()
    model, template, model_config, _ = load_merged(merged, device)
    rows = load_records(data)
    table = evaluate(model, template, RecordReader(data), rows, config.batch_rows, model_config.max_tokens,
                     desc="calibrate")
    logits, mask, targets = padded(table)
    temperatures = fit_temperatures(logits, mask, targets, list(table.kind), min_rows=config.min_rows,
                                    lr=config.lr, iterations=config.iterations,
                                    bounds=(config.min_temperature, config.max_temperature))
    _, raw = score_table(table)
    _, calibrated = score_table(table, temperatures)
    resolved = {**read_json(Path(merged) / "dohnuts.json")["resolved"], "calibrate": vars(config)}
    with atomic_directory(out) as tmp:
        write_merged(tmp, model.backbone, model.head, template.tokenizer, template.image_processor,
                     model_config, resolved, temperatures)
    counts = table.kind.value_counts().to_dict()
    return {"temperatures": temperatures, "rows": {kind: int(counts.get(kind, 0)) for kind in temperatures},
            "nll_raw": raw["macro"]["nll"], "nll_calibrated": calibrated["macro"]["nll"]}


def test(checkpoint: Path, data: Path, config: TestConfig) -> tuple[pd.DataFrame, dict]:
    """Raw and calibrated metrics on the test partition with the deployable checkpoint.

    Returns:
        (per-example predictions, metrics dict)
    """
    from .predict import Predictor

    predictor = Predictor.from_checkpoint(checkpoint)
    rows = load_records(data)
    table = evaluate(predictor.model, predictor.template, RecordReader(data), rows, config.batch_rows,
                     predictor.config.max_tokens, desc="test")
    _, raw = score_table(table)
    scored, calibrated = score_table(table, predictor.temperatures)
    return scored.drop(columns=["shared_meaning"]), {
        "calibrated": calibrated, "raw": raw, "temperatures": predictor.temperatures}


