"""The base model folder: build the embedded tiny Qwen3.5, fetch a Hub snapshot, load either."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

from ..config import EMBEDDED, ModelConfig
from ..inputs.tokens import (
    END_OF_TEXT,
    IMAGE_PAD,
    SPATIAL_MERGE,
    TEMPORAL_PATCH,
    VIDEO_PAD,
    VISION_END,
    VISION_START,
    special_tokens,
)


def prepare_base(config: ModelConfig, out: Path, corpus: list[str]) -> None:
    """Write a Hugging Face-format base (weights, tokenizer, image processor) into `out`.

    The embedded default is built here from a fixed seed; a Hub id is downloaded at its
    pinned revision (or taken from the local Hugging Face cache).
    """
    out = Path(out)
    if config.base == EMBEDDED:
        _build_embedded(config, out, corpus)
    else:
        _download_snapshot(config, out)


def _build_embedded(config: ModelConfig, out: Path, corpus: list[str]) -> None:
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    shape = config.embedded
    tokenizer = train_tokenizer(corpus, special_tokens(config.marker_token), shape.vocab_size)
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in special_tokens(config.marker_token)}
    rotary = 0.5
    # M-RoPE splits the rotary half-dimension into temporal, height and width sections.
    half = int(shape.head_dim * rotary) // 2
    sections = [half - 2 * (half // 3), half // 3, half // 3]
    model_config = Qwen3_5Config(
        text_config=dict(
            vocab_size=shape.vocab_size,
            hidden_size=shape.hidden_size,
            intermediate_size=shape.intermediate_size,
            num_hidden_layers=len(shape.layer_types),
            layer_types=list(shape.layer_types),
            num_attention_heads=shape.num_attention_heads,
            num_key_value_heads=shape.num_key_value_heads,
            head_dim=shape.head_dim,
            linear_num_key_heads=shape.linear_num_key_heads,
            linear_num_value_heads=shape.linear_num_value_heads,
            linear_key_head_dim=shape.linear_key_head_dim,
            linear_value_head_dim=shape.linear_value_head_dim,
            linear_conv_kernel_dim=4,
            max_position_embeddings=8192,
            rms_norm_eps=1e-6,
            eos_token_id=ids[END_OF_TEXT],
            pad_token_id=ids[END_OF_TEXT],
            rope_parameters={"rope_type": "default", "rope_theta": 10_000_000, "partial_rotary_factor": rotary,
                             "mrope_interleaved": True, "mrope_section": sections},
        ),
        vision_config=dict(
            depth=shape.vision_depth,
            hidden_size=shape.vision_hidden_size,
            num_heads=shape.vision_heads,
            intermediate_size=shape.vision_intermediate_size,
            patch_size=shape.patch_size,
            spatial_merge_size=SPATIAL_MERGE,
            temporal_patch_size=TEMPORAL_PATCH,
            out_hidden_size=shape.hidden_size,
            num_position_embeddings=256,
        ),
        image_token_id=ids[IMAGE_PAD],
        video_token_id=ids[VIDEO_PAD],
        vision_start_token_id=ids[VISION_START],
        vision_end_token_id=ids[VISION_END],
        tie_word_embeddings=True,
    )
    torch.manual_seed(config.seed)
    model = Qwen3_5ForConditionalGeneration(model_config)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    new_image_processor(shape.patch_size).save_pretrained(out)


def train_tokenizer(corpus: list[str], specials: list[str], vocab_size: int, split: str | None = None):
    """A byte-level BPE tokenizer trained on `corpus`, with GPT-2's pre-tokenizer split, or the
    regular expression `split` (such as QWEN_SPLIT) instead."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    # Byte-level like Qwen's tokenizer, so any input text encodes without unknown tokens.
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.normalizer = normalizers.NFC()
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 64, special_tokens=specials, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token=END_OF_TEXT, pad_token=END_OF_TEXT,
        additional_special_tokens=[token for token in specials if token != END_OF_TEXT],
    )


def fixed_pixels(pixels: int) -> dict:
    """Image-processor settings that give every image `pixels` pixels. min/max_pixels too: a
    snapshot's preprocessor_config may carry them, and they win over size."""
    return {"size": {"shortest_edge": pixels, "longest_edge": pixels}, "min_pixels": pixels, "max_pixels": pixels}


