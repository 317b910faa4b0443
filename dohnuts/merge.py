"""The merge step: LoRA folded into the frozen base, written as a self-describing folder."""

from __future__ import annotations

from pathlib import Path

import torch

from .base import load_processors
from .checkpoint import write_merged
from .config import LoraConfig, ModelConfig
from .io import atomic_directory, read_json
from .model import load_adapter_model


def merge(base: Path, adapter: Path, model: ModelConfig, lora: LoraConfig, out: Path) -> None:
    """Fold LoRA into the frozen base; write the merged model folder (no temperatures yet)."""
    decision, peft_model = load_adapter_model(base, model.dtype, lora, adapter, torch.device("cpu"))
    merged = peft_model.merge_and_unload()
    tokenizer, processor = load_processors(base, model)
    resolved = {"adapter": read_json(Path(adapter) / "config.json"),
                "adapter_manifest": read_json(Path(adapter) / "manifest.json")}
    with atomic_directory(out) as tmp:
        write_merged(tmp, merged, decision.head, tokenizer, processor, model, resolved)
