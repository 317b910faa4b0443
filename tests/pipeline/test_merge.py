"""Merged LoRA equals unmerged LoRA; the written folder reloads with verified hashes."""

import pytest
import torch

from dohnuts.config import LoraConfig
from dohnuts.data.records import RecordReader, encode_examples, load_records
from dohnuts.io import IntegrityError
from dohnuts.pipeline.merge import merge
from dohnuts.runtime.checkpoint import build_training_model, load_merged, write_adapter_checkpoint

TOLERANCE = 1e-5  # float32 logits, max abs error


@pytest.fixture(scope="module")
def adapter(tiny, tmp_path_factory):
    """An adapter whose LoRA B matrices are non-zero, so the merge changes the weights."""
    folder = tmp_path_factory.mktemp("adapter")
    model, peft_model = build_training_model(tiny.base, "float32", LoraConfig(), 0.01, seed=0)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, 0.05, generator=generator)
    write_adapter_checkpoint(folder, model, peft_model, tiny.adapter_config())
    return folder, model


def _batch(tiny, template):
    reader = RecordReader(tiny.partition("test"))
    rows = load_records(tiny.partition("test"))
    picked = rows.groupby("group").head(2)  # text and image rows of every group
    examples = [reader.example(row) for _, row in picked.iterrows()]
    encoded, images, _ = encode_examples(template, examples, 4096)
    return template.collate(encoded, images)


def test_merged_model_gives_the_unmerged_logits(tiny, adapter, tmp_path):
    folder, unmerged = adapter
    merge(tiny.base, folder, tiny.model, LoraConfig(), tmp_path / "merged")
    merged, template, _, calibrator = load_merged(tmp_path / "merged", torch.device("cpu"))
    batch = _batch(tiny, template)
    assert batch.pixel_values is not None
    with torch.no_grad():
        expected = unmerged.eval()(batch)
        actual = merged(batch)
        plain, _ = build_training_model(tiny.base, "float32", LoraConfig(), 0.01, seed=0)
        base_only = plain.eval()(batch)
    assert calibrator is None
    assert (actual - expected).abs().max().item() <= TOLERANCE
    assert (base_only - expected).abs().max().item() > 100 * TOLERANCE  # the adapter matters


def test_merged_folder_refuses_to_load_after_tampering(tiny, adapter, tmp_path):
    folder, _ = adapter
    merge(tiny.base, folder, tiny.model, LoraConfig(), tmp_path / "merged")
    with open(tmp_path / "merged" / "head.safetensors", "ab") as handle:
        handle.write(b"\0")
    with pytest.raises(IntegrityError, match="head.safetensors has SHA-256"):
        load_merged(tmp_path / "merged", torch.device("cpu"))


def test_changed_weights_are_refused_before_the_backbone_reads_them(tiny, adapter, tmp_path, monkeypatch):
    """The manifest is checked on a thread while the backbone's code imports
    (`checked_while_importing`); a changed weights file still stops the load, and nothing reads
    the weights before the check has passed."""
    from dohnuts.runtime import checkpoint

    folder, _ = adapter
    merge(tiny.base, folder, tiny.model, LoraConfig(), tmp_path / "merged")
    weights = next((tmp_path / "merged").glob("model*.safetensors"))
    with open(weights, "r+b") as handle:  # one byte of the last tensor's data changed
        handle.seek(-1, 2)
        last = handle.read(1)
        handle.seek(-1, 2)
        handle.write(bytes([last[0] ^ 1]))
    monkeypatch.setattr(checkpoint, "load_backbone", lambda *_: pytest.fail("the weights were read unchecked"))
    with pytest.raises(IntegrityError, match=f"{weights.name} has SHA-256"):
        load_merged(tmp_path / "merged", torch.device("cpu"))
