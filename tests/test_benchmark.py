"""The benchmark's training-update record on the CPU (tiny model)."""

import torch

from dohnuts.base import load_backbone
from dohnuts.benchmark import training_update_record
from dohnuts.model import DecisionModel, new_head
from dohnuts.telemetry import measure_ceilings


def test_training_update_record_steps_lora_only_and_counts_shared_prefixes(tiny):
    backbone = load_backbone(tiny.base, torch.float32)
    model = DecisionModel(backbone, new_head(backbone.config.text_config.hidden_size, 0.01))
    frozen = {name: p.detach().clone() for name, p in model.named_parameters()}
    record = training_update_record(model, tiny.template(), measure_ceilings(model.device), microbatches=2, rows=4,
                                    timed=1)
    assert record["microbatches"] == 2 and record["rows_per_microbatch"] == 4
    # Rows of a state share their prefix: fewer tokens computed than given.
    assert 0 < record["computed_tokens"] < record["input_tokens"]
    assert record["p50_ms"] > 0 and record["tokens_per_second"] > 0
    assert record["roofline"]["work"]["flops"]["total"] > 0
    # peft renames a wrapped layer's own weight to base_layer.weight.
    after = {name.replace(".base_layer", ""): p for name, p in model.named_parameters()}
    changed = {name for name, p in after.items() if name not in frozen or not torch.equal(p, frozen[name])}
    assert changed and all("lora_" in name or name.startswith("head.") for name in changed)
    assert not model.training
