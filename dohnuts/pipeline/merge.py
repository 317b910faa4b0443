"""The merge step: LoRA folded into the frozen base, checked, written as a self-describing folder."""

from __future__ import annotations

from pathlib import Path

import torch
from PIL import Image

from ..config import LoraConfig, ModelConfig
from ..inputs.template import Template
from ..io import atomic_directory, read_json
from ..model.base import load_processors
from ..model.decision import DecisionModel
from ..runtime.checkpoint import load_adapter_model, verify_base, write_merged
from ..schema import parse_request

# Max abs logit difference allowed between merged and unmerged models: float32 differs only by
# summation order; bfloat16 rounds the merged weights to 8 mantissa bits.
TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2}


def _probe(template: Template, max_tokens: int):
    """A fixed text-and-image batch on which merged and unmerged logits are compared."""
    image = Image.new("RGB", (64, 64), "white")
    image.paste((220, 20, 20), (16, 16, 48, 48))
    request = parse_request({"note": "a red square", "image": image}, {
        "colour": {"type": "choice", "instructions": "What colour?", "criteria": ["red", "green", "blue"]},
        "big": {"type": "noul", "instructions": "Is it big?"},
    }, template.reserved, template.max_images)
    images = []
    indices = template.encode_images(request, images)
    return template.collate(template.encode(request, max_tokens, indices, images), images)


def merge(base: Path, adapter: Path, model: ModelConfig, lora: LoraConfig, out: Path) -> float:
    """Fold LoRA into the frozen base and write the merged folder (no temperatures yet).

    Returns:
        The max abs logit difference between merged and unmerged models on a probe batch.

    Raises:
        ArithmeticError: the difference exceeds the dtype's tolerance (nothing is written).
    """
    verify_base(base)
    decision, peft_model = load_adapter_model(base, model.dtype, lora, adapter, torch.device("cpu"))
    tokenizer, processor = load_processors(base, model)
    batch = _probe(Template.of(tokenizer, processor, model), model.max_tokens)
    with torch.no_grad():
        unmerged = decision(batch)
        merged_model = DecisionModel(peft_model.merge_and_unload(), decision.head).eval()
        error = (merged_model(batch) - unmerged).abs().max().item()
    if not error <= TOLERANCE[model.dtype]:
        raise ArithmeticError(f"merged logits differ from unmerged ones by {error:.3g} "
                              f"(tolerance {TOLERANCE[model.dtype]} in {model.dtype})")
    resolved = {"adapter": read_json(Path(adapter) / "config.json"),
                "adapter_manifest": read_json(Path(adapter) / "manifest.json"),
                "merge_max_abs_logit_error": error}
    with atomic_directory(out) as tmp:
        write_merged(tmp, merged_model.backbone, merged_model.head, tokenizer, processor, model, resolved)
    return error
