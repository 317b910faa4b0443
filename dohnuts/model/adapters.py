"""LoRA adapters: injection into the language model, and the trainable weights under stable names."""

from __future__ import annotations

import torch

from ..config import LoraConfig
from .decision import HEAD_KEY, DecisionModel


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


def adapter_state(model: DecisionModel, peft_model) -> dict[str, torch.Tensor]:
    """The trainable weights (LoRA and head) under stable names."""
    from peft import get_peft_model_state_dict

    state = {f"lora.{key}": value.detach().float().contiguous()
             for key, value in get_peft_model_state_dict(peft_model).items()}
    state[HEAD_KEY] = model.head.weight.detach().float().contiguous()
    return state


def load_adapter_state(model: DecisionModel, peft_model, loaded: dict[str, torch.Tensor], source: str) -> None:
    """Set LoRA and head weights from `loaded` (named as `adapter_state` names them), refusing a
    state whose keys or shapes differ from the model's; `source` names it in errors.

    Raises:
        ValueError: missing, unexpected or mis-shaped keys.
    """
    from peft import set_peft_model_state_dict

    expected = adapter_state(model, peft_model)
    missing = sorted(set(expected) - set(loaded))
    unexpected = sorted(set(loaded) - set(expected))
    wrong = sorted(key for key in set(expected) & set(loaded) if expected[key].shape != loaded[key].shape)
    if missing or unexpected or wrong:
        shapes = [f"{key}: {tuple(loaded[key].shape)} vs {tuple(expected[key].shape)}" for key in wrong[:3]]
        raise ValueError(
            f"{source} does not fit this model: {len(missing)} missing keys {missing[:3]}, "
            f"{len(unexpected)} unexpected keys {unexpected[:3]}, mis-shaped {shapes}"
        )
    lora = {key[len("lora."):]: value for key, value in loaded.items() if key.startswith("lora.")}
    result = set_peft_model_state_dict(peft_model, lora)
    if getattr(result, "unexpected_keys", None):
        raise ValueError(f"{source}: peft rejected keys {result.unexpected_keys[:3]}")
    with torch.no_grad():
        model.head.weight.copy_(loaded[HEAD_KEY])
