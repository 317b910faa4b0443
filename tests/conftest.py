"""Shared tiny fixtures: an embedded Qwen3.5 base and a small mixture, built once per session."""

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from dohnuts.config import CalibrateConfig, DataConfig, LoraConfig, ModelConfig, to_dict
from dohnuts.inputs.template import Template
from dohnuts.model.base import load_processors
from dohnuts.pipeline.calibrate import calibrate
from dohnuts.pipeline.merge import merge
from dohnuts.pipeline.prepare import prepare
from dohnuts.runtime.checkpoint import base_fingerprint, build_training_model, write_adapter_checkpoint


@dataclass
class Tiny:
    root: Path
    model: ModelConfig
    data: DataConfig

    @property
    def base(self) -> Path:
        return self.root / "base"

    def partition(self, name: str) -> Path:
        return self.root / name

    def adapter_config(self, lora: LoraConfig | None = None) -> dict:
        """What a checkpoint's config.json must state for the loaders: LoRA settings and base."""
        return {"lora": to_dict(lora or LoraConfig()), "base": base_fingerprint(self.base)}

    def template(self) -> Template:
        tokenizer, processor = load_processors(self.base, self.model)
        return Template.of(tokenizer, processor, self.model)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> Tiny:
    root = tmp_path_factory.mktemp("tiny")
    model = ModelConfig(image_pixels=64 * 64)
    data = DataConfig(states_per_group=12, allow_untested_groups=True)  # so few states: a group may miss test
    prepare(model, data, 2048, root / "base", root)
    return Tiny(root, model, data)


@pytest.fixture(scope="session")
def deployable(tiny, tmp_path_factory):
    """A calibrated checkpoint of the tiny base with random LoRA (merge, then calibrate).
    Returns (root, calibrate metrics); the checkpoint is root / "checkpoint"."""
    root = tmp_path_factory.mktemp("deploy")
    model, peft_model = build_training_model(tiny.base, "float32", LoraConfig(), 0.5, seed=0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, 0.05)
    (root / "adapter").mkdir()
    write_adapter_checkpoint(root / "adapter", model, peft_model, tiny.adapter_config())
    error = merge(tiny.base, root / "adapter", tiny.model, LoraConfig(), root / "merged")
    assert error <= 1e-4
    metrics = calibrate(root / "merged", tiny.partition("calibration"), CalibrateConfig(min_rows=2),
                        root / "checkpoint")
    return root, metrics


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


def pytest_collection_modifyitems(config, items):
    """GPU tests skip cleanly without CUDA."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