def new_image_processor(patch_size: int, pixels: int | None = None):
    """A Qwen2-VL image processor for a base the project builds (merge 2, temporal patch 2,
    normalised to [-1, 1]); `pixels` fixes the pixel count of every image."""
    sizes = {} if pixels is None else fixed_pixels(pixels)
    return processor_class()(patch_size=patch_size, merge_size=SPATIAL_MERGE, temporal_patch_size=TEMPORAL_PATCH,
                             image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5], **sizes)


def processor_class():
    """The Qwen2-VL image processor class that needs no torchvision."""
    try:
        from transformers import Qwen2VLImageProcessorPil as Processor
    except ImportError:  # older transformers: the plain class is the PIL/NumPy one
        from transformers import Qwen2VLImageProcessor as Processor
    return Processor


def _download_snapshot(config: ModelConfig, out: Path) -> None:
    from huggingface_hub import snapshot_download

    name = f"{config.base}@{config.revision}"
    patterns = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"]
    try:
        folder = snapshot_download(config.base, revision=config.revision, allow_patterns=patterns,
                                   local_files_only=True)
    except Exception:
        try:
            folder = snapshot_download(config.base, revision=config.revision, allow_patterns=patterns)
        except Exception as error:
            raise RuntimeError(
                f"the base snapshot {name} is not in the local Hugging Face cache and the Hub "
                f"cannot be reached ({type(error).__name__}: {error}); download it on a connected "
                f"machine (huggingface-cli download {config.base} --revision {config.revision}) "
                f"and copy the cache, or set model.base: {EMBEDDED}"
            ) from None
    shutil.copytree(folder, out, dirs_exist_ok=True)


def import_backbone():
    """transformers' Qwen3.5 model class, imported at the first call (seconds of imports)."""
    from transformers import Qwen3_5Model

    return Qwen3_5Model


def load_backbone(folder: Path, dtype: torch.dtype):
    """The Qwen3.5 backbone (vision tower + language model, no LM head) from a HF folder."""
    return import_backbone().from_pretrained(folder, dtype=dtype)


def load_processors(folder: Path, config: ModelConfig):
    """The tokenizer (as its tokenizer.json says, `keep_whole_pieces`) and the image processor
    under the fixed preprocessing policy."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    keep_whole_pieces(tokenizer, Path(folder) / "tokenizer.json")
    return tokenizer, load_image_processor(folder, config)


def keep_whole_pieces(tokenizer, path: Path) -> None:
    """Give the tokenizer's BPE the `ignore_merges` its tokenizer.json states (a split piece that
    is a token stays whole, as Qwen's own tiktoken tokenizer keeps it). transformers 5's Qwen3.5
    tokenizer builds its BPE from the vocabulary and merges and leaves it out, and without it
    the template's tiktoken path (`inputs.vocabulary.tiktoken_encoder`), which gives the same
    ids as the file's tokenizer, is refused: a 1,287-token state was then tokenised in about
    3 ms on the H200's hosts, against 0.3."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or type(backend.model).__name__ != "BPE" or backend.model.ignore_merges or not path.is_file():
        return
    if _states_ignore_merges(path.read_text(encoding="utf-8")):
        backend.model.ignore_merges = True


_IGNORE_MERGES = '"ignore_merges"'
_BOOLEAN = re.compile(r"\s*:\s*(true|false)")


def _states_ignore_merges(text: str) -> bool:
    """Whether a tokenizer.json's text states a BPE model with `ignore_merges`. Where the key
    occurs once, with a boolean value, that is the model's (inside a string its quotes would be
    escaped; a vocabulary entry's value is an id): read there, since parsing the Qwen3.5 file's
    33 MB took 0.7 s of every load. Else from the parsed file."""
    if text.count(_IGNORE_MERGES) == 1:
        value = _BOOLEAN.match(text, text.index(_IGNORE_MERGES) + len(_IGNORE_MERGES))
        if value is not None:
            return value[1] == "true"
    model = json.loads(text).get("model", {})
    return model.get("type") == "BPE" and bool(model.get("ignore_merges"))


def load_image_processor(folder: Path, config: ModelConfig):
    """The folder's image processor: its normalisation and patching, with the pixel count
    fixed by the policy."""
    return processor_class().from_pretrained(folder, **fixed_pixels(config.image_pixels))
