"""LoRA adapters: placement on the language model only, a frozen vision tower, adapter files."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from dohnuts.config import LoraConfig
from dohnuts.model.adapters import build_training_model, load_adapter, save_adapter


def test_lora_targets_only_the_language_model(tiny):
    model, peft_model = build_training_model(tiny.base, "float32", LoraConfig(), 0.01, seed=0)
    adapted = {name.rsplit(".lora_A", 1)[0] for name, _ in model.backbone.named_parameters() if ".lora_A" in name}
    assert adapted and all(".language_model." in name or name.startswith("language_model.") for name in adapted)
    layer_types = model.backbone.config.text_config.layer_types
    # Gated delta-rule layers: 5 projections + 3 MLP; attention layers: 4 projections + 3 MLP.
    expected = sum(8 if kind == "linear_attention" else 7 for kind in layer_types)
    assert len(adapted) == expected
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert all("lora_" in name or name == "head.weight" for name in trainable)
    assert "head.weight" in trainable


def test_vision_tower_stays_frozen_and_in_eval_mode(tiny):
    model, _ = build_training_model(tiny.base, "float32", LoraConfig(), 0.01, seed=0)
    model.train()
    assert not model.backbone.visual.training
    assert not any(p.requires_grad for p in model.backbone.visual.parameters())
    assert model.backbone.language_model.training


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
