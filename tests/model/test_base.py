"""The base folder: the embedded tiny Qwen3.5 and the Hub snapshot path."""

import huggingface_hub.constants
import pytest
import torch
from PIL import Image
from transformers import AutoConfig

from dohnuts.config import DataConfig, ModelConfig
from dohnuts.inputs.tokens import special_tokens
from dohnuts.model.base import load_backbone, load_processors
from dohnuts.pipeline.prepare import prepare


def test_embedded_base_is_a_hybrid_qwen3_5_in_hugging_face_format(tiny):
    config = AutoConfig.from_pretrained(tiny.base)
    assert config.model_type == "qwen3_5"
    assert set(config.text_config.layer_types) == {"linear_attention", "full_attention"}
    backbone = load_backbone(tiny.base, torch.float32)
    names = {name for name, _ in backbone.named_parameters()}
    assert {"language_model.layers.0.linear_attn.in_proj_qkv.weight", "language_model.layers.0.linear_attn.A_log",
            "language_model.layers.3.self_attn.q_proj.weight", "visual.patch_embed.proj.weight"} <= names
    assert not any("lm_head" in name for name in names)
    tokenizer, processor = load_processors(tiny.base, tiny.model)
    for token in special_tokens(tiny.model.marker_token):
        assert tokenizer.convert_ids_to_tokens(tokenizer.convert_tokens_to_ids(token)) == token
    assert tokenizer.convert_tokens_to_ids("<|image_pad|>") == config.image_token_id
    grid = processor(images=[Image.new("RGB", (96, 96))], return_tensors="pt")["image_grid_thw"]
    assert grid.tolist() == [[1, 4, 4]]  # 64*64 pixels policy, patch 16


def test_embedded_base_is_reproducible_from_its_seed(tiny, tmp_path):
    prepare(tiny.model, DataConfig(states_per_group=8, allow_untested_groups=True), 2048, tmp_path / "base", tmp_path)
    first = load_backbone(tiny.base, torch.float32).state_dict()
    second = load_backbone(tmp_path / "base", torch.float32).state_dict()
    assert all(torch.equal(first[key], second[key]) for key in first)


def test_missing_hub_snapshot_fails_clearly_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    model = ModelConfig(base="Qwen/Qwen3.5-0.8B", revision="2fc06364715b967f1860aea9cf38778875588b17")
    with pytest.raises(RuntimeError, match="Qwen/Qwen3.5-0.8B@2fc06364715b967f1860aea9cf38778875588b17 is not in"):
        prepare(model, DataConfig(states_per_group=8, allow_untested_groups=True), 2048, tmp_path / "base", tmp_path)
    assert not (tmp_path / "base").exists()
    assert not (tmp_path / "train").exists()


def test_a_hub_base_needs_a_pinned_revision():
    with pytest.raises(ValueError, match="pin model.revision"):
        ModelConfig(base="Qwen/Qwen3.5-0.8B")
