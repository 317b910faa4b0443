"""Configuration sections: the project's params.yaml loads; bad keys and values are named."""

from pathlib import Path

import pytest

from dohnuts.config import SECTIONS, ConfigError, init_mode, read_params, section

ROOT = Path(__file__).resolve().parents[1]


def test_every_section_of_params_yaml_loads_and_nothing_is_left_over():
    params = read_params(ROOT / "params.yaml")
    for name in SECTIONS:
        section(params, name)
    assert set(params) == set(SECTIONS) | {"seed", "init"}
    assert init_mode(params) == "base"


def test_unknown_keys_are_rejected_with_their_names():
    with pytest.raises(ConfigError, match=r"train has unknown keys \['stpes'\]"):
        section({"train": {"stpes": 3}}, "train")
    with pytest.raises(ConfigError, match=r"train.objective has unknown keys \['sigmma'\]"):
        section({"train": {"objective": {"sigmma": 0.3}}}, "train")


@pytest.mark.parametrize("params, message", [
    ({"train": {"steps": 0}}, "train.steps must be >= 1, got 0"),
    ({"model": {"dtype": "float16"}}, "model.dtype must be float32 or bfloat16, got 'float16'"),
    ({"lora": {"targets": ["q_proj", "qkv"]}}, "lora.targets has unknown modules ['qkv']"),
    ({"data": {"partitions": {"train": 1.0}}}, "data.partitions must name train, dev, calibration and test"),
    ({"calibrate": {"min_temperature": 5.0, "max_temperature": 1.0}}, "0 < min < max, got 5.0, 1.0"),
    ({"model": {"embedded": {"layer_types": ["full_attention"]}}}, "must mix linear_attention and full_attention"),
    ({"train": {"lora_lr": "1e-4"}}, "train.lora_lr must be a number, got '1e-4' (write 1.0e-4"),
    ({"train": {"activation_checkpointing": "false"}}, "train.activation_checkpointing must be true or false"),
    ({"train": {"steps": 2.5}}, "train.steps must be an integer, got 2.5"),
    ({"lora": {"targets": "q_proj"}}, "lora.targets must be a list of strings"),
    ({"model": {"base": None}}, "model.base must not be empty"),
    ({"train": {"group_cap": 0}}, "train.group_cap must be >= 1"),
])
def test_invalid_values_are_rejected_with_the_offending_value(params, message):
    with pytest.raises(ConfigError) as caught:
        section(params, next(iter(params)))
    assert message in str(caught.value)


def test_init_must_be_base_or_checkpoint():
    assert init_mode({"init": "checkpoint"}) == "checkpoint"
    with pytest.raises(ConfigError, match="init must be one of"):
        init_mode({"init": "parent"})
