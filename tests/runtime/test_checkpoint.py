"""The checkpoint module: adapter files round-trip and refuse what does not fit the model."""

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from dohnuts.config import ConfigError, LoraConfig, ModelConfig
from dohnuts.io import read_json, write_json, write_manifest
from dohnuts.runtime.checkpoint import (
    CALIBRATION,
    SETTINGS,
    TEMPERATURES,
    build_training_model,
    load_adapter,
    read_merged,
    save_adapter,
)


def test_adapter_round_trip_and_refusal_of_foreign_keys_and_shapes(tiny, tmp_path):
    model, peft_model = build_training_model(tiny.base, "float32", LoraConfig(), 0.01, seed=0)
    with torch.no_grad():
        model.head.weight.fill_(0.5)
    save_adapter(tmp_path / "a.safetensors", model, peft_model)
    fresh, fresh_peft = build_training_model(tiny.base, "float32", LoraConfig(), 0.01, seed=1)
    load_adapter(tmp_path / "a.safetensors", fresh, fresh_peft)
    assert torch.equal(fresh.head.weight, model.head.weight)

    state = load_file(str(tmp_path / "a.safetensors"))
    key = next(k for k in state if "lora_A" in k)
    save_file({**state, key: torch.zeros(3, 3)}, str(tmp_path / "shape.safetensors"))
    with pytest.raises(ValueError, match="mis-shaped"):
        load_adapter(tmp_path / "shape.safetensors", fresh, fresh_peft)
    save_file({k: v for k, v in state.items() if k != key}, str(tmp_path / "missing.safetensors"))
    with pytest.raises(ValueError, match="1 missing keys"):
        load_adapter(tmp_path / "missing.safetensors", fresh, fresh_peft)
    save_file({**state, "lora.extra.weight": torch.zeros(1)}, str(tmp_path / "extra.safetensors"))
    with pytest.raises(ValueError, match="1 unexpected keys"):
        load_adapter(tmp_path / "extra.safetensors", fresh, fresh_peft)


def test_a_checkpoint_from_before_choice_order_keeps_the_given_order(deployable, tmp_path):
    root, _ = deployable
    folder = tmp_path / "old"
    shutil.copytree(root / "checkpoint", folder)
    settings = read_json(folder / SETTINGS)
    assert settings["model"]["choice_order"] == "hashed"  # what the pipeline writes now
    del settings["model"]["choice_order"], settings["model"]["choice_salt"]
    write_json(folder / SETTINGS, settings)
    write_manifest(folder)
    model_config, _ = read_merged(folder, need_calibration=True)
    assert model_config.choice_order == "given" and model_config.order_salt is None
    assert read_merged(root / "checkpoint", need_calibration=True)[0].order_salt == "dohnuts-choice-1"


def test_choice_order_settings_are_checked():
    with pytest.raises(ConfigError, match="choice_order must be one of"):
        ModelConfig(choice_order="sorted")
    with pytest.raises(ConfigError, match="choice_salt must be 1 to 64 bytes"):
        ModelConfig(choice_salt="")


def test_a_checkpoint_with_the_older_temperatures_loads_as_one_temperature_a_type(deployable, tmp_path):
    root, _ = deployable
    folder = tmp_path / "older"
    shutil.copytree(root / "checkpoint", folder)
    (folder / CALIBRATION).unlink()
    write_json(folder / TEMPERATURES, {"choice": 2.0, "noul": 1.0, "score": 0.5})
    write_manifest(folder)
    _, calibrator = read_merged(folder, need_calibration=True)
    assert calibrator.cell("choice", 7).temperature == 2.0 and calibrator.cell("score", 3).temperature == 0.5
    assert calibrator.risks == []  # no abstention thresholds: predict(risk=...) says so
    write_json(folder / TEMPERATURES, {"choice": -1.0, "noul": 1.0, "score": 1.0})
    write_manifest(folder)
    with pytest.raises(ValueError, match="must give a positive temperature"):
        read_merged(folder, need_calibration=True)
