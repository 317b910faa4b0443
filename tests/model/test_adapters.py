"""LoRA adapters: placement on the language model only, a frozen vision tower."""

from dohnuts.config import LoraConfig
from dohnuts.runtime.checkpoint import build_training_model


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
