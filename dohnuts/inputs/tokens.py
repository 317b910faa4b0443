"""The Qwen3.5 vocabulary's fixed pieces: special tokens, the vision block's geometry, the split."""

from __future__ import annotations

VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
END_OF_TEXT = "<|endoftext|>"
SPATIAL_MERGE = 2
TEMPORAL_PATCH = 2
# Qwen3.5's pre-tokenizer split (its tokenizer's PRETOKENIZE_REGEX, used with NFC
# normalisation): words with one leading non-letter, single digits, punctuation runs,
# newlines and spaces.
QWEN_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"""
              r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")


def special_tokens(marker: str) -> list[str]:
    """Special tokens the template and image path need; the marker comes first."""
    return [marker, VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD, END_OF_TEXT]
