"""LoRA adapters: injection, the unmerged LoRA + head file of a checkpoint, and its verification."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..config import LoraConfig, to_dict
from ..io import read_json, verify_manifest
from .base import load_backbone
from .decision import DTYPES, HEAD_KEY, DecisionModel, new_head

ADAPTER = "adapter.safetensors"  # unmerged LoRA + head weights in a checkpoint folder


def lora_target_pattern(targets) -> str:
    """peft target regex: the listed projections of the language model only, never vision."""
    return rf".*language_model\.layers\.\d+\.(self_attn|linear_attn|mlp)\.({'|'.join(targets)})"


def with_lora(backbone, lora: LoraConfig, seed: int):
    """Inject LoRA adapters into the language model (in place); returns the peft model."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    torch.manual_seed(seed)  # LoRA A matrices are initialised from the global generator
    config = PeftLoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, bias="none",
                            target_modules=lora_target_pattern(lora.targets))
    return get_peft_model(backbone, config)


def build_training_model(base: Path, dtype: str, lora: LoraConfig, head_std: float, seed: int):
    """A fresh trainable model: base backbone (verify it once per run with `verify_base`), new
    LoRA, new head.

    Returns:
        (model, peft_model)
    """
    backbone = load_backbone(base, DTYPES[dtype])
    peft_model = with_lora(backbone, lora, seed)
    generator = torch.Generator().manual_seed(seed)
    head = new_head(backbone.config.text_config.hidden_size, head_std, generator)
    return DecisionModel(peft_model.get_base_model(), head), peft_model


def adapter_state(model: DecisionModel, peft_model) -> dict[str, torch.Tensor]:
    """The trainable weights (LoRA and head) under stable names."""
    from peft import get_peft_model_state_dict

    state = {f"lora.{key}": value.detach().float().contiguous()
             for key, value in get_peft_model_state_dict(peft_model).items()}
    state[HEAD_KEY] = model.head.weight.detach().float().contiguous()
    return state


def save_adapter(path: Path, model: DecisionModel, peft_model) -> None:
    save_file(adapter_state(model, peft_model), str(path))


def load_adapter(path: Path, model: DecisionModel, peft_model) -> None:
    """Load LoRA and head weights, refusing a file whose keys or shapes differ from the model's.

    Raises:
        ValueError: missing, unexpected or mis-shaped keys.
    """
    from peft import set_peft_model_state_dict

    loaded = load_file(str(path))
    expected = adapter_state(model, peft_model)
    missing = sorted(set(expected) - set(loaded))
    unexpected = sorted(set(loaded) - set(expected))
    wrong = sorted(key for key in set(expected) & set(loaded) if expected[key].shape != loaded[key].shape)
    if missing or unexpected or wrong:
        shapes = [f"{key}: {tuple(loaded[key].shape)} vs {tuple(expected[key].shape)}" for key in wrong[:3]]
        raise ValueError(
            f"{path} does not fit this model: {len(missing)} missing keys {missing[:3]}, "
            f"{len(unexpected)} unexpected keys {unexpected[:3]}, mis-shaped {shapes}"
        )
    lora = {key[len("lora."):]: value for key, value in loaded.items() if key.startswith("lora.")}
    result = set_peft_model_state_dict(peft_model, lora)
    if getattr(result, "unexpected_keys", None):
        raise ValueError(f"{path}: peft rejected keys {result.unexpected_keys[:3]}")
    with torch.no_grad():
        model.head.weight.copy_(loaded[HEAD_KEY])


def load_adapter_model(base: Path, dtype: str, lora: LoraConfig, folder: Path, device):
    """The base with LoRA and head from a checkpoint folder whose manifest is verified first.

    Returns:
        (DecisionModel in eval mode on `device`, peft model)
    """
    verify_manifest(folder, required=(ADAPTER,))
    check_adapter_config(folder, lora)
    model, peft_model = build_training_model(base, dtype, lora, head_std=0.01, seed=0)
    load_adapter(Path(folder) / ADAPTER, model, peft_model)
    return model.to(device).eval(), peft_model


def verify_base(base: Path) -> None:
    """Check the base folder against the SHA-256 manifest prepare wrote."""
    verify_manifest(base, required=("config.json",))


def check_adapter_config(folder: Path, lora: LoraConfig) -> None:
    """Refuse a checkpoint trained with other LoRA settings: alpha or dropout differences keep
    every shape yet change what the weights mean.

    Raises:
        ValueError: naming each differing setting.
    """
    path = Path(folder) / "config.json"
    if not path.is_file():
        return
    saved = read_json(path).get("lora")
    if saved is None:
        return
    wanted = to_dict(lora)
    differ = {key: (saved.get(key), wanted[key]) for key in wanted if saved.get(key) != wanted[key]}
    if differ:
        details = ", ".join(f"lora.{key}: checkpoint {a!r}, params {b!r}" for key, (a, b) in differ.items())
        raise ValueError(f"{folder} was trained with other LoRA settings ({details})")


def verify_parent(parent: Path) -> Path:
    """The parent's adapter file after checking every SHA-256 of its manifest.

    Raises:
        FileNotFoundError: no parent checkpoint there; IntegrityError: a hash differs.
    """
    parent = Path(parent)
    if not (parent / ADAPTER).is_file():
        raise FileNotFoundError(
            f"init: checkpoint needs a parent checkpoint in {parent}, but it holds no {ADAPTER}; "
            f"publish one first (python -m stages.publish --source runs/select/adapter --target {parent})"
        )
    verify_manifest(parent, required=(ADAPTER,))
    return parent / ADAPTER
