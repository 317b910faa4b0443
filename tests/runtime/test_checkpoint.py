"""The checkpoint module: adapter files round-trip and refuse what does not fit the model."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from dohnuts.config import LoraConfig
from dohnuts.runtime.checkpoint import build_training_model, load_adapter, save_adapter


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
