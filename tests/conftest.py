"""Shared tiny fixtures: an embedded Qwen3.5 base and a small mixture, built once per session."""

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from dohnuts.config import DataConfig, ModelConfig
from dohnuts.model.base import load_processors
from dohnuts.model.template import Template
from dohnuts.pipeline.prepare import prepare


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

    def template(self) -> Template:
        tokenizer, processor = load_processors(self.base, self.model)
        return Template(tokenizer, processor, self.model.marker_token)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> Tiny:
    root = tmp_path_factory.mktemp("tiny")
    model = ModelConfig(image_pixels=64 * 64)
    data = DataConfig(states_per_group=12)
    prepare(model, data, root / "base", root)
    return Tiny(root, model, data)


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
