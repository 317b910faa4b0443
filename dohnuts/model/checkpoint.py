"""Merged and deployable checkpoint folders: write, verify, load."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..config import ModelConfig, build, json_ready, to_dict
from ..io import read_json, verify_manifest, write_json, write_manifest
from ..schema import QUESTION_TYPES
from .base import load_backbone, load_processors
from .decision import DTYPES, HEAD_KEY, DecisionModel
from .template import Template

HEAD = "head.safetensors"
SETTINGS = "dohnuts.json"
TEMPERATURES = "temperatures.json"


def write_merged(folder: Path, backbone, head: torch.nn.Linear, tokenizer, image_processor,
                 model_config: ModelConfig, resolved: dict, temperatures: dict | None = None) -> None:
    """Write a self-describing folder: HF backbone, head, tokenizer, processor, settings, manifest.

    With `temperatures` it is the deployable checkpoint `Predictor.from_checkpoint` loads.
    """
    folder = Path(folder)
    backbone.save_pretrained(folder)
    save_file({HEAD_KEY: head.weight.detach().float().cpu().contiguous()}, str(folder / HEAD))
    tokenizer.save_pretrained(folder)
    image_processor.save_pretrained(folder)
    write_json(folder / SETTINGS, {"model": to_dict(model_config), "resolved": json_ready(resolved)})
    if temperatures is not None:
        write_json(folder / TEMPERATURES, {kind: float(temperatures[kind]) for kind in QUESTION_TYPES})
    write_manifest(folder)


def load_merged(folder: Path, device: torch.device, need_temperatures: bool = False):
    """Load a merged folder after checking every SHA-256.

    Returns:
        (DecisionModel in eval mode on `device`, Template, ModelConfig, temperatures or None)
    """
    folder = Path(folder)
    if need_temperatures and (folder / SETTINGS).is_file() and not (folder / TEMPERATURES).is_file():
        raise ValueError(f"{folder} is a merged model without temperatures: run the calibrate stage and "
                         f"load its output (runs/calibrate/checkpoint)")
    required = (HEAD, SETTINGS) + ((TEMPERATURES,) if need_temperatures else ())
    verify_manifest(folder, required=required)
    settings = read_json(folder / SETTINGS)
    model_config = build(ModelConfig, settings["model"], f"{folder}/{SETTINGS} model")
    backbone = load_backbone(folder, DTYPES[model_config.dtype])
    head = torch.nn.Linear(backbone.config.text_config.hidden_size, 1, bias=False, dtype=torch.float32)
    with torch.no_grad():
        head.weight.copy_(load_file(str(folder / HEAD))[HEAD_KEY])
    model = DecisionModel(backbone, head).to(device).eval()
    model.requires_grad_(False)
    tokenizer, processor = load_processors(folder, model_config)
    template = Template(tokenizer, processor, model_config.marker_token)
    temperatures = None
    if (folder / TEMPERATURES).is_file():
        temperatures = {kind: float(value) for kind, value in read_json(folder / TEMPERATURES).items()}
        bad = {kind: value for kind, value in temperatures.items() if not value > 0}
        if set(temperatures) != set(QUESTION_TYPES) or bad:
            raise ValueError(f"{folder}/{TEMPERATURES} must give a positive temperature for each of "
                             f"{QUESTION_TYPES}, got {json.dumps(temperatures)}")
    return model, template, model_config, temperatures
